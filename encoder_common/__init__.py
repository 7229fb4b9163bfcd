"""Runtime helpers both the encoder server and the receiver use: the domain errors and their status
codes, the env-reading flag parser, the readers of `data:` and `file://` item URLs, and the
shared-memory files' directory, liveness locks and sweeping."""
