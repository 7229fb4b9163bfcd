"""Fetching leased items: an embedding an Encode call with a lease left on an encoder, streamed back by
its content key (the Fetch RPC) in Encode's format and read by the same assembly code."""

from __future__ import annotations

import time
from collections.abc import Sequence

from encoder_common.errors import EncoderError, NotFoundError

from ..config import FailoverPolicy
from ..embeddings.assembly import Allocator
from ..embeddings.result import ItemResult
from ..transports import ReceiverTransport
from ..transports.stream import STREAM
from .channels import EncoderEndpoint
from .shard_call import fetch_shard

# How a chat request names a leased item to an inference engine's connector (receiver.vllm.connector):
# the content part's `uuid`. The key alone, so that the same image has the same uuid whichever encoder
# holds it (vLLM's prefix cache keys on it too).
UUID_PREFIX = "enc:"


def item_uuid(lease_key: bytes) -> str:
    """The `uuid` a chat content part carries for an item leased under `lease_key`."""
    return UUID_PREFIX + lease_key.hex()


def lease_key(identifier: str) -> bytes | None:
    """The lease key an item identifier names, or None when it is not one of ours."""
    if not identifier.startswith(UUID_PREFIX):
        return None
    try:
        key = bytes.fromhex(identifier[len(UUID_PREFIX) :])
    except ValueError:
        return None
    return key if len(key) == 32 else None


class FetchFailedError(EncoderError):
    """No encoder streamed a leased item: says what each one answered."""

    def __init__(self, key: bytes, answers: Sequence[tuple[str, str]], not_found: bool):
        self.key = key
        self.answers = list(answers)
        self.not_found = not_found  # every encoder that answered said NOT_FOUND
        story = "; ".join(f"{url}: {answer}" for url, answer in answers) or "no encoder to ask"
        super().__init__(f"leased item {key.hex()} could not be fetched: {story}")


async def fetch_leased(
    endpoints: Sequence[EncoderEndpoint],
    request_id: str,
    key: bytes,
    *,
    deadline: float,
    prefer_url: str | None = None,
    policy: FailoverPolicy,
    transport: ReceiverTransport = STREAM,
    allocate: Allocator | None = None,
) -> ItemResult:
    """One leased item from whichever encoder holds it: `prefer_url` first (the one that encoded it),
    then the others in order, each call under the stall watch. Raises FetchFailedError with every
    encoder's answer when none has it."""
    ordered = sorted(endpoints, key=lambda e: e.url != prefer_url)
    answers: list[tuple[str, str]] = []
    for endpoint in ordered:
        try:
            (item,) = await fetch_shard(
                endpoint, request_id, [key], deadline=deadline, policy=policy, transport=transport, allocate=allocate
            )
            return item
        except EncoderError as exc:
            answers.append((endpoint.url, str(exc)))
            if time.monotonic() >= deadline:
                break
    not_found = bool(answers) and all(answer.startswith("NOT_FOUND") for _, answer in answers)
    raise FetchFailedError(key, answers, not_found)


__all__ = [
    "FetchFailedError",
    "NotFoundError",
    "UUID_PREFIX",
    "fetch_leased",
    "item_uuid",
    "lease_key",
]
