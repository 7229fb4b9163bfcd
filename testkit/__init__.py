"""Tooling for the tests, the benchmarks and the demo (never installed): tiny real checkpoints
(`checkpoints`, `default_model`), real images (`images`), the encoder double (`encoders`), encoder
servers in-process (`servers`) or as child processes (`launcher`), the in-process reference
(`reference`) and an RPC-logging server (`rpc_log`)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
