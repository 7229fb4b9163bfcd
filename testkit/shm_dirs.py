"""A small tmpfs standing in for /dev/shm, so that shared memory can run out the way a small /dev/shm
does (the soak's `shm_full` fault, the pool's tests); only a process that may mount one (root) gets it."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def small_shm_dir(parent: Path, nbytes: int) -> Iterator[tuple[Path, bool]]:
    """`parent/shm`, a tmpfs of `nbytes` when this process may mount one, else a plain directory;
    yields the path and whether it is the tmpfs."""
    path = parent / "shm"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(path)],
                             capture_output=True).returncode == 0  # fmt: skip
    try:
        yield path, mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
