"""One streaming call to one encoder, read into a `ShardAssembler` under a stall watch: an Encode call
for a shard of a request's items, or a Fetch call for leased items. Both read the same way."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from encoder_common import tracing
from encoder_common.errors import TransferUnavailableError, error_class_for
from protos import encoder_pb2 as pb
from protos import wire

from ..config import FailoverPolicy
from ..embeddings.assembly import Allocator, ShardAssembler, StreamProtocolError
from ..embeddings.result import ItemResult
from ..errors import ShardError
from ..transports import ReceiverTransport
from ..transports.stream import STREAM
from .channels import SERVICE_NAME, EncoderEndpoint

ENCODE_METHOD = f"/{SERVICE_NAME}/Encode"
FETCH_METHOD = f"/{SERVICE_NAME}/Fetch"


@dataclass(frozen=True)
class CallFailure:
    """How a call ended before all its items arrived: a status code, or None for a stream that broke
    the contract (or whose transport could not be used)."""

    code: grpc.StatusCode | None
    message: str


async def read_call(
    endpoint: EncoderEndpoint,
    call: grpc.aio.UnaryStreamCall,
    assembler: ShardAssembler,
    policy: FailoverPolicy,
    arrived: Callable[[ItemResult], None] | None = None,
) -> CallFailure | None:
    """Feeds every message of `call` to `assembler`, handing each finished item to `arrived`.

    Returns None when the stream ended cleanly (the caller checks that nothing is missing), or as soon
    as its last item is whole (its last byte on the stream, or its header where the transport placed
    it): the endpoint reads the end of the call (`EncoderEndpoint.hear_end`) while the items go on. A
    placed payload is the receiver's from its header on, whether or not the call then completes: the
    server never writes again to a segment whose name the receiver has not unlinked. A stream silent
    for `stall_timeout_s` whose encoder then fails a health probe is cancelled and reported as
    UNAVAILABLE.
    """
    watch = StallWatch(policy, endpoint, call)
    try:
        async for message in call:
            watch.last_message = time.monotonic()
            done = assembler.feed(message)
            if done is not None:
                if arrived is not None:
                    arrived(done)
                if len(assembler.items) == len(assembler.expected):
                    endpoint.hear_end(call)
                    return None
    except grpc.aio.AioRpcError as exc:
        endpoint.heard(exc.trailing_metadata())  # a refusal says how loaded the encoder is, too
        if watch.stalled:
            return CallFailure(grpc.StatusCode.UNAVAILABLE, watch.reason)
        return CallFailure(exc.code(), exc.details() or "")
    except (StreamProtocolError, TransferUnavailableError) as exc:
        call.cancel()
        return CallFailure(None, str(exc))
    except asyncio.CancelledError:
        if watch.stalled:  # the watch cancelled the call; nobody cancelled this task
            return CallFailure(grpc.StatusCode.UNAVAILABLE, watch.reason)
        call.cancel()  # the request was cancelled or gave up: the encoder drops the call's queued items
        raise
    finally:
        watch.stop()
    endpoint.heard(await call.trailing_metadata())
    return None


async def encode_shard(
    endpoint: EncoderEndpoint,
    request_id: str,
    items: Sequence[tuple[int, bytes]],
    keys: Mapping[int, bytes],
    *,
    deadline: float,
    policy: FailoverPolicy,
    arrived: Callable[[ItemResult], None],
    transport: ReceiverTransport = STREAM,
    lease: pb.Lease | None = None,
) -> ShardError | None:
    """One Encode call for `items` ((index, image bytes) pairs) on one encoder; `keys`: each item's
    content key (`affinity.content_key`), by index.

    Returns None when every item arrived, else a ShardError naming the items that did not; an item
    cut off half-way is dropped whole, so a retry rewrites it from scratch. An image the encoder said it
    keeps goes as its sha256 alone (`endpoint.held`); one it no longer holds is sent again with its
    bytes. Items the transport placed where they could not be read are asked for again over the stream.
    """
    indices = [index for index, _ in items]
    digests = {index: endpoint.held.digest(keys[index], data) for index, data in items}
    request, assembler = _encode_request(endpoint.url, request_id, items, digests, transport, lease)

    def failed(code: grpc.StatusCode | None, message: str, missing: Sequence[int]) -> ShardError:
        return ShardError(
            encoder_url=endpoint.url, request_id=request_id, item_indices=missing, code=code, message=message
        )

    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return failed(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the call", indices)
    with tracing.client_span(ENCODE_METHOD, endpoint.url, {"encoder.items": len(indices)}) as span:
        call = endpoint.encode(request, timeout=remaining, metadata=tracing.grpc_metadata(endpoint.metadata))
        failure = await read_call(endpoint, call, assembler, policy, arrived)
        _ended(span, failure)
    if assembler.read_placed is not None:
        transport.end_call(assembler.read_placed, complete=failure is None)
    for index, digest in assembler.digests.items():
        endpoint.held.held(keys[index], digest)
    for index in assembler.not_held:
        endpoint.held.forget(keys[index])  # so that the call again below sends its bytes
    if failure is not None:
        return failed(failure.code, failure.message, assembler.missing())
    # References the encoder no longer held, with their bytes and the same transport; items placed
    # where they could not be read, over the stream.
    for again, via in ((assembler.not_held, transport), (assembler.refetch, STREAM)):
        if again:
            error = await encode_shard(
                endpoint, request_id, [(index, data) for index, data in items if index in again], keys,
                deadline=deadline, policy=policy, arrived=arrived, transport=via, lease=lease,
            )  # fmt: skip
            if error is not None:
                return error
    asked_again = {*assembler.refetch, *assembler.not_held}
    missing = [index for index in assembler.missing() if index not in asked_again]
    if missing:
        return failed(None, "stream ended before these items arrived", missing)
    return None


def _encode_request(
    url: str,
    request_id: str,
    items: Sequence[tuple[int, bytes]],
    digests: Mapping[int, bytes | None],
    transport: ReceiverTransport,
    lease: pb.Lease | None,
) -> tuple[bytes, ShardAssembler]:
    """The framed Encode request for `items`, with the transport's offer, and the assembler that reads its
    answer. An image whose digest is given goes as that digest alone (the encoder said it keeps it)."""
    withheld = lease is not None and lease.withhold_payload
    fields = pb.EncodeRequest(request_id=request_id, lease=lease)  # the request but for its items
    read_placed = None if withheld else transport.open_call(fields, url, len(items))
    # A held image goes as its digest and no bytes (content_sha256=None leaves the field unset).
    request = wire.encode_request(
        fields,
        [
            (pb.ImageItem(index=index, modality=pb.IMAGE, content_sha256=digests[index]),
             None if digests[index] is not None else data)
            for index, data in items
        ],
    )  # fmt: skip
    references = [index for index, _ in items if digests[index] is not None]
    indices = [index for index, _ in items]
    return request, ShardAssembler(indices, url, read_placed, payloads=not withheld, references=references)


async def fetch_shard(
    endpoint: EncoderEndpoint,
    request_id: str,
    keys: Sequence[bytes],
    *,
    deadline: float,
    policy: FailoverPolicy,
    transport: ReceiverTransport = STREAM,
    allocate: Allocator | None = None,
) -> list[ItemResult]:
    """One Fetch call: the leased items of `keys`, in order, each received into a tensor from `allocate`.

    Raises the status's error class (NotFoundError for a key the encoder does not hold; UnavailableError
    for a stalled stream), or StreamProtocolError when the stream breaks the contract. Items the
    transport placed where they could not be used are fetched again over the stream.
    """
    request = pb.FetchRequest(request_id=request_id, keys=keys)
    read_placed = transport.open_call(request, endpoint.url, len(keys))
    assembler = ShardAssembler(range(len(keys)), endpoint.url, read_placed, allocate)
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise error_class_for(grpc.StatusCode.DEADLINE_EXCEEDED)("the deadline passed before the call")
    with tracing.client_span(FETCH_METHOD, endpoint.url, {"encoder.items": len(keys)}) as span:
        call = endpoint.fetch(request, timeout=remaining, metadata=tracing.grpc_metadata(endpoint.metadata))
        failure = await read_call(endpoint, call, assembler, policy)
        _ended(span, failure)
    if assembler.read_placed is not None:
        transport.end_call(assembler.read_placed, complete=failure is None)
    if failure is not None:
        if failure.code is None:
            raise StreamProtocolError(failure.message)
        raise error_class_for(failure.code)(f"{failure.code.name}: {failure.message}")
    results = dict(assembler.items)
    if assembler.refetch:
        again = [keys[i] for i in assembler.refetch]
        refetched = await fetch_shard(
            endpoint, request_id, again, deadline=deadline, policy=policy, allocate=allocate
        )
        for index, item in zip(assembler.refetch, refetched):
            item.index = index
            results[index] = item
    missing = [i for i in range(len(keys)) if i not in results]
    if missing:
        raise StreamProtocolError(f"Fetch stream from {endpoint.url} ended before items {missing} arrived")
    return [results[i] for i in range(len(keys))]


def _ended(span, failure: CallFailure | None) -> None:
    if failure is None:
        tracing.rpc_ended(span, grpc.StatusCode.OK)
    else:
        tracing.rpc_ended(span, failure.code, failure.message)


class StallWatch:
    """Watches one call: after `stall_timeout_s` without a message it probes the encoder, and
    cancels the call unless the probe answers SERVING (a busy encoder is left alone).

    A timer, not a task: a call that streams along costs one timer handle, and a probe task is made
    only when the stream has been silent that long.
    """

    __slots__ = ("_probe", "_timer", "call", "endpoint", "last_message", "policy", "reason", "stalled")

    def __init__(self, policy: FailoverPolicy, endpoint: EncoderEndpoint, call: grpc.aio.UnaryStreamCall):
        self.policy = policy
        self.endpoint = endpoint
        self.call = call
        self.last_message = time.monotonic()
        self.stalled = False
        self.reason = ""
        self._probe: asyncio.Task | None = None
        self._timer = asyncio.get_running_loop().call_later(policy.stall_timeout_s, self._check)

    def _check(self) -> None:
        wait = self.last_message + self.policy.stall_timeout_s - time.monotonic()
        if wait > 0:
            self._timer = asyncio.get_running_loop().call_later(wait, self._check)
        else:
            self._probe = asyncio.create_task(self._probe_encoder())

    async def _probe_encoder(self) -> None:
        if await self.endpoint.is_serving(self.policy.probe_timeout_s):
            self.last_message = time.monotonic()
            self._check()
            return
        self.stalled = True
        silence = self.policy.stall_timeout_s
        self.reason = f"no message for {silence:g} s and no SERVING answer to a health probe: abandoned"
        self.call.cancel()

    def stop(self) -> None:
        self._timer.cancel()
        if self._probe is not None:
            self._probe.cancel()
