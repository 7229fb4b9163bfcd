"""The server's pool of shared-memory segments: its budget and settings, the placing of a payload in
a segment of the receiver's user, the taking back of what a call left or a receiver never released,
and the reaper that gives idle segments back to the OS."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from encoder_common.env_flags import flag
from encoder_common.shm_files import create_locked, shm_dir, sweep_stale
from encoder_common.warn_once import WarnOnce
from protos import encoder_pb2 as pb
from protos.shm import (
    HEADER_BYTES,
    SERVER_KIND,
    TOKEN_BYTES,
    is_probe_name,
    item_proof,
    new_instance,
    random_name,
    segment_header,
)

from .call import ShmCall
from .metrics import ShmCollector
from .segment import Segment

log = logging.getLogger(__name__)

# Segment sizes are rounded up to this, so that items of similar size reuse each other's segments.
_GRANULE = 2 << 20


@dataclass(frozen=True, kw_only=True)
class ShmConfig:
    # Bytes of segments held at most, announced or kept warm for reuse.
    max_bytes: int = field(
        default=512 << 20, metadata=flag("shared-memory segments held at most; beyond, items go as chunks")
    )
    # Smaller payloads go as chunks: a segment's syscalls on both sides cost more than one message.
    min_bytes: int = 64 << 10
    # An announced segment its receiver has not released by then leaves the pool (the receiver died,
    # or keeps the item's tensor that long: its memory stays with the receiver's tensor then).
    release_timeout_s: float = field(
        default=30.0, metadata=flag("take back a segment its receiver has not released by then")
    )
    # A warm segment unused this long is given back to the OS.
    keep_free_s: float = 60.0
    # Where segments live; receivers must see the same directory (default: $ENCODER_SHM_DIR or /dev/shm).
    directory: Path | None = None


@dataclass
class ShmStats:
    """What the fast path did since the server started."""

    items: int = 0  # payloads placed in segments
    bytes: int = 0
    released: int = 0  # segments the receiver unlinked
    reclaimed_timeout: int = 0  # taken back after release_timeout_s
    reclaimed_cancel: int = 0  # taken back when the call was cancelled, failed or ran out of time
    peak_bytes: int = 0  # most bytes of segments held at once
    fallbacks: Counter[str] = field(default_factory=Counter)  # reason -> items sent as chunks instead


@dataclass(frozen=True)
class PoolSize:
    segments: int  # held: announced or kept warm
    bytes: int


class ShmSegments:
    """The server's pool of segments, its budget, and the reaper: shared memory's entry in the transport
    registry (encoder_server/transports). Used from the event loop only, but for `pool()`."""

    def __init__(self, config: ShmConfig):
        self.config = config
        self.directory = config.directory or shm_dir()
        self.instance = new_instance(SERVER_KIND)
        self.stats = ShmStats()
        self._segments: list[Segment] = []
        self._lock_fd: int | None = None
        self._reaper: asyncio.Task | None = None
        self._warn_once = WarnOnce(log)

    @staticmethod
    def open_call(
        segments: ShmSegments | None, request: pb.EncodeRequest | pb.FetchRequest, peer: str
    ) -> ShmCall | None:
        """The call's use of shared memory when its receiver offered it (`segments` None: this server
        runs without --shm-transfer, which the item headers then say); None when it did not."""
        return ShmCall(segments, request) if request.HasField("shm") else None

    def collector(self) -> ShmCollector:
        return ShmCollector(self)

    @property
    def pool_bytes(self) -> int:
        return sum(s.capacity for s in self._segments)

    def pool(self) -> PoolSize:
        """The segments held and their bytes; a plain read, so the metrics thread may call it."""
        segments = list(self._segments)
        return PoolSize(segments=len(segments), bytes=sum(s.capacity for s in segments))

    def outstanding(self) -> list[str]:
        """Names of the segments announced and not yet released or taken back."""
        self._collect(time.monotonic())
        return [s.public.name for s in self._segments if s.public is not None]

    async def start(self) -> None:
        """Removes what dead encoder processes left, takes this instance's lock, starts the reaper."""
        sweep_stale(self.directory)
        self._lock_fd = create_locked(self.directory / f"{self.instance}.lock")
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())
        log.info(
            "shared-memory transfer on: %s/%s.*, at most %d bytes, release timeout %.1f s",
            self.directory,
            self.instance,
            self.config.max_bytes,
            self.config.release_timeout_s,
        )

    async def stop(self, wait_s: float = 2.0) -> None:
        """Gives receivers of the last calls a moment to release, then removes every file."""
        if self._reaper is not None:
            self._reaper.cancel()
        deadline = time.monotonic() + min(wait_s, self.config.release_timeout_s)
        while self._collect(time.monotonic()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for segment in self._segments:
            segment.close()
        self._segments.clear()
        if self._lock_fd is not None:
            (self.directory / f"{self.instance}.lock").unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None

    def read_probe(self, name: str) -> tuple[bytes, int] | None:
        """The token and owner of a receiver's probe, or None when this server cannot read it."""
        if not is_probe_name(name):
            return None
        try:
            fd = os.open(self.directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != TOKEN_BYTES or st.st_mode & 0o077:
                return None
            token = os.pread(fd, TOKEN_BYTES, 0)
            return (token, st.st_uid) if len(token) == TOKEN_BYTES else None
        except OSError:
            return None
        finally:
            os.close(fd)

    def place(
        self, header: pb.ItemHeader, parts: Sequence[memoryview], token: bytes, owner: int, request_id: str
    ) -> Segment | None:
        """Writes the payload into a segment of `owner`'s and fills `header.shm`; None: it goes as chunks."""
        if header.payload_bytes < self.config.min_bytes:
            return self._as_chunks(header, pb.SHM_SMALL_ITEM, token, request_id)
        try:
            segment = self._acquire(HEADER_BYTES + header.payload_bytes, owner)
            if segment is None:
                return self._as_chunks(header, pb.SHM_BUDGET_FULL, token, request_id)
            public = self.directory / random_name(self.instance, "seg")
            proof = item_proof(token, request_id, header.index, public.name, header.payload_bytes)
            segment.write(segment_header(header, proof), parts)
            os.link(segment.path, public)
        except OSError as exc:
            self._warn_once(
                exc.strerror or str(exc), "shared-memory segment failed (%s); items go as chunks", exc
            )
            return self._as_chunks(header, pb.SHM_WRITE_FAILED, token, request_id)
        segment.public, segment.placed_at = public, time.monotonic()
        header.shm.segment, header.shm.proof = public.name, proof
        self.stats.items += 1
        self.stats.bytes += header.payload_bytes
        return segment

    def _as_chunks(
        self, header: pb.ItemHeader, reason: pb.ShmFallback, token: bytes, request_id: str
    ) -> None:
        """The item follows as chunks; the proof still shows the receiver this server read its probe."""
        self.fallback(header, reason)
        header.shm.proof = item_proof(token, request_id, header.index, "", header.payload_bytes)

    def fallback(self, header: pb.ItemHeader, reason: pb.ShmFallback) -> None:
        header.shm.fallback = reason
        self.stats.fallbacks[pb.ShmFallback.Name(reason).removeprefix("SHM_").lower()] += 1

    def take_back(self, segment: Segment, public: Path) -> None:
        """Unlinks an announced name of a call that ended early (cancel, deadline, error)."""
        if segment.public != public:
            return  # released (or taken back) already, maybe reused since
        if self._unannounce(segment):
            self.stats.reclaimed_cancel += 1
        else:
            self.stats.released += 1
        self._drop_taken_back()

    def _acquire(self, size: int, owner: int) -> Segment | None:
        free = self._free_fitting(size, owner)
        if not free:
            self._collect(time.monotonic())  # an fstat per announced segment: only when it may help
            free = self._free_fitting(size, owner)
        if free:
            return min(free, key=lambda s: s.capacity)
        free = [s for s in self._segments if s.public is None]
        capacity = -(-size // _GRANULE) * _GRANULE
        if capacity > self.config.max_bytes:
            return None
        free.sort(key=lambda s: s.last_used)
        while free and self.pool_bytes + capacity > self.config.max_bytes:
            self._drop(free.pop(0))
        if self.pool_bytes + capacity > self.config.max_bytes:
            return None
        while True:
            try:
                segment = Segment(self.directory, self.instance, capacity, owner)
                break
            except OSError as exc:
                # The filesystem is full (a small /dev/shm, other servers' pools, other tenants): this
                # pool's own free segments make room, oldest first. A receiver that still maps one
                # holds its pages until its next call, so the item may go as chunks this time.
                if exc.errno != errno.ENOSPC or not free:
                    raise
                self._drop(free.pop(0))
        self._segments.append(segment)
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.pool_bytes)
        return segment

    def _free_fitting(self, size: int, owner: int) -> list[Segment]:
        # Never across owners: a receiver keeps the segments it read mapped, so a segment handed to
        # another user would show that user's embeddings to the first.
        return [s for s in self._segments if s.public is None and s.capacity >= size and s.owner == owner]

    def _collect(self, now: float) -> int:
        """Frees segments their receiver released or that timed out; returns how many stay announced."""
        announced = 0
        for segment in self._segments:
            if segment.public is None:
                continue
            if segment.released():
                segment.public, segment.last_used = None, now
                self.stats.released += 1
            elif now - segment.placed_at > self.config.release_timeout_s:
                if self._unannounce(segment):
                    self.stats.reclaimed_timeout += 1
                else:
                    self.stats.released += 1
            else:
                announced += 1
        self._drop_taken_back()
        return announced

    def _unannounce(self, segment: Segment) -> bool:
        """Unlinks the segment's announced name; False when its receiver had unlinked it already.

        A segment whose name was still there may be under a receiver's tensor: it is marked to leave
        the pool, never to be written again.
        """
        assert segment.public is not None
        try:
            segment.public.unlink()
            taken = True
        except FileNotFoundError:
            taken = False
        segment.public, segment.last_used = None, time.monotonic()
        segment.taken_back = taken
        return taken

    def _drop_taken_back(self) -> None:
        for segment in [s for s in self._segments if s.taken_back]:
            self._drop(segment)

    def _drop(self, segment: Segment) -> None:
        self._segments.remove(segment)
        segment.close()

    def _reap(self) -> None:
        now = time.monotonic()
        self._collect(now)
        for segment in [
            s for s in self._segments if s.public is None and now - s.last_used > self.config.keep_free_s
        ]:
            self._drop(segment)

    async def _reap_forever(self) -> None:
        period = min(1.0, self.config.release_timeout_s / 4)
        next_sweep = time.monotonic() + self.config.release_timeout_s
        while True:
            await asyncio.sleep(period)
            try:
                self._reap()
                if time.monotonic() >= next_sweep:  # probes of receivers that died, files of dead servers
                    sweep_stale(self.directory)
                    next_sweep = time.monotonic() + self.config.release_timeout_s
            except OSError as exc:
                self._warn_once(str(exc), "shared-memory reaper: %s", exc)
