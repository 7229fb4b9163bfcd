"""Embeddings handed between processes of one host as files in the shared-memory directory: one process
receives an item's payload straight into a file-backed tensor, another maps the file as its tensor
(no copy).

Liveness is the same flock scheme as the shared-memory transport's (`encoder_common.shm_files`): each
process holds the lock file of its instance for its whole life, so a sweep can tell a dead process's
files from a live one's, across PID namespaces too (containers sharing one memory-backed volume).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import threading
from pathlib import Path

import numpy as np
import torch

from encoder_common.shm_files import create_locked, shm_dir, sweep_instances

# A tmpfs every process of an engine sees: $ENCODER_SHM_DIR (read at import), else /dev/shm.
DEFAULT_DIRECTORY = shm_dir()

_instances: dict[tuple[Path, str, int], str] = {}  # (directory, prefix, pid) -> this process's instance
_locks: list[int] = []  # the instances' lock fds, open for the process's life: the kernel drops them at exit
_instances_lock = threading.Lock()


def _instance(directory: Path, prefix: str) -> str:
    """This process's instance under `prefix` in `directory`, `<prefix>.<pid>.<128 random bits>`;
    its lock file is created (and held) the first time."""
    key = (directory, prefix, os.getpid())  # a forked child gets an instance (and a lock) of its own
    with _instances_lock:
        instance = _instances.get(key)
        if instance is None:
            instance = f"{prefix}.{os.getpid()}.{secrets.token_hex(16)}"
            _locks.append(create_locked(directory / f"{instance}.lock"))
            _instances[key] = instance
    return instance


def new_item_path(directory: Path, prefix: str) -> Path:
    """A fresh file name `<instance>.item.<random>` of this process's instance (see `sweep_dead`)."""
    return directory / f"{_instance(directory, prefix)}.item.{secrets.token_hex(8)}"


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


def sweep_dead(directory: Path, prefix: str) -> list[str]:
    """Removes the files under `prefix` whose process is gone (its instance's lock is free); returns
    their names. Files of live processes, this one's included, are left alone."""
    instance = rf"{re.escape(prefix)}\.\d+\.[0-9a-f]{{32}}"
    name = re.compile(rf"(?P<instance>{instance})\.(?:lock|item\.[0-9a-f]{{16}})")
    return sweep_instances(directory, name, lambda instance: f"{instance}.lock")
