"""The parts of scripts/bench_affinity.py, the placement benchmark: the workloads it draws (`workloads`),
the placement modes run interleaved on fleets of their own (`modes`), and the scenarios that change a
fleet while it serves (`fleet_changes`: an encoder leaving, an encoder made slow).

Imported by scripts/bench_affinity.py, which puts this folder's parent on sys.path as Python does for a script.
"""
