"""Hard-links the torch family of the running interpreter's environment into another venv.

The torch family (torch, torchvision, triton and the CUDA libraries torch pins: 4.6 GB) is the same
pinned set in .venv and in every engine venv. scripts/engine_venv.sh runs this with .venv's Python
before pip installs torch into a new venv, so the venvs share one copy on disk and pip finds the
pinned releases already installed. A distribution the target already has is left alone; nothing is
linked where the target lies on another filesystem, and linking stops at the first distribution that
fails to link (pip then installs what is missing as usual).

Usage: .venv/bin/python scripts/link_torch_family.py TARGET_SITE_PACKAGES
"""

import contextlib
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
        made: list[Path] = []  # the files linked, and the folders they went to
        folders: set[Path] = set()
        try:
            for path in dist.files or ():
                if path.parts[0] == "..":  # console scripts in bin/ name this venv's interpreter
                    continue
                src, dst = Path(dist.locate_file(path)), target / path
                if src.is_file() and not dst.exists():
                    folders.add(dst.parent)
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    os.link(src, dst)
                    made.append(dst)
        except OSError as exc:  # half a distribution would look installed to pip: take it back, stop
            for dst in made:
                dst.unlink()
            emptied = {d for f in folders for d in (f, *f.parents) if d.is_relative_to(target)} - {target}
            for folder in sorted(emptied, key=lambda d: len(d.parts), reverse=True):
                with contextlib.suppress(OSError):  # not empty: it holds what was there before
                    folder.rmdir()
            print(f"link_torch_family: {name} not linked ({exc}); pip installs the rest", file=sys.stderr)
            return linked
        present.add(name)
        linked += 1
    return linked


if __name__ == "__main__":
    link_into(Path(sys.argv[1]))
