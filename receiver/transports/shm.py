"""Shared memory, the same-host transport, receiver side: the probe that lets a server prove it shares
this host's memory, and turning an announced segment into the item's tensor without a copy: the tensor
is a view of the segment, and the segment goes back to the server (its name unlinked) when the tensor
is freed."""

from __future__ import annotations

import functools
import ipaddress
import logging
import mmap
import os
import secrets
import socket
import stat
import time
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from encoder_common.errors import SharedMemoryUnavailableError
from encoder_common.shm_files import create_locked, shm_dir, sweep_stale
from protos import encoder_pb2 as pb
from protos.shm import (
    HEADER_BYTES,
    RECEIVER_KIND,
    TOKEN_BYTES,
    is_segment_name,
    item_proof,
    new_instance,
    segment_header,
)

from ..urls import grpc_target
from . import PayloadReader, Placement, TransferStats

if TYPE_CHECKING:
    from ..config import ReceiverConfig

log = logging.getLogger(__name__)

# Server pool segments kept mapped; more than a server's pool ever holds at the default budget.
_MAX_MAPPINGS = 64
# How often a call lets go of mappings whose segment the server gave up: their memory is ours alone then,
# and it counts against the shared-memory filesystem until we unmap it.
_FORGET_DROPPED_S = 1.0


class _Refused(Exception):
    def __init__(self, reason: str, detail: str):
        self.reason = reason
        super().__init__(detail)


class _Mapping:
    """A server's pool segment, mapped once and reused for every item announced in it: mapping a
    segment costs about as much as copying it, and the server reuses its segments.

    Mapped shared and writable, so that the tensors over it are ordinary ones a caller may change in
    place: the server rewrites a segment only after every tensor over it is gone (its name unlinked).
    """

    def __init__(self, fd: int, size: int):
        self.size = size
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.fd = os.dup(fd)

    def dropped(self) -> bool:
        """The server gave the segment up: only this mapping keeps its memory."""
        return os.fstat(self.fd).st_nlink == 0

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:
            pass  # a view still uses it: the mapping goes with that view
        os.close(self.fd)


def _release(path: Path, fd: int, mappings: dict[tuple[int, int], _Mapping]) -> None:
    path.unlink(missing_ok=True)
    os.close(fd)
    for mapping in mappings.values():
        mapping.close()
    mappings.clear()


