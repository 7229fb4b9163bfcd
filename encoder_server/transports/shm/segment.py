"""One segment of the server's shared-memory pool: a file under /dev/shm, allocated once and kept
mapped read-write for the server's whole life, written item after item once its receiver released it."""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from encoder_common.copies import copy_parts
from protos.shm import HEADER_BYTES, random_name


class Segment:
    """One pool file, mapped read-write for the server's whole life.

    Named `<instance>.pool.<random>`, allocated once (fallocate: a full volume shows up as ENOSPC here,
    never as SIGBUS later) and kept mapped: filling fresh tmpfs pages costs several times a copy into warm
    ones. Each use is announced under a hard link `<instance>.seg.<random>`, a name used once; the
    receiver's unlink drops the link count back to 1 (`released`), and the segment is used again. One
    taken back while its name was still there may be under a receiver's tensor: it is never written again,
    and its memory goes with the last mapping of it.
    """

    def __init__(self, directory: Path, instance: str, capacity: int, owner: int):
        self.path = directory / random_name(instance, "pool")
        self.capacity = capacity
        self.owner = owner
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            if owner != os.geteuid():
                os.fchown(fd, owner, -1)  # a root server serving another user's receiver
            os.posix_fallocate(fd, 0, capacity)
            self._map = mmap.mmap(fd, capacity)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        self.fd = fd
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.public: Path | None = None  # the announced name while a receiver has not released it
        self.taken_back = False  # taken back unreleased: a receiver may still map it, never reuse it
        self.placed_at = 0.0
        self.last_used = time.monotonic()

    def released(self) -> bool:
        return os.fstat(self.fd).st_nlink < 2

    def write(self, header: bytes, parts: Sequence[memoryview]) -> None:
        """Header last, and zeroed first: a receiver still reading an old use sees the change."""
        self._map[:HEADER_BYTES] = bytes(HEADER_BYTES)
        flat = [np.frombuffer(part, dtype=np.uint8) for part in parts]
        end = HEADER_BYTES + sum(len(part) for part in flat)
        copy_parts(self.bytes[HEADER_BYTES:end], flat)  # into pages already there
        self._map[:HEADER_BYTES] = header

    def close(self) -> None:
        for path in (self.public, self.path):
            if path is not None:
                path.unlink(missing_ok=True)
        del self.bytes
        self._map.close()
        os.close(self.fd)
