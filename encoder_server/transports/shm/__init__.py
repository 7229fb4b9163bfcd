"""Shared memory, the same-host transport (`--shm-transfer`), server side: each payload is written once into
a warm segment of a bounded pool and announced under a fresh name; the receiver's tensor is a view of it.
`pool.py` holds the pool, `call.py` a call's use of it, `segment.py` one segment, `metrics.py` its counts."""

from .pool import ShmConfig, ShmSegments

__all__ = ["ShmConfig", "ShmSegments"]
