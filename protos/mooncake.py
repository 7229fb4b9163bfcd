"""The transfer-engine path's contract, what both sides must agree on byte for byte: the token's size
and the MAC that ties an item's header to the slot its payload was written into, for one call."""

from __future__ import annotations

import hashlib
import hmac

TOKEN_BYTES = 32
PROTOCOLS = ("tcp", "rdma")


def placement_mac(
    token: bytes, request_id: str, index: int, slot: int, address: int, payload_bytes: int
) -> bytes:
    """HMAC-SHA256 keyed by the call's token over what the header announces for one placed item."""
    message = f"encoder.v1 mooncake|{request_id}|{index}|{slot}|{address}|{payload_bytes}".encode()
    return hmac.new(token, message, hashlib.sha256).digest()
