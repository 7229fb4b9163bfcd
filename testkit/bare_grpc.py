"""Bare grpcio clients: the one the data-plane baselines read with (scripts/bench.py,
scripts/profile_dataplane.py), each chunk copied as it arrives into a pooled buffer as `EncoderReceiver`
does with its own; and the channel options of clients that never read (tests/encoder_server/test_stream_budget.py,
scripts/stalled_clients.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import torch

from protos import wire
from receiver.buffers import POOL

# A channel on a TCP connection of its own, as a separate client has: gRPC otherwise shares one
# connection among the channels to the same address with the same options.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
# A client that never reads: without BDP probing its HTTP/2 window stays at 64 KiB, so gRPC cannot take
# a 7 MiB payload off the server into the client's own buffers either.
NEVER_READS = [*OWN_CONNECTION, ("grpc.http2.bdp_probe", 0)]


async def receive_payload(responses: AsyncIterator[bytes], nbytes: int) -> None:
    """Reads one stream of raw response messages; an ItemHeader (from our server) is skipped."""
    dst, filled = POOL.empty((nbytes,), torch.uint8).numpy(), 0
    async for message in responses:
        part = wire.parse_response(message)
        if isinstance(part, memoryview):
            dst[filled : filled + len(part)] = np.frombuffer(part, np.uint8)
            filled += len(part)
    assert filled == nbytes, f"{filled} payload bytes received, {nbytes} expected"
