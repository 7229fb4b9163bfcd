"""Embeddings handed between processes of one host as files under /dev/shm: one process receives an
item's payload straight into a file-backed tensor, another maps the file as its tensor (no copy)."""

from __future__ import annotations

import mmap
import os
import secrets
from pathlib import Path

import numpy as np
import torch

# A tmpfs every process of an engine sees.
DEFAULT_DIRECTORY = Path("/dev/shm")


def new_item_path(directory: Path, prefix: str) -> Path:
    """A fresh file name `<prefix>.<pid>.<random>`; the pid lets `sweep_dead` find what a dead process left."""
    return directory / f"{prefix}.{os.getpid()}.{secrets.token_hex(8)}"


def create_item_file(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor backed by a new file of the exact size (0600): a receiver writes the payload into it."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # a full tmpfs fails here, not with SIGBUS on a later write
        mapping = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8)).view(dtype).reshape(shape)


def map_item_file(path: str | Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The file's tensor, mapped copy-on-write: its pages are shared with the page cache, never copied
    unless written. The mapping outlives the file's name."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_COPY)
    return torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8)).view(dtype).reshape(shape)


def sweep_dead(directory: Path, prefix: str) -> None:
    """Removes the files under `prefix` whose process is gone."""
    for path in directory.glob(f"{prefix}.*"):
        try:
            os.kill(int(path.name.split(".")[1]), 0)
        except (ValueError, IndexError, PermissionError):
            continue  # not one of ours, or another user's live process
        except ProcessLookupError:
            path.unlink(missing_ok=True)
