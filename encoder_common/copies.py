"""Large host copies split across threads: one thread's memcpy leaves memory bandwidth unused, and numpy
releases the GIL while it copies, so plain threads do it."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# Below this a copy stays on the calling thread: handing a share to another costs tens of microseconds.
SPLIT_FROM = 4 << 20
# Past a few threads a copy is bound by memory bandwidth, not by the threads copying.
MAX_THREADS = min(4, os.cpu_count() or 1)

_helpers: ThreadPoolExecutor | None = None
_helpers_lock = threading.Lock()


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """`np.copyto(dst, src)` for flat uint8 arrays of one length, split as `copy_parts` splits it."""
    copy_parts(dst, [src])


def copy_parts(dst: np.ndarray, parts: Sequence[np.ndarray]) -> None:
    """Copies `parts` (flat uint8 arrays) back to back into `dst`, whose length is theirs together: a
    large total in shares of at least SPLIT_FROM / 2 bytes, whatever the parts' own sizes (a cached
    payload's are its 1 MiB chunks), the calling thread copying the first share while helper threads
    copy the rest."""
    total = sum(len(part) for part in parts)
    if len(dst) != total:
        raise ValueError(f"copy of {total} bytes into {len(dst)}")
    shares = max(1, min(MAX_THREADS, total // (SPLIT_FROM // 2)))
    bounds = [total * i // shares for i in range(shares + 1)]
    jobs = [_pieces(dst, parts, a, b) for a, b in itertools.pairwise(bounds)]
    helped = [_pool().submit(_copy_pieces, job) for job in jobs[1:]]
    _copy_pieces(jobs[0])
    for future in helped:
        future.result()


def _pieces(
    dst: np.ndarray, parts: Sequence[np.ndarray], start: int, end: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (destination, source) slices that cover bytes [start, end) of the parts laid back to back."""
    pieces, offset = [], 0
    for part in parts:
        a, b = max(start, offset), min(end, offset + len(part))
        if a < b:
            pieces.append((dst[a:b], part[a - offset : b - offset]))
        offset += len(part)
    return pieces


def _copy_pieces(pieces: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pieces:
        np.copyto(dst, src)


def _pool() -> ThreadPoolExecutor:
    global _helpers
    with _helpers_lock:
        if _helpers is None:
            _helpers = ThreadPoolExecutor(MAX_THREADS - 1, thread_name_prefix="copy")
        return _helpers


def _forget_pool_in_child() -> None:
    """A forked child has none of its parent's threads: it makes a pool of its own when it copies."""
    global _helpers, _helpers_lock
    _helpers, _helpers_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)
