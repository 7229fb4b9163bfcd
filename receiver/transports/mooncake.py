"""The Mooncake transfer engine, the across-hosts transport, receiver side: receive slots registered with
this receiver's engine once, a grant of free slots and a fresh token in each call's offer, and each item's
tensor a view of the slot its encoder wrote, once the header's MAC checks out."""

from __future__ import annotations

import logging
import mmap
import secrets
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import torch

from encoder_common.errors import TransferEngineUnavailableError
from encoder_common.mooncake_engine import Engine, EngineError, address_towards
from protos import encoder_pb2 as pb
from protos.mooncake import TOKEN_BYTES, placement_mac

from ..buffers import huge_page_memory, huge_pages
from ..urls import grpc_target
from . import Placement, TransferStats

if TYPE_CHECKING:
    from ..config import ReceiverConfig

log = logging.getLogger(__name__)

# How long an encoder that declined the offer (no engine, another protocol) is not offered it again.
DECLINED_S = 60.0
# Why an encoder declined an offer, by the fallback its headers give (None: they have no placement).
_DECLINED = {
    None: "the server predates the transfer-engine path",
    pb.MOONCAKE_DISABLED: "the server runs without --mooncake-transfer",
    pb.MOONCAKE_OFFER_REFUSED: "the server refused the offer (another protocol, or an engine not on this caller's host)",
}


class SlotPool:
    """The registered receive memory, cut into equal slots; thread-safe (tensors are freed anywhere).

    A slot goes back to the pool when the tensor over it (and every view of it) is freed. A granted slot
    that no header named is free again when its call ended cleanly (the encoder writes a slot only before
    the header naming it). When a call ended any other way (cancelled, failed, cut by its deadline, its
    encoder dead) or a write into a slot failed, the encoder may still be writing: those slots stay out of
    use for `late_write_s` first. Closing the receiver stops its engine before the slots' memory can go.
    """

    def __init__(self, engine: Engine, slots: int, slot_bytes: int, late_write_s: float):
        self.engine = engine
        self.slot_bytes = huge_pages(slot_bytes)
        self.late_write_s = late_write_s
        self._arena = huge_page_memory(slots * self.slot_bytes)
        memory = np.frombuffer(self._arena, dtype=np.uint8)
        memory[:: mmap.PAGESIZE] = 0  # every page mapped now: a first write into fresh pages is slow
        self.address = memory.ctypes.data
        engine.register(self.address, len(memory))
        self._lock = threading.Lock()
        self._free = deque(range(slots))
        self._quarantined: deque[tuple[float, int]] = deque()  # (free again at, slot), oldest first
        self.quarantines = 0  # slots ever kept out of use after a call's end or a failed write
        self.closed = False

    def grant(self, wanted: int) -> list[int]:
        """Up to `wanted` free slots, now the caller's."""
        with self._lock:
            self._end_quarantines()
            return [self._free.popleft() for _ in range(min(wanted, len(self._free)))]

    def _end_quarantines(self) -> None:
        now = time.monotonic()
        while self._quarantined and self._quarantined[0][0] <= now:
            self._free.append(self._quarantined.popleft()[1])

    def release(self, slot: int) -> None:
        """No write can land in `slot` any more and nothing reads it: free."""
        with self._lock:
            self._free.append(slot)

    def quarantine(self, slot: int) -> None:
        """A write into `slot` may still land: free once `late_write_s` has passed."""
        with self._lock:
            self._quarantined.append((time.monotonic() + self.late_write_s, slot))
            self.quarantines += 1

    def counts(self) -> tuple[int, int]:
        """(free, quarantined) slots; the rest are granted or under a result's tensor."""
        with self._lock:
            self._end_quarantines()
            return len(self._free), len(self._quarantined)

    def slot_address(self, slot: int) -> int:
        return self.address + slot * self.slot_bytes

    def slot(self, slot: int) -> pb.MooncakeSlot:
        return pb.MooncakeSlot(address=self.slot_address(slot), capacity=self.slot_bytes)

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        """The slot's first `nbytes` as a flat uint8 tensor; the slot is free again once it is gone."""
        payload = np.frombuffer(self._arena, dtype=np.uint8, count=nbytes, offset=slot * self.slot_bytes)
        weakref.finalize(payload, self.release, slot)  # the tensor's storage holds `payload`
        return torch.from_numpy(payload)

    def close(self) -> None:
        """Stops the engine, then lets the memory go (tensors over slots keep theirs)."""
        if not self.closed:
            self.closed = True
            self.engine.close(self._arena)


