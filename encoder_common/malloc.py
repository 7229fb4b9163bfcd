"""glibc malloc settings for processes that move large payloads: the encoder server, and any process
that runs `EncoderReceiver` (a prefill engine, the gateway, encoder-client).

With glibc's defaults, every buffer of a megabyte or more (each 1 MiB message gRPC hands to Python,
each payload framed or received) is mmapped fresh and page-faulted on its first write, and freed
memory is trimmed away to be faulted in again by the next call. Raising both thresholds keeps that
memory in the heap for reuse. Measured on a 2-core x86-64 VM (`scripts/profile_dataplane.py
--in-flight 4`, 7 MiB items): the same bare grpcio client took 5.4 ms per call with them and
7.6 ms without.

The encoder server raises them less: its heap keeps buffers under 32 MiB (gRPC's messages, chunks,
whole embeddings of a few thousand tokens) and gives back free memory past 64 MiB at its top, while
anything larger (a large image's pixel values, a forward's activations) is mapped and unmapped, so
that what a forward or a refused call frees leaves the process instead of staying in a thread's arena
under a 2 GiB trim threshold. Measured on the same VM on 2026-12-02 (`scripts/stalled_clients.py
--clients 1000`, the built-in model's tower, 512 MiB stream budget): RSS grew 2,599 MiB with the
receivers' thresholds and 1,929 MiB with the server's; encoding a 1568x896 image took the same time
with both (paired median ratio 1.00; 0.98 for 448x448), where 4 MiB / 8 MiB cost 12% (7%).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = 2 << 30
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
