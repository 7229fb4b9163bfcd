"""Receiver side of the same-host fast path: the probe that lets a server prove it shares this host's
memory, and reading an announced segment into an item's tensor (checked, then unlinked)."""

from __future__ import annotations

import enum
import functools
import logging
import os
import secrets
import stat
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from protos import encoder_pb2 as pb
from protos.errors import SharedMemoryUnavailableError
from protos.shm import (
    HEADER_BYTES,
    RECEIVER_KIND,
    SHM_DIR,
    TOKEN_BYTES,
    create_locked,
    is_segment_name,
    item_proof,
    new_instance,
    segment_header,
    sweep_stale,
)

log = logging.getLogger(__name__)

TRANSFERS = ("auto", "grpc", "shm")


class Placement(enum.Enum):
    """Where an item's payload is, once its header has been read."""

    FILLED = "filled"  # read from shared memory into the item's tensor
    CHUNKS = "chunks"  # follows on the stream as chunks
    REFETCH = "refetch"  # announced in a segment that could not be used: fetch the item again


@dataclass
class TransferStats:
    """Items of a receiver's calls that offered shared memory: how many took it, and why others did not."""

    items_shm: int = 0
    bytes_shm: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)  # reason -> items that came over gRPC

    @property
    def items_grpc(self) -> int:
        return sum(self.fallbacks.values())


class _Refused(Exception):
    def __init__(self, reason: str, detail: str):
        self.reason = reason
        super().__init__(detail)


def _remove_probe(path: Path, fd: int) -> None:
    path.unlink(missing_ok=True)
    os.close(fd)


class ShmReceiver:
    """One receiver's probe (a 0600 segment holding a random token, locked while the receiver lives)
    and the reading of segments that servers announce for it."""

    def __init__(self, strict: bool, directory: Path | None = None):
        self.strict = strict
        self.directory = directory or SHM_DIR
        sweep_stale(self.directory)  # what dead encoders and receivers left on this host
        self.probe = f"{new_instance(RECEIVER_KIND)}.probe"
        self._token = secrets.token_bytes(TOKEN_BYTES)
        if not hasattr(os, "O_TMPFILE"):
            raise OSError(f"no O_TMPFILE on {os.uname().sysname}")
        fd = create_locked(self.directory / self.probe, self._token)
        self._finalizer = weakref.finalize(self, _remove_probe, self.directory / self.probe, fd)
        self.stats = TransferStats()

    @classmethod
    def for_transfer(cls, transfer: str) -> ShmReceiver | None:
        """The fast path for `transfer`: None for "grpc", or for "auto" where this host has no usable /dev/shm."""
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer must be one of {TRANSFERS}, got {transfer!r}")
        if transfer == "grpc":
            return None
        try:
            return cls(strict=transfer == "shm")
        except OSError as exc:
            if transfer == "shm":
                raise SharedMemoryUnavailableError(f"cannot create a shared-memory probe in {SHM_DIR}: {exc}") from None
            log.info("no shared-memory transfer (%s): payloads come over the gRPC stream", exc)
            return None

    def close(self) -> None:
        self._finalizer()

    def offer(self) -> pb.ShmOffer:
        return pb.ShmOffer(probe=self.probe)

    def reader(self, request_id: str) -> Callable[[pb.ItemHeader, np.ndarray], Placement]:
        """`take` for one call."""
        return functools.partial(self.take, request_id)

    def take(self, request_id: str, header: pb.ItemHeader, into: np.ndarray) -> Placement:
        """Reads the item's payload from its segment into `into` (uint8, payload_bytes long) when the
        header announces one and everything checks out; says where the payload is otherwise.

        Raises SharedMemoryUnavailableError in strict mode when the server did not prove it shares
        this host's memory.
        """
        placement = header.shm if header.HasField("shm") else None
        if placement is None:
            return self._not_negotiated("unsupported", "the server predates the shared-memory path", Placement.CHUNKS)
        if placement.fallback in (pb.SHM_DISABLED, pb.SHM_PROBE_UNREADABLE):
            why = {
                pb.SHM_DISABLED: "the server runs without --shm-transfer",
                pb.SHM_PROBE_UNREADABLE: "the server cannot read this receiver's probe: another host, container or user",
            }[placement.fallback]
            return self._not_negotiated(_reason(placement.fallback), why, Placement.CHUNKS)
        proof = item_proof(self._token, request_id, header.index, placement.segment, header.payload_bytes)
        if not secrets.compare_digest(proof, placement.proof):
            # No chunks follow a header that names a segment: such an item has to be fetched again.
            follows = Placement.REFETCH if placement.segment else Placement.CHUNKS
            return self._not_negotiated("bad_proof", f"item {header.index}: the server's proof does not match", follows)
        if not placement.segment:
            self.stats.fallbacks[_reason(placement.fallback)] += 1
            return Placement.CHUNKS
        try:
            self._read(placement.segment, segment_header(header, proof), into)
        except _Refused as exc:
            log.warning("item %d of request %r: shared-memory segment refused (%s); fetching it over gRPC", header.index, request_id, exc)
            self.stats.fallbacks[exc.reason] += 1
            return Placement.REFETCH
        self.stats.items_shm += 1
        self.stats.bytes_shm += header.payload_bytes
        return Placement.FILLED

    def _not_negotiated(self, reason: str, why: str, follows: Placement) -> Placement:
        if self.strict:
            raise SharedMemoryUnavailableError(f"shared-memory transfer unavailable: {why}")
        self.stats.fallbacks[reason] += 1
        return follows

    def _read(self, name: str, expected_header: bytes, into: np.ndarray) -> None:
        """Checks the segment against what the stream announced, copies its payload, unlinks it."""
        if not is_segment_name(name):
            raise _Refused("bad_name", f"{name!r} is not a segment name")
        path = self.directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise _Refused("missing", f"{name} does not exist") from None
        except PermissionError:
            raise _Refused("permission_denied", f"{name}: permission denied") from None
        except OSError as exc:
            raise _Refused("read_failed", f"{name}: {exc}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise _Refused("not_private", f"{name} is not a file of this user's, readable by it alone")
            if st.st_size < HEADER_BYTES + len(into):
                raise _Refused("size_mismatch", f"{name} holds {st.st_size} bytes, the stream announced {len(into)}")
            if os.pread(fd, HEADER_BYTES, 0) != expected_header:
                raise _Refused("header_mismatch", f"{name}'s header does not match the stream's")
            _read_exactly(fd, memoryview(into), HEADER_BYTES)
            # The server zeroes the header before reusing a segment: a reader it overtook sees that.
            if os.pread(fd, HEADER_BYTES, 0) != expected_header:
                raise _Refused("overwritten", f"{name} was taken back while being read")
        except OSError as exc:
            raise _Refused("read_failed", f"{name}: {exc}") from None
        finally:
            os.close(fd)
            try:
                path.unlink()  # releases the segment to the server, used or refused
            except OSError:
                pass



def _reason(fallback: pb.ShmFallback) -> str:
    return pb.ShmFallback.Name(fallback).removeprefix("SHM_").lower()


def _read_exactly(fd: int, into: memoryview, offset: int) -> None:
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:]], offset + done)
        if n == 0:
            raise _Refused("size_mismatch", "the segment ended early")
        done += n
