"""Tensors that payloads are received into. Large ones live on huge pages and are recycled once the
caller drops them, because fresh memory is the slowest thing a receiver writes to: every 4 KiB page
of it faults and is zeroed on the first write (measured on a 2-core x86-64 VM: a copy into a new
32 MiB buffer ran at 1.9 GB/s instead of 13 GB/s), whatever carried the bytes, the stream or shared memory.
"""

from __future__ import annotations

import math
import mmap
import threading
import weakref

import numpy as np
import torch

# Below this glibc serves (and reuses) heap memory itself.
POOLED_FROM = 4 << 20
_HUGE_PAGE = 2 << 20


def huge_page_memory(nbytes: int) -> mmap.mmap:
    """Private anonymous memory of at least `nbytes`, a whole number of huge pages, on huge pages where
    the kernel has them: 512x fewer faults on its first use."""
    memory = mmap.mmap(-1, huge_pages(nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return memory


def huge_pages(nbytes: int) -> int:
    """`nbytes` rounded up to whole huge pages."""
    return -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE


class BufferPool:
    """Keeps up to `max_idle_bytes` of released payload buffers for reuse; thread-safe."""

    def __init__(self, max_idle_bytes: int = 256 << 20):
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[mmap.mmap] = []
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        return sum(len(b) for b in self._idle)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor; when it (and every view of it) is gone, its memory comes back here."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < POOLED_FROM:
            return torch.empty(shape, dtype=dtype)
        buffer = self._take(nbytes)
        if buffer is None:
            buffer = huge_page_memory(nbytes)
        array = np.frombuffer(buffer, dtype=np.uint8, count=nbytes)
        weakref.finalize(array, self._give_back, buffer)  # the tensor's storage holds `array`
        return torch.from_numpy(array).view(dtype).reshape(shape)

    def _take(self, nbytes: int) -> mmap.mmap | None:
        """The smallest idle buffer that fits without wasting more than half of it."""
        with self._lock:
            fitting = [b for b in self._idle if nbytes <= len(b) <= 2 * nbytes]
            if not fitting:
                return None
            buffer = min(fitting, key=len)
            self._idle.remove(buffer)
            return buffer

    def _give_back(self, buffer: mmap.mmap) -> None:
        with self._lock:
            self._idle.append(buffer)
            while self.idle_bytes > self.max_idle_bytes:
                self._idle.pop(0)  # oldest first; unmapped once nothing refers to it


# One pool per process: released buffers serve whichever receiver allocates next.
POOL = BufferPool()
