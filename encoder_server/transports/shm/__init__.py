"""Shared memory, the same-host transport (`--shm-transfer`), server side: each item's payload is
written once into a warm segment of a bounded pool and announced under a fresh name; the receiver's
tensor is a view of that segment, and its name is unlinked when the tensor is freed. A reaper takes
back what receivers never release.

A pool segment is a file `<instance>.pool.<random>` under /dev/shm, allocated once (fallocate, so a
full volume shows up as ENOSPC here and never as SIGBUS later) and kept mapped (`segment.py`). To
announce an item, the server hard-links it as `<instance>.seg.<random>`: a name used once. The
receiver's unlink drops the link count back to 1, which the server sees with an fstat and reuses the
segment. Reusing warm pages matters: filling fresh tmpfs pages costs several times a copy into warm
ones. A segment taken back while its name was still there (a receiver past the release timeout, a
call cancelled) may still be under a receiver's tensor, so it leaves the pool instead: it is never
written again, and its memory goes when the last mapping of it does.

`pool.py` holds the pool (the registry's entry), `call.py` one call's use of it, `metrics.py` its
Prometheus counts. The segment header and the proof both sides compute are in `protos/shm.py`.
"""

from .pool import ShmConfig, ShmSegments

__all__ = ["ShmConfig", "ShmSegments"]
