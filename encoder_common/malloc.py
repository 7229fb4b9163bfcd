"""glibc malloc settings for processes that move large payloads: the encoder server, and any process that
runs `EncoderReceiver` (a prefill engine, the gateway, encoder-client)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# With glibc's defaults every buffer of a megabyte or more (each 1 MiB message gRPC hands to Python, each
# payload framed or received) is mmapped fresh and page-faulted on its first write, and freed memory is
# trimmed away to be faulted in again by the next call: a receiving process keeps it all in its heap.
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = 2 << 30
# The server keeps buffers under 32 MiB (gRPC's messages, chunks, embeddings of a few thousand tokens) in
# its heap, while larger ones (a large image's pixel values, a forward's activations) are mapped and
# unmapped: what a forward or a refused call frees leaves the process, instead of staying in a thread's
# arena (docs/reliability-security.md has the stalled-clients run that measured both).
SERVER_MMAP_THRESHOLD = 32 << 20
SERVER_TRIM_THRESHOLD = 64 << 20


def tune_server_malloc() -> None:
    """The encoder server's settings: the heap for buffers under 32 MiB, larger ones mapped and unmapped."""
    tune_malloc(SERVER_MMAP_THRESHOLD, SERVER_TRIM_THRESHOLD)


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> None:
    """Sets glibc's mmap and trim thresholds for this process (by default raised far above any payload),
    unless the environment already sets them (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, which do
    the same from the start).

    mallopt applies in-process, so no environment variable has to be set before the interpreter
    starts; a no-op on other C libraries.
    """
    libc_name = ctypes.util.find_library("c")
    if not libc_name or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL(libc_name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, mmap_threshold)
        libc.mallopt(m_trim_threshold, trim_threshold)
    except (OSError, AttributeError):  # not glibc
        pass