class ShmReceiver:
    """One receiver's probe (a 0600 segment holding a random token, locked while the receiver lives)
    and the reading of segments that servers announce for it."""

    def __init__(self, strict: bool, config: ReceiverConfig | None = None, directory: Path | None = None):
        """Strict (transfer="shm"): the probe is made now, or SharedMemoryUnavailableError. Otherwise
        nothing touches the directory until the first call to an encoder that could share this host.
        `config`: the receiver's settings, none of which are shared memory's."""
        self.strict = strict
        self.directory = directory or shm_dir()
        self.probe = f"{new_instance(RECEIVER_KIND)}.probe"
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._mappings: OrderedDict[tuple[int, int], _Mapping] = OrderedDict()  # by (st_dev, st_ino)
        self._dropped_checked = time.monotonic()
        self._finalizer: weakref.finalize | None = None
        self._unusable = False  # the probe could not be made: every call goes over gRPC
        self.stats = TransferStats()
        if strict:
            self._make_probe()

    def _make_probe(self) -> bool:
        """Sweeps what dead encoders and receivers left, then makes this receiver's probe; once."""
        if self._finalizer is not None or self._unusable:
            return not self._unusable
        sweep_stale(self.directory)
        try:
            fd = create_locked(self.directory / self.probe, self._token)
        except OSError as exc:
            if self.strict:
                raise SharedMemoryUnavailableError(
                    f"cannot create a shared-memory probe in {self.directory}: {exc}"
                ) from None
            log.info("no shared-memory transfer (%s): payloads come over the gRPC stream", exc)
            self._unusable = True
            return False
        self._finalizer = weakref.finalize(self, _release, self.directory / self.probe, fd, self._mappings)
        return True

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    def offer(self, url: str | None = None) -> pb.ShmOffer | None:
        """The offer to put in a call to the encoder at `url`; None when the call goes over gRPC alone.

        Outside strict mode no offer goes to an encoder whose address belongs to another machine.
        """
        if not self.strict and url is not None and not could_share_host(url):
            return None
        return pb.ShmOffer(probe=self.probe) if self._make_probe() else None

    def open_call(self, request: pb.EncodeRequest | pb.FetchRequest, url: str, items: int) -> PayloadReader | None:
        """`offer` put in `request`, and `take` for that call's headers (see receiver.transports)."""
        offer = self.offer(url)
        if offer is None:
            return None
        # Before the server places anything: a segment it gave up (reaped, or its server died) and that only
        # our cached mapping keeps would otherwise hold its memory until a segment came through again,
        # which a full filesystem (a small /dev/shm) stops from ever happening.
        self._forget_dropped()
        request.shm.CopyFrom(offer)
        return functools.partial(self.take, request.request_id)

    def end_call(self, reader: PayloadReader, complete: bool) -> None:
        """Nothing to do: a segment is the receiver's from its header on, whatever becomes of the call."""

    def take(self, request_id: str, header: pb.ItemHeader) -> tuple[Placement, torch.Tensor | None]:
        """Where the item's payload is and, when the header announces a segment and everything checks
        out, the payload itself: a flat uint8 tensor over the segment, payload_bytes long.

        The segment stays the caller's while that tensor (or any view of it) lives; it is released
        to the server when the last one is freed. Raises SharedMemoryUnavailableError in strict mode
        when the server did not prove it shares this host's memory.
        """
        placement = header.shm if header.HasField("shm") else None
        if placement is None:
            return self._not_negotiated(
                "unsupported", "the server predates the shared-memory path", Placement.CHUNKS
            )
        if placement.fallback in (pb.SHM_DISABLED, pb.SHM_PROBE_UNREADABLE):
            why = {
                pb.SHM_DISABLED: "the server runs without --shm-transfer",
                pb.SHM_PROBE_UNREADABLE: "the server cannot read this receiver's probe "
                "(another host, container or user)",
            }[placement.fallback]
            return self._not_negotiated(_reason(placement.fallback), why, Placement.CHUNKS)
        proof = item_proof(self._token, request_id, header.index, placement.segment, header.payload_bytes)
        if not secrets.compare_digest(proof, placement.proof):
            # No chunks follow a header that names a segment: such an item has to be fetched again.
            follows = Placement.REFETCH if placement.segment else Placement.CHUNKS
            return self._not_negotiated(
                "bad_proof", f"item {header.index}: the server's proof does not match", follows
            )
        if not placement.segment:
            self.stats.fallbacks[_reason(placement.fallback)] += 1
            return Placement.CHUNKS, None
        try:
            payload = self._view(placement.segment, segment_header(header, proof), header.payload_bytes)
        except _Refused as exc:
            log.warning(
                "item %d of request %r: shared-memory segment refused (%s); fetching it over gRPC",
                header.index,
                request_id,
                exc,
            )
            self.stats.fallbacks[exc.reason] += 1
            return Placement.REFETCH, None
        self.stats.items_shm += 1
        self.stats.bytes_shm += header.payload_bytes
        return Placement.FILLED, payload

    def _not_negotiated(self, reason: str, why: str, follows: Placement) -> tuple[Placement, None]:
        if self.strict:
            raise SharedMemoryUnavailableError(f"shared-memory transfer unavailable: {why}")
        self.stats.fallbacks[reason] += 1
        return follows, None

    def _view(self, name: str, expected_header: bytes, nbytes: int) -> torch.Tensor:
        """Checks the segment against what the stream announced and returns its payload as a tensor
        over the segment; a refused segment is unlinked (released) at once."""
        if not is_segment_name(name):
            raise _Refused("bad_name", f"{name!r} is not a segment name")
        path = self.directory / name
        try:
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                raise _Refused("missing", f"{name} does not exist") from None
            except PermissionError:
                raise _Refused("permission_denied", f"{name}: permission denied") from None
            except OSError as exc:
                raise _Refused("read_failed", f"{name}: {exc}") from None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                    raise _Refused(
                        "not_private", f"{name} is not a file of this user's, readable by it alone"
                    )
                if st.st_size < HEADER_BYTES + nbytes:
                    raise _Refused(
                        "size_mismatch", f"{name} holds {st.st_size} bytes, the stream announced {nbytes}"
                    )
                mapping = self._mapping(fd, st)
            except OSError as exc:
                raise _Refused("read_failed", f"{name}: {exc}") from None
            finally:
                os.close(fd)
            if mapping.map[:HEADER_BYTES] != expected_header:
                raise _Refused("header_mismatch", f"{name}'s header does not match the stream's")
        except _Refused:
            _unlink(path)  # releases the segment to the server
            raise
        payload = np.frombuffer(mapping.map, dtype=np.uint8, count=nbytes, offset=HEADER_BYTES)
        # The tensor's storage holds `payload`: once the tensor and every view of it are gone, the
        # name goes and the server may reuse the segment. Until then it never writes to it.
        weakref.finalize(payload, _unlink, path)
        return torch.from_numpy(payload)

    def _forget_dropped(self) -> None:
        """Unmaps the cached mappings of segments their server gave up; at most every _FORGET_DROPPED_S
        (an fstat per mapping). A mapping a result's tensor still uses goes with that tensor."""
        now = time.monotonic()
        if now - self._dropped_checked > _FORGET_DROPPED_S:
            self._dropped_checked = now
            for old in [k for k, m in self._mappings.items() if m.dropped()]:
                self._mappings.pop(old).close()

    def _mapping(self, fd: int, st: os.stat_result) -> _Mapping:
        key = (st.st_dev, st.st_ino)
        mapping = self._mappings.pop(key, None)
        if mapping is None or mapping.size != st.st_size:
            if mapping is not None:
                mapping.close()
            mapping = _Mapping(fd, st.st_size)
        self._mappings[key] = mapping  # most recently used last
        while len(self._mappings) > _MAX_MAPPINGS:
            self._mappings.popitem(last=False)[1].close()
        return mapping


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass  # the server took it back already (timeout, cancelled call, shutdown)


@functools.lru_cache(maxsize=1024)
def could_share_host(url: str) -> bool:
    """False only for an encoder URL whose host is an IP address of another machine (one no local
    socket can bind to); a name may well resolve to this host, so it could share it."""
    host = grpc_target(url).rsplit(":", 1)[0].strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return True
    if address.is_loopback:
        return True
    with socket.socket(socket.AF_INET6 if address.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((host, 0))
        except OSError:
            return False
    return True


def _reason(fallback: pb.ShmFallback) -> str:
    return pb.ShmFallback.Name(fallback).removeprefix("SHM_").lower()
