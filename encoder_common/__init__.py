"""Runtime helpers both the encoder server and the receiver use: the domain errors and their status
codes, the env-reading flag parser, and the readers of `data:` and `file://` item URLs."""
