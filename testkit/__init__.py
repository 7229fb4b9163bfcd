"""Tooling for the tests, the benchmarks and the demo (never installed): tiny real checkpoints
(`checkpoints`, `default_model`), real images (`images`), the encoder double (`encoders`), encoder
servers in-process (`servers`) or as child processes (`launcher`), the in-process reference
(`reference`) and an RPC-logging server (`rpc_log`); `load_script` imports a script of scripts/ by
name, for the tests that call its functions."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parent.parent


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # where dataclasses look a module's names up while it runs
    spec.loader.exec_module(module)
    return module
