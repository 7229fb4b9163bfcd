"""The sections of scripts/bench.py, one module each (transport, serving, batching, scale_out, cache,
image_sizes), and what they share: the run's profile (`profile`), its context and child processes
(`context`), the closed-loop clients (`clients`), the goals and the printed table (`report`).

Imported by scripts/bench.py, which puts this folder's parent on sys.path as Python does for a script.
"""
