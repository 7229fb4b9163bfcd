"""The bare grpcio client the data-plane baselines read with (scripts/bench.py, scripts/profile_dataplane.py):
each chunk copied, as it arrives, into a pooled buffer, as `EncoderReceiver` does with its own."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import torch

from protos import wire
from receiver.buffers import POOL


async def receive_payload(responses: AsyncIterator[bytes], nbytes: int) -> None:
    """Reads one stream of raw response messages; an ItemHeader (from our server) is skipped."""
    dst, filled = POOL.empty((nbytes,), torch.uint8).numpy(), 0
    async for message in responses:
        part = wire.parse_response(message)
        if isinstance(part, memoryview):
            dst[filled : filled + len(part)] = np.frombuffer(part, np.uint8)
            filled += len(part)
    assert filled == nbytes, f"{filled} payload bytes received, {nbytes} expected"
