"""The optional dependencies each command needs (pyproject.toml's extras), checked before the command
imports them, so that a missing one is named in one line with the pip command that installs it."""

from __future__ import annotations

import importlib.util
import sys

# The top-level modules each extra of pyproject.toml installs.
EXTRA_MODULES = {
    "server": ("transformers", "torchvision", "PIL", "grpc_reflection", "tqdm", "zmq", "aiohttp"),
    "gateway": ("aiohttp",),
}


def require_extra(extra: str, prog: str) -> None:
    """Exits with status 1 and one line on stderr when a module of `extra` is not importable."""
    missing = [module for module in EXTRA_MODULES[extra] if not _importable(module)]
    if missing:
        print(
            f"{prog}: missing {', '.join(missing)}; install it with: pip install 'encoder-service[{extra}]'",
            file=sys.stderr,
        )
        raise SystemExit(1)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: blocked (None in sys.modules) or half-imported
        return False
