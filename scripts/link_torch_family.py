"""Hard-links the torch family of the running interpreter's environment into another venv.

The torch family (torch, torchvision, triton and the CUDA libraries torch pins: 4.6 GB) is the same
pinned set in .venv and in every engine venv. scripts/engine_venv.sh runs this with .venv's Python
before pip installs torch into a new venv, so the venvs share one copy on disk and pip finds the
pinned releases already installed. A distribution the target already has is left alone; nothing is
linked where the target lies on another filesystem (pip then installs as usual).

Usage: .venv/bin/python scripts/link_torch_family.py TARGET_SITE_PACKAGES
"""

import os
import sys
from importlib.metadata import Distribution, distributions
from pathlib import Path


def _name(dist: Distribution) -> str:
    return dist.metadata["Name"].lower().replace("_", "-")


def in_torch_family(name: str) -> bool:
    return name in ("torch", "torchvision", "triton") or name.startswith(("nvidia-", "cuda-"))


def link_into(target: Path) -> int:
    """Links each torch-family distribution the target lacks; returns how many were linked."""
    present = {_name(d) for d in distributions(path=[str(target)])}
    linked = 0
    for dist in distributions():
        name = _name(dist)
        if not in_torch_family(name) or name in present:
            continue
        if os.stat(dist.locate_file("")).st_dev != os.stat(target).st_dev:
            return linked
        for path in dist.files or ():
            if path.parts[0] == "..":  # console scripts in bin/ name this venv's interpreter
                continue
            src, dst = Path(dist.locate_file(path)), target / path
            if src.is_file() and not dst.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.link(src, dst)
        present.add(name)
        linked += 1
    return linked


if __name__ == "__main__":
    link_into(Path(sys.argv[1]))
