"""The server's bound on payload bytes held for Encode streams in progress, and the watchdog that
cancels a stream whose receiver stopped reading.

A call holds an item's payload (its tensors, or its framed chunks) from the moment the item is ready
until its last byte is handed to gRPC or to a shared-memory segment. Without a bound, callers that
open streams and never read them pin that memory for as long as they like. Each call charges its
items here (a computed one once preprocessing knows its size, before the forward makes it); a call that would take the total past the budget is refused with
RESOURCE_EXHAUSTED (the receiver takes that as "busy" and goes elsewhere or backs off), so the bytes
held never pass `max_bytes` (or one item's size, for an item larger than the whole budget). The
embedding cache's own budget is separate: a cached payload is charged again only while streamed.

Streams whose receiver stops reading are cut two ways: any stream after `stall_timeout_s`, and,
when a call needs room, every stream whose receiver has not taken a message for `EVICT_AFTER_S`,
so that callers who read keep being served while those who do not hold the budget. gRPC Python
cannot reset a stream from the server: a cut stream's handler stops and gives its bytes back, but
gRPC keeps the messages it had accepted for it until the client goes (cancels, reaches its deadline,
disconnects): at most `RESIDUE_BYTES` per cut stream (~1.2 MB measured with 1 MiB chunks), outside
the budget, since the server is never told when that client goes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from encoder_common.env_flags import flag
from encoder_common.errors import OverloadedError
from protos import wire

log = logging.getLogger(__name__)

# A stream whose current message has waited this long is not being read: gRPC clients take messages
# into their own buffers as fast as they arrive, so a reading receiver never makes the server wait
# anywhere near this. Such streams give way when a new call needs their room.
EVICT_AFTER_S = 1.0
# What gRPC may still hold for a cut stream: the chunk message it accepted and the one waiting.
RESIDUE_BYTES = 2 * wire.CHUNK_BYTES


@dataclass(frozen=True, kw_only=True)
class StreamLimits:
    max_bytes: int = field(
        default=1 << 30,
        metadata=flag(
            "payload bytes held for streams in progress at most; beyond, calls get RESOURCE_EXHAUSTED",
            name="--stream-buffer-bytes",
        ),
    )
    stall_timeout_s: float = field(
        default=30.0, metadata=flag("cancel a stream whose receiver has not taken its next message for this long")
    )

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"the stream buffer budget must be positive, got {self.max_bytes} bytes")
        if self.stall_timeout_s <= 0:
            raise ValueError(f"the stream stall timeout must be positive, got {self.stall_timeout_s} s")


class StreamBudget:
    """Bytes held for streams in progress, and the calls waiting on their receivers. Event loop only."""

    def __init__(self, limits: StreamLimits):
        self.limits = limits
        self.held = 0
        self.peak = 0
        self.refused = 0  # calls refused for want of room
        self.stalled = 0  # streams cancelled by the watchdog
        self._calls: set[StreamCharge] = set()
        self._watchdog: asyncio.Task | None = None

    async def admit(self) -> None:
        """Refuses a new call when the budget is spent even after cutting streams nobody reads."""
        if self.held >= self.limits.max_bytes and not await self._evict_unread():
            self._refuse(0)

    def call(self) -> StreamCharge:
        """The current Encode call's charge; the caller must `close()` it when the call ends."""
        charge = StreamCharge(self, asyncio.current_task())
        self._calls.add(charge)
        return charge

    def start(self) -> None:
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()

    def _fits(self, nbytes: int) -> bool:
        # An item larger than the whole budget still passes when nothing else is held.
        return not self.held or self.held + nbytes <= self.limits.max_bytes

    async def _reserve(self, nbytes: int) -> None:
        if not self._fits(nbytes) and not (await self._evict_unread() and self._fits(nbytes)):
            self._refuse(nbytes)
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    async def _evict_unread(self) -> bool:
        """Cancels the streams not being read; True once their bytes are given back."""
        now = time.monotonic()
        unread = [c for c in self._calls if c.sending_since is not None and now - c.sending_since > EVICT_AFTER_S]
        for charge in unread:
            self._cut(charge, f"a new call needed room and its receiver read nothing for {EVICT_AFTER_S:g} s")
        for _ in range(3):  # each cancelled handler unwinds (and gives its bytes back) on the next turns
            if not any(c in self._calls for c in unread):
                break
            await asyncio.sleep(0)
        return bool(unread)

    def _cut(self, charge: StreamCharge, why: str) -> None:
        self.stalled += 1
        log.warning("Encode stream cancelled, %d bytes held: %s", charge.held, why)
        charge.cancel()

    def _refuse(self, nbytes: int) -> None:
        self.refused += 1
        need = f" (this item needs {nbytes} more)" if nbytes else ""
        raise OverloadedError(
            f"the server holds {self.held} bytes for streams in progress{need}, "
            f"its limit is {self.limits.max_bytes} (--stream-buffer-bytes): try another encoder or later"
        )

    async def _watch(self) -> None:
        stall = self.limits.stall_timeout_s
        while True:
            await asyncio.sleep(min(1.0, stall / 4))
            now = time.monotonic()
            for charge in list(self._calls):
                if charge.sending_since is not None and now - charge.sending_since > stall:
                    self._cut(charge, f"its receiver read nothing for {stall:g} s")


class StreamCharge:
    """One call's share of the budget, and when it began waiting for its receiver to take a message."""

    __slots__ = ("budget", "task", "held", "sending_since", "_items")

    def __init__(self, budget: StreamBudget, task: asyncio.Task | None):
        self.budget = budget
        self.task = task
        self.held = 0
        self.sending_since: float | None = None
        self._items: dict[int, int] = {}  # item index -> bytes charged for it

    async def reserve(self, index: int, nbytes: int) -> None:
        """Charges item `index`'s payload; raises OverloadedError when it does not fit."""
        await self.budget._reserve(nbytes)
        self._items[index] = self._items.get(index, 0) + nbytes
        self.held += nbytes

    def release(self, index: int) -> None:
        """Item `index` is sent (handed to gRPC or placed in shared memory)."""
        nbytes = self._items.pop(index, 0)
        self.held -= nbytes
        self.budget.held -= nbytes

    def cancel(self) -> None:
        """Stops the call's handler; its `finally` blocks give everything back."""
        self.sending_since = None
        if self.task is not None:
            self.task.cancel()

    def close(self) -> None:
        self.budget.held -= self.held
        self.held = 0
        self._items.clear()
        self.budget._calls.discard(self)