class CallGrant:
    """One call's slots and token; reads that call's item headers (a PayloadReader)."""

    def __init__(
        self, receiver: MooncakeReceiver, pool: SlotPool, slots: list[int], request_id: str, url: str
    ):
        self.receiver = receiver
        self.pool = pool
        self.slots = slots
        self.request_id = request_id
        self.url = url
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._open = set(slots)  # granted, neither named by a header nor settled
        # A call dropped without end() (cancelled, its task gone) may still be written into.
        self._finalizer = weakref.finalize(self, _settle, pool, self._open, False)

    def offer(self, session: str, protocol: str) -> pb.MooncakeOffer:
        slots = [self.pool.slot(s) for s in self.slots]
        return pb.MooncakeOffer(session=session, protocol=protocol, slots=slots, token=self.token)

    def __call__(self, header: pb.ItemHeader) -> tuple[Placement, torch.Tensor | None]:
        """Where the item's payload is and, when the header names a slot and its MAC checks out, the
        payload itself: a flat uint8 tensor over the slot, payload_bytes long."""
        receiver = self.receiver
        if not self.slots:  # the pool had no free slot: nothing was offered
            receiver.stats.fallbacks["mooncake_pool_full"] += 1
            return Placement.CHUNKS, None
        if not header.HasField("mooncake"):
            return receiver.not_negotiated(self.url, "mooncake_unsupported", _DECLINED[None])
        placement = header.mooncake
        reason = pb.MooncakeFallback.Name(placement.fallback).lower()
        if placement.fallback in _DECLINED:
            return receiver.not_negotiated(self.url, reason, _DECLINED[placement.fallback])
        in_grant = placement.slot < len(self.slots) and self.slots[placement.slot] in self._open
        if placement.fallback == pb.MOONCAKE_WRITE_FAILED and in_grant:
            self._quarantine(placement.slot)  # part of the payload may still be on its way
        if placement.fallback != pb.MOONCAKE_FALLBACK_NONE:
            receiver.stats.fallbacks[reason] += 1
            return Placement.CHUNKS, None
        slot = self.slots[placement.slot] if in_grant else None
        address = self.pool.slot_address(slot) if slot is not None else 0
        mac = placement_mac(
            self.token, self.request_id, header.index, placement.slot, address, header.payload_bytes
        )
        checks = slot is not None and header.payload_bytes <= self.pool.slot_bytes
        if not (checks and secrets.compare_digest(mac, placement.mac)):
            if slot is not None:
                self._quarantine(placement.slot)  # whoever wrote it may write it again
            log.warning(
                "item %d of request %r: transfer-engine placement refused; fetching it over gRPC",
                header.index,
                self.request_id,
            )
            receiver.stats.fallbacks["mooncake_bad_placement"] += 1
            return Placement.REFETCH, None
        self._open.discard(slot)  # the tensor's now: freed with it
        receiver.stats.items_mooncake += 1
        receiver.stats.bytes_mooncake += header.payload_bytes
        return Placement.FILLED, self.pool.view(slot, header.payload_bytes)

    def _quarantine(self, index: int) -> None:
        """The slot at `index` of the grant may still be written into: out of use for a while."""
        slot = self.slots[index]
        self._open.discard(slot)
        self.pool.quarantine(slot)

    def end(self, complete: bool) -> None:
        """The call is over: its unnamed slots are free when it ended cleanly, else quarantined."""
        self._finalizer.detach()
        _settle(self.pool, self._open, complete)


def _settle(pool: SlotPool, open_slots: set[int], complete: bool) -> None:
    for slot in list(open_slots):
        (pool.release if complete else pool.quarantine)(slot)
    open_slots.clear()


class MooncakeReceiver:
    """This receiver's transfer engine, started on its first call, and the grants of its calls."""

    def __init__(self, strict: bool, config: ReceiverConfig):
        """Strict (transfer="mooncake"): the engine's module must import now, or
        TransferEngineUnavailableError. Otherwise nothing starts until a call offers it."""
        self.strict = strict
        self.config = config.mooncake
        self.stats = TransferStats()
        self.pool: SlotPool | None = None
        self._unusable: str | None = None
        self._declined: dict[str, float] = {}  # url -> when it may be offered again
        self._lock = threading.Lock()
        if strict:
            from encoder_common.mooncake_engine import unavailable

            reason = unavailable()
            if reason is not None:
                raise TransferEngineUnavailableError(
                    f"the Mooncake transfer engine does not import: {reason}"
                )

    def open_call(
        self, request: pb.EncodeRequest | pb.FetchRequest, url: str, items: int
    ) -> CallGrant | None:
        """Grants the call up to `items` slots and puts the offer in `request`; None when nothing is
        offered (no engine here, or the encoder at `url` declined it lately)."""
        if not self.strict and time.monotonic() < self._declined.get(url, 0.0):
            return None
        pool = self._pool(url)
        if pool is None:
            return None
        grant = CallGrant(self, pool, pool.grant(items), request.request_id, url)
        if grant.slots:
            request.mooncake.CopyFrom(grant.offer(pool.engine.session, self.config.protocol))
        return grant

    def end_call(self, reader: object, complete: bool) -> None:
        if isinstance(reader, CallGrant):
            reader.end(complete)

    def not_negotiated(self, url: str, reason: str, why: str) -> tuple[Placement, None]:
        if self.strict:
            raise TransferEngineUnavailableError(f"transfer-engine path unavailable: {why}")
        self._declined[url] = time.monotonic() + DECLINED_S
        self.stats.fallbacks[reason] += 1
        return Placement.CHUNKS, None

    def _pool(self, url: str) -> SlotPool | None:
        """The slot pool, its engine started on the first call (on the address `url` routes from)."""
        with self._lock:
            if self.pool is None and self._unusable is None:
                config, engine = self.config, None
                try:
                    host = config.host or address_towards(grpc_target(url).rpartition(":")[0].strip("[]"))
                    engine = Engine(config, host)
                    self.pool = SlotPool(engine, config.slots, config.slot_bytes, config.late_write_s)
                except (EngineError, OSError) as exc:
                    if engine is not None:
                        engine.close()
                    if self.strict:
                        raise TransferEngineUnavailableError(str(exc)) from None
                    log.info("no transfer-engine path (%s): payloads come over the gRPC stream", exc)
                    self._unusable = str(exc)
            return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
