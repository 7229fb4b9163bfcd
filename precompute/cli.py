"""`encoder-precompute`'s entry point: checks that the server extra is installed before importing the
command (precompute.command), which needs it from its first line."""

from __future__ import annotations

import argparse

from encoder_common.extras import require_extra


def build_parser() -> argparse.ArgumentParser:
    from .command import build_parser as build

    return build()


def main(argv: list[str] | None = None) -> int:
    require_extra("server", "encoder-precompute")
    from .command import main as run

    return run(argv)
