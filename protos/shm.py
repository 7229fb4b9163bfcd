"""The same-host fast path's contract, byte for byte on both sides: the file names under the
shared-memory directory (owner-only, random 128-bit instance ids and segment names; one lock file per
instance tells live from dead), the segment header, and the proof that a server shares the receiver's
memory."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import struct

from protos import encoder_pb2 as pb

TOKEN_BYTES = 32
HEADER_BYTES = 128  # the payload starts here: a cache-line multiple, so it stays aligned for any dtype
_MAGIC = b"ENCSHM01"
# magic, payload_bytes, index, num_tokens, hidden_size, dtype, num_deepstack_layers, proof
_HEADER = struct.Struct("<8sQIIIII32s")

SERVER_KIND = "encsrv"
RECEIVER_KIND = "encrx"
_HEX = "[0-9a-f]{32}"
# <kind>.<pid>.<instance>.<role>: pid for people reading `ls /dev/shm`, the instance id for safety.
NAME = re.compile(
    rf"(?P<instance>(?:{SERVER_KIND}|{RECEIVER_KIND})\.\d+\.{_HEX})\.(?P<role>lock|probe|pool\.{_HEX}|seg\.{_HEX})"
)
LOCK_ROLE = {SERVER_KIND: "lock", RECEIVER_KIND: "probe"}  # the file whose flock says the instance lives


def new_instance(kind: str) -> str:
    """A fresh instance id: `<kind>.<pid>.<128 random bits>`."""
    return f"{kind}.{os.getpid()}.{secrets.token_hex(16)}"


def random_name(instance: str, role: str) -> str:
    """An unguessable file name of the instance: `<instance>.<role>.<128 random bits>`."""
    return f"{instance}.{role}.{secrets.token_hex(16)}"


def _role(name: str) -> str | None:
    match = NAME.fullmatch(name)
    return match["role"] if match else None


def is_probe_name(name: str) -> bool:
    """A receiver's probe name, and nothing else: servers open only names that pass this."""
    return name.startswith(RECEIVER_KIND + ".") and _role(name) == "probe"


def is_segment_name(name: str) -> bool:
    """A server's announced segment name: receivers open and unlink only names that pass this."""
    role = _role(name)
    return name.startswith(SERVER_KIND + ".") and role is not None and role.startswith("seg.")


def item_proof(token: bytes, request_id: str, index: int, segment: str, payload_bytes: int) -> bytes:
    """HMAC-SHA256 keyed by the probe's token over what the stream announces for one item."""
    message = f"encoder.v1 shm|{request_id}|{index}|{segment}|{payload_bytes}".encode()
    return hmac.new(token, message, hashlib.sha256).digest()


def segment_header(header: pb.ItemHeader, proof: bytes) -> bytes:
    """The first HEADER_BYTES of a segment: what the stream's ItemHeader says, and its proof."""
    packed = _HEADER.pack(
        _MAGIC,
        header.payload_bytes,
        header.index,
        header.num_tokens,
        header.hidden_size,
        header.dtype,
        header.num_deepstack_layers,
        proof,
    )
    return packed.ljust(HEADER_BYTES, b"\0")
