"""One call's items on their way to its receiver, for Encode, Fetch and SGLang's Encode: what the
stream budget is charged for each (ItemSender), each item's header (with its lease), its payload placed
by the call's transport (transports/) or else written as chunks (PendingWrite), and its metrics event."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import grpc

from encoder_common import tracing
from encoder_common.errors import OverloadedError
from protos import encoder_pb2 as pb

from .leases import LeaseStore
from .metrics import RequestRecord
from .payload import ItemOut
from .pipeline import ItemFlow
from .streams import StreamCharge, StreamCut
from .transports import CallTransport
from .transports.stream import STREAM


@dataclass(eq=False)
class ItemSender:
    """Runs one call's item flows (pipeline.py) and sends their items. `transport`: where the call's
    payloads are placed when not as chunks (gRPC streams only); `lease`: the Encode request's lease ask,
    granted per item from `leases`.

    What the stream budget (streams.py) is charged for an item, besides its call's own share: a payload
    computed for this call from before its forward, twice its size (the output tensors live until their
    last chunk is framed) and its pixel values until the forward is over, so that a call refused for want
    of room costs no forward and what waits for the batcher stays within the budget; a payload that was
    already there (the cache's, another call's computation, a lease) once, from when its turn to be sent
    comes. Each item gives back all it holds once sent.
    """

    context: grpc.aio.ServicerContext
    charge: StreamCharge
    record: RequestRecord
    transport: CallTransport = STREAM
    _: KW_ONLY
    leases: LeaseStore | None = None
    lease: pb.LeaseRequest | None = None
    _messages: Iterator[bytes] | None = field(default=None, init=False)  # left to write
    _writing: bytes | None = field(default=None, init=False)  # the message gRPC has now

    async def send_all(self, flows: Sequence[ItemFlow]) -> None:
        """Sends every item, in the flows' order; what the transport placed is handed over once the
        stream completed, and taken back otherwise."""
        transport = self.transport
        try:
            async with contextlib.aclosing(self.items(flows)) as items:
                async for item in items:
                    await self._send(transport, item)
            transport.hand_over()
        finally:
            transport.close()

    async def items(self, flows: Sequence[ItemFlow]) -> AsyncIterator[ItemOut]:
        """Each item's ItemOut, in the flows' order, charged. The flows run at once, each going its own
        way (cache hit, another call's computation, or the batcher) as soon as its bytes are read. Close
        it (`contextlib.aclosing`) so that the items of a call that went away leave the batcher's queue."""
        charge = self.charge
        if len(flows) == 1:  # a lone item needs no task of its own: one turn of the event loop less
            item, computed = await self._run(flows[0])
            if item.payload is not None and not computed:  # its turn to be sent has come
                await charge.reserve(item.index, item.payload.nbytes)
            yield item
            return
        tasks = [asyncio.ensure_future(self._run(flow)) for flow in flows]
        for task in tasks:
            task.add_done_callback(_retrieve_exception)  # items left behind when an earlier one failed
        try:
            for task in tasks:
                item, computed = await task
                if item.payload is not None and not computed:
                    await charge.reserve(item.index, item.payload.nbytes)
                yield item
        finally:
            for task in tasks:
                task.cancel()  # no-op for finished ones; a cancelled call's items leave the queue

    async def _run(self, flow: ItemFlow) -> tuple[ItemOut, bool]:
        """Runs one item's flow to its ItemOut, charging a computation of this call's before letting its
        forward through; True when it did."""
        try:
            step = await anext(flow)
            if isinstance(step, ItemOut):
                return step, False
            try:
                await self.charge.reserve(step.index, 2 * step.output_bytes + step.input_bytes)
            except OverloadedError as exc:
                step.refuse(exc)  # no forward for it
                raise
            step.let_through()
            item = await anext(flow)
            self.charge.release(item.index, step.input_bytes)  # the forward is over
            return item, True
        finally:
            await flow.aclose()

    async def _send(self, transport: CallTransport, item: ItemOut) -> None:
        index, payload = item.index, item.payload
        if payload is None:  # its caller sends the image's bytes again
            not_held = pb.EncodeResponse(header=pb.ItemHeader(index=index, not_held=True))
            await self._write((not_held.SerializeToString(),))
            self.record.item_not_held()
            return
        message = payload.header_message(index, item.cache_hit)
        if item.content_sha256 is not None:
            message.header.content_sha256 = item.content_sha256
        lease = self.lease
        if lease is not None:
            message.header.lease.CopyFrom(self.leases.grant(item.key, payload, lease.ttl_ms))
        # No chunks follow a payload withheld for its Fetch, or placed by the call's transport.
        withheld = lease is not None and lease.withhold_payload
        placed = withheld or await transport.place(message.header, payload)
        header = message.SerializeToString()  # once the transport has written where it placed the payload
        started = time.perf_counter()
        if placed:
            await self._write((header,))
        else:
            # A connection not known to read gets small first chunks: stalled, it leaves less inside gRPC.
            chunks = payload.chunks(small_first=not self.charge.reads)
            try:
                await self._write(itertools.chain((header,), chunks))
            except BaseException:
                payload.finish_framing()  # the payload may live on in the cache: not as tensors and chunks
                raise
        self.charge.release(index)
        self.record.item_sent(
            message.header,
            response_bytes=len(header) + (0 if placed else payload.nbytes),
            stream_s=time.perf_counter() - started,
        )
        if tracing.enabled():  # an event, not a span: a cached item's call has no other stage to trace
            transfer = "stream" if not placed else "withheld" if withheld else "shm"
            tracing.event("encoder.sent", {
                "encoder.item.index": index, "encoder.transfer": transfer, "encoder.cache_hit": item.cache_hit,
                "encoder.payload_bytes": message.header.payload_bytes, "encoder.send_ms": (time.perf_counter() - started) * 1000,
            })  # fmt: skip

    async def _write(self, messages: Iterable[bytes]) -> None:
        """Hands `messages` (serialized) to gRPC one after the other, their writes stepped by a
        PendingWrite: the call waits once for all of them, and gRPC's completion of one starts the next.
        When the budget cuts the stream (cancelling this call), the message being written stays inside
        gRPC, none after it is written, and the charge follows that message (StreamCut)."""
        charge = self.charge
        self._messages = iter(messages)
        write = PendingWrite(self._write_each())
        try:
            await write.done
        except asyncio.CancelledError:
            if charge.cut_why is None:  # the call itself was cancelled: its receiver went
                write.cancel()
                raise
            self._messages = None  # nothing more is written, and the write no longer holds the payload
            raise StreamCut(write.finished(), len(self._writing), charge.cut_why) from None

    async def _write_each(self) -> None:
        """Writes what `_messages` has left, none once the budget has cut the stream. While gRPC has a
        message, this holds that message and no other: a cut stream's write goes on, but its payload
        can go."""
        charge = self.charge
        while (
            self._messages is not None
            and charge.cut_why is None
            and (message := next(self._messages, None)) is not None
        ):
            self._writing = message
            # When it began waiting for the receiver: the budget's watchdog cuts a stream stuck too long.
            charge.sending_since = time.monotonic()
            await self.context.write(message)
        self._messages = None
        charge.sending_since = None

    async def push(
        self, headers: Sequence[pb.ItemHeader], transfer: Awaitable[None], response_bytes: Sequence[int]
    ) -> None:
        """Awaits a transfer made outside gRPC (SGLang's ZMQ push of a part), under the watchdog's clock,
        then reports each of its items sent with the bytes it took."""
        self.charge.sending_since = time.monotonic()
        started = time.perf_counter()
        await transfer
        self.charge.sending_since = None
        seconds = time.perf_counter() - started
        for header, nbytes in zip(headers, response_bytes):
            self.record.item_sent(header, response_bytes=nbytes, stream_s=seconds)
        if tracing.enabled():
            tracing.event("encoder.sent", {
                "encoder.transfer": "zmq", "encoder.items": len(headers), "encoder.payload_bytes": sum(response_bytes),
                "encoder.send_ms": seconds * 1000,
            })  # fmt: skip


class PendingWrite:
    """A write's coroutine (an item's `context.write` calls, one message after the other), stepped from
    the done callbacks of the futures it awaits instead of run as a task of its own, so that it goes on
    when its call is cancelled. `done` resolves with the write; cancelling `done` (its call was cut)
    leaves the write going, and `finished()` tells when it is over; `cancel()` stops the write itself
    (its call went away). A message costs the event loop one turn this way, and the call's task is woken
    once per item (docs/performance-dataplane.md)."""

    __slots__ = ("_awaited", "_coro", "_finished", "_loop", "done")

    def __init__(self, coro: Coroutine[Any, Any, None]):
        self._coro = coro
        self._loop = asyncio.get_running_loop()
        self._awaited: asyncio.Future | None = None
        self._finished: asyncio.Future | None = None
        self.done = self._loop.create_future()
        self._step()

    def finished(self) -> asyncio.Future:
        """A future that resolves once the write is over, whichever way it ended."""
        if self._finished is None:
            self._finished = self._loop.create_future()
            if self._coro is None:
                self._finished.set_result(None)
        return self._finished

    def cancel(self) -> None:
        if self._awaited is not None:
            self._awaited.cancel()  # the coroutine gets CancelledError where it waits, as a task would

    def _step(self, _: object = None) -> None:
        try:
            awaited = self._coro.send(None)
        except StopIteration:
            self._end(None)
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - the write's outcome, handed to `done`
            self._end(exc)
        else:
            if awaited is None:  # a bare yield (asyncio.sleep(0)): step again on the next turn
                self._awaited = None
                self._loop.call_soon(self._step)
            else:
                awaited._asyncio_future_blocking = False
                self._awaited = awaited
                awaited.add_done_callback(self._step)

    def _end(self, exc: BaseException | None) -> None:
        self._coro = self._awaited = None
        if not self.done.done():  # else its call was cut: nobody waits on it
            if exc is None:
                self.done.set_result(None)
            elif isinstance(exc, asyncio.CancelledError):
                self.done.cancel()
            else:
                self.done.set_exception(exc)
        if self._finished is not None:
            self._finished.set_result(None)


def _retrieve_exception(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()
