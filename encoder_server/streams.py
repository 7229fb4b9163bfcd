"""The stream budget: the bytes held for calls in progress (each call's share inside gRPC, its items'
payloads) within `--stream-buffer-bytes`, the shares that keep never-reading clients from locking others
out, and the watchdog that cuts a stream whose receiver stopped reading (docs/reliability-security.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field

from encoder_common.env_flags import flag
from encoder_common.errors import OverloadedError
from protos import wire

log = logging.getLogger(__name__)

# A stream whose current message has waited this long is not being read: gRPC clients take messages
# into their own buffers as fast as they arrive, so a reading receiver never makes the server wait
# anywhere near this. Such streams are cut when a new call needs their room (any stream is cut after
# `stall_timeout_s`), so that callers who read keep being served while those who do not hold the budget.
EVICT_AFTER_S = 1.0
# A live call's own state in gRPC and Python (about 48 KB measured per call with a thousand open).
CALL_STATE_BYTES = 64 << 10
# The most a live call keeps inside gRPC at once: its state and a copy of the largest message it sends
# (gRPC keeps its own copy of a message until the receiver's flow-control window takes it). Every call
# is charged this from admission until its RPC is really over.
CALL_BYTES = CALL_STATE_BYTES + wire.CHUNK_BYTES + 16
DEFAULT_STREAM_BUFFER_BYTES = 256 << 20
# The part of the budget only connections that read may use for calls in progress: 1 / READER_SHARE of it.
READER_SHARE = 4
# The most one connection that does not read may hold, cut streams included: 1 / CONNECTION_SHARE of it.
CONNECTION_SHARE = 2
# Connections remembered as reading (an LRU of gRPC peer strings, ~100 bytes each).
MAX_READERS = 4096
# How long a call or item of a connection that reads waits for room before the call is refused.
WAIT_FOR_ROOM_S = 10.0


@dataclass(frozen=True, kw_only=True)
class StreamLimits:
    max_bytes: int = field(
        default=DEFAULT_STREAM_BUFFER_BYTES,
        metadata=flag(
            "bytes held for calls in progress at most (payloads, and what each call leaves inside gRPC); "
            "beyond, calls get RESOURCE_EXHAUSTED",
            name="--stream-buffer-bytes",
        ),
    )
    stall_timeout_s: float = field(
        default=30.0, metadata=flag("cut a stream whose receiver has not taken its next message for this long")
    )

    def __post_init__(self) -> None:
        if self.max_bytes < CALL_BYTES:
            raise ValueError(f"the stream buffer budget must be at least {CALL_BYTES} bytes, got {self.max_bytes}")
        if self.stall_timeout_s <= 0:
            raise ValueError(f"the stream stall timeout must be positive, got {self.stall_timeout_s} s")


class StreamCut(Exception):
    """Raised inside a call whose stream the budget cut while `write` (a message of `nbytes`) was pending."""

    def __init__(self, write: asyncio.Future, nbytes: int, why: str):
        super().__init__(why)
        self.write = write
        self.nbytes = nbytes


class StreamBudget:
    """Bytes held for calls in progress, and the calls waiting on their receivers. Event loop only."""

    def __init__(self, limits: StreamLimits):
        self.limits = limits
        self.held = 0
        self.peak = 0
        self.leftover = 0  # held by cut calls for what they left inside gRPC (part of `held`)
        self._by_peer: dict[str, int] = {}  # bytes held per connection (peers holding nothing left out)
        self.refused = 0  # calls refused for want of room
        self.waited = 0  # calls and items of reading connections that waited for room
        self.waiting = 0  # ... waiting now
        # Set (and replaced by a fresh one) whenever bytes are given back: a waiter takes the current one
        # before it checks for room, so a release at any point after that check wakes it.
        self._room = asyncio.Event()
        self.stalled = 0  # streams cut by the watchdog or for a new call's room
        self._calls: set[StreamCharge] = set()
        self._readers: OrderedDict[str, None] = OrderedDict()  # peers whose last call was read to its end
        self._watchdog: asyncio.Task | None = None

    @property
    def open_calls(self) -> int:
        """Calls admitted and not yet over, cut ones included."""
        return len(self._calls)

    @property
    def cut_calls(self) -> int:
        """Calls cut and not yet over: each still holds what it left inside gRPC."""
        return sum(1 for charge in self._calls if charge.cut_why is not None)

    def call(self, peer: str) -> StreamCharge:
        """Admits the current call from `peer` (`context.peer()`: one gRPC connection): `async with
        budget.call(peer) as charge:` around all its work. Refuses it (OverloadedError) when its
        CALL_BYTES do not fit even after cutting streams nobody reads (and waiting, where it may)."""
        return StreamCharge(self, asyncio.current_task(), peer)

    def start(self) -> None:
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()

    def held_by(self, peer: str) -> int:
        """Bytes the calls of one connection hold, cut ones included."""
        return self._by_peer.get(peer, 0)

    def _fits(self, nbytes: int, peer: str) -> bool:
        """Whether `nbytes` more for a call of `peer` stay within the budget and its shares: a connection
        that reads (its last finished call sent everything, and none of its streams was cut since) holds
        three quarters at most; one that does not, half at most, cut streams included, and the calls in
        progress of all such connections share three quarters (a cut stream's leftover inside gRPC counts
        only against the whole). So a fresh connection that reads is refused only while live calls of
        never-readers fill three quarters (until they go unread for EVICT_AFTER_S), or while cut streams'
        leftovers fill the whole budget (about two thousand never-reading connections)."""
        if not self.held:
            return True  # an item larger than the whole budget still passes when nothing else is held
        full = self.limits.max_bytes
        if self.held + nbytes > full:
            return False
        open_to_all = full - full // READER_SHARE
        if peer in self._readers:
            return self.held_by(peer) + nbytes <= open_to_all
        live = self.held - self.leftover
        return live + nbytes <= open_to_all and self.held_by(peer) + nbytes <= full // CONNECTION_SHARE

    def _add(self, peer: str, nbytes: int) -> None:
        """Counts `nbytes` more (or fewer, when negative) held by a call of `peer`."""
        self.held += nbytes
        if nbytes < 0:
            self._room.set()
            self._room = asyncio.Event()
        held = self._by_peer.get(peer, 0) + nbytes
        if held:
            self._by_peer[peer] = held
        else:
            self._by_peer.pop(peer, None)

    async def _reserve(self, nbytes: int, peer: str) -> None:
        """Charges `nbytes` to `peer`, cutting streams nobody reads for room, or refuses them
        (OverloadedError: the receiver goes elsewhere or backs off), so the bytes held never pass the
        budget (or one item's size, for an item larger than the whole). A connection that reads waits
        for room instead, as the calls in progress give their payloads back, so that a prefill node with
        more in flight than the budget gets backpressure: up to WAIT_FOR_ROOM_S, and only while fewer
        wait than the budget holds calls (what waits is outside it: a call's state in gRPC, and at most
        `preprocess_workers` prepared items)."""
        give_up = time.monotonic() + WAIT_FOR_ROOM_S
        waiting = False
        try:
            while True:
                room = self._room
                if self._fits(nbytes, peer) or (await self._evict_unread() and self._fits(nbytes, peer)):
                    break
                left = give_up - time.monotonic()
                if not waiting:
                    if peer not in self._readers or self.waiting >= self.limits.max_bytes // CALL_BYTES:
                        self._refuse(nbytes, peer)
                    waiting = True
                    self.waiting += 1
                    self.waited += 1
                elif left <= 0 or peer not in self._readers:
                    self._refuse(nbytes, peer)
                # Woken by any bytes given back, and at least every EVICT_AFTER_S to cut streams gone unread.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(room.wait(), min(left, EVICT_AFTER_S))
        finally:
            if waiting:
                self.waiting -= 1
        self._add(peer, nbytes)
        self.peak = max(self.peak, self.held)

    async def _evict_unread(self) -> bool:
        """Cuts the streams not being read; True once they have given back their payloads."""
        now = time.monotonic()
        unread = [
            c
            for c in self._calls
            if c.cut_why is None and c.sending_since is not None and now - c.sending_since > EVICT_AFTER_S
        ]
        for charge in unread:
            self._cut(charge, f"a new call needed room and its receiver read nothing for {EVICT_AFTER_S:g} s")
        for _ in range(8):  # each cut handler unwinds (and gives its payloads back) over the next turns
            if all(c.settled or c not in self._calls for c in unread):
                break
            await asyncio.sleep(0)
        return bool(unread)

    def _read_to_the_end(self, peer: str) -> None:
        self._readers[peer] = None
        self._readers.move_to_end(peer)
        if len(self._readers) > MAX_READERS:
            self._readers.popitem(last=False)

    def _cut(self, charge: StreamCharge, why: str) -> None:
        self._readers.pop(charge.peer, None)
        self.stalled += 1
        log.warning("Encode stream cut, %d bytes held: %s", charge.held, why)
        charge.cut(why)

    def _refuse(self, nbytes: int, peer: str) -> None:
        self.refused += 1
        need = f" (this call needs {nbytes} more)" if nbytes else ""
        full = self.limits.max_bytes
        limit = f"its limit is {full} (--stream-buffer-bytes)"
        if peer not in self._readers:
            limit += (
                f"; a connection that has not read a call to its end may hold {full // CONNECTION_SHARE} "
                f"(this one holds {self.held_by(peer)}), and its calls share {full - full // READER_SHARE} "
                f"with all such calls in progress ({self.held - self.leftover} held)"
            )
        raise OverloadedError(
            f"the server holds {self.held} bytes for calls{need}, {limit}: try another encoder or later"
        )

    async def _watch(self) -> None:
        stall = self.limits.stall_timeout_s
        while True:
            await asyncio.sleep(min(1.0, stall / 4))
            now = time.monotonic()
            for charge in list(self._calls):
                waiting_since = charge.sending_since
                if charge.cut_why is None and waiting_since is not None and now - waiting_since > stall:
                    self._cut(charge, f"its receiver read nothing for {stall:g} s")


class StreamCharge:
    """One call's share of the budget (its CALL_BYTES and its items' payloads), and when it began waiting
    for its receiver to take a message. An async context manager: entering admits the call, leaving
    gives everything back once the call is really over."""

    __slots__ = ("budget", "task", "peer", "reads", "held", "sending_since", "cut_why", "settled", "_items")

    def __init__(self, budget: StreamBudget, task: asyncio.Task | None, peer: str):
        self.budget = budget
        self.task = task
        self.peer = peer  # its gRPC connection: whether that one reads decides how much of the budget is open
        self.reads = False  # whether that connection read its last call to the end, when this one was admitted
        self.held = 0
        self.sending_since: float | None = None
        self.cut_why: str | None = None  # why the budget cut this call's stream, once it did
        self.settled = False  # cut, and holding only what it left inside gRPC
        self._items: dict[int, int] = {}  # item index -> bytes charged for it

    async def __aenter__(self) -> StreamCharge:
        await self.budget._reserve(CALL_BYTES, self.peer)
        self.reads = self.peer in self.budget._readers
        self.held = CALL_BYTES
        self.budget._calls.add(self)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            if isinstance(exc, StreamCut):
                await self._settle(exc, tb)
        finally:
            if self.settled:
                self.budget.leftover -= self.held
            self.budget._add(self.peer, -self.held)
            self.held = 0
            self._items.clear()
            self.budget._calls.discard(self)
        if exc is None and self.cut_why is None:
            self.budget._read_to_the_end(self.peer)
        if isinstance(exc, StreamCut):
            raise OverloadedError(f"the stream was cut: {exc}") from None

    async def reserve(self, index: int, nbytes: int) -> None:
        """Charges item `index`'s payload; raises OverloadedError when it does not fit."""
        await self.budget._reserve(nbytes, self.peer)
        self._items[index] = self._items.get(index, 0) + nbytes
        self.held += nbytes

    def release(self, index: int, nbytes: int | None = None) -> None:
        """Gives back `nbytes` of item `index`'s charge, or all of it once the item is sent (handed to gRPC
        or placed in shared memory)."""
        charged = self._items.pop(index, 0)
        if nbytes is not None and nbytes < charged:
            self._items[index] = charged - nbytes
        else:
            nbytes = charged
        self.held -= nbytes
        self.budget._add(self.peer, -nbytes)

    def cut(self, why: str) -> None:
        """Stops the call's handler: its payloads are given back, what it left inside gRPC stays charged.
        gRPC Python cannot reset a stream from the server: the message a cut stream was sending stays
        inside gRPC until its receiver reads it or goes (cancels, reaches its deadline, disconnects)."""
        self.cut_why = why
        self.sending_since = None
        if self.task is not None:
            self.task.cancel()

    async def _settle(self, cut: StreamCut, tb) -> None:
        """Holds only the cut call's state and pending message until that message is taken or the call
        is over (its receiver cancels, reaches its deadline or disconnects)."""
        traceback.clear_frames(tb)  # the frames that sent the payloads: they must not keep them alive
        remaining = CALL_STATE_BYTES + cut.nbytes
        self.budget._add(self.peer, remaining - self.held)
        self.budget.leftover += remaining
        self.held = remaining
        self._items.clear()
        self.settled = True
        await asyncio.wait([cut.write])
