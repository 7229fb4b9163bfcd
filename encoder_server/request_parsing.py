"""Request checks shared by the encoder.v1 service and SGLang's contract: parsing without unknown fields,
bounded free-text fields and item counts, each refusal an InvalidItemError naming what was wrong."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from encoder_common.errors import InvalidItemError, UnsupportedModalityError
from protos import encoder_pb2 as pb
from protos import sglang_encoder_pb2 as sglang_pb
from protos import wire

# Free-text fields are bounded: they end up in logs and errors (a 1 MB request id was once accepted
# and logged). Request ids are UUID-like; URLs other than data: URIs (which carry the image itself
# and count against max_request_bytes) are short.
MAX_REQUEST_ID_CHARS = 256
MAX_URL_CHARS = 8192
MAX_PROBE_NAME_CHARS = 256


def parse_message(raw: bytes, message_class: type[Message], *, refuse_unknown: bool = True) -> Message:
    """Parses a request, refusing bytes that are not one and (unless told otherwise) top-level fields
    this server does not know.

    Unknown fields are refused rather than skipped: a newer receiver's field may change what the
    embedding should be, and an embedding silently computed without it would be wrong.
    """
    try:
        request = message_class.FromString(raw)
    except DecodeError:
        raise InvalidItemError(f"request is not a valid {message_class.DESCRIPTOR.full_name} message") from None
    unknown = [field.field_number for field in UnknownFieldSet(request)] if refuse_unknown else []
    if unknown:
        raise InvalidItemError(f"request has fields unknown to this server: numbers {sorted(set(unknown))}")
    return request


@dataclass(frozen=True, slots=True)
class EncodeCall:
    """An Encode request as parsed: the message, and per item whose source is `data` its image bytes where
    they arrived in the request (`wire.request_images`; the message's `data` is then empty), else None."""

    request: pb.EncodeRequest
    images: Sequence[memoryview | None]

    @property
    def request_id(self) -> str:
        return self.request.request_id


def parse_encode_request(raw: bytes, max_request_bytes: int) -> EncodeCall:
    """Parses an Encode request without copying its images: refused over `max_request_bytes` before
    parsing, and for unknown fields in it or its items, or over-long free-text fields."""
    if len(raw) > max_request_bytes:
        raise InvalidItemError(f"request is {len(raw)} bytes, over the limit of {max_request_bytes}")
    taken_apart = wire.request_images(raw)
    request = parse_message(raw if taken_apart is None else taken_apart[0], pb.EncodeRequest)
    if taken_apart is not None and len(taken_apart[1]) != len(request.items):
        # Not seen, but a disagreement with protobuf on the items must not move an image to another slot.
        taken_apart, request = None, parse_message(raw, pb.EncodeRequest)
    for item in request.items:
        unknown = [field.field_number for field in UnknownFieldSet(item)]
        if unknown:
            raise InvalidItemError(f"item {item.index}: fields unknown to this server: numbers {sorted(set(unknown))}")
    check_text_fields(request)
    if taken_apart is None:
        return EncodeCall(request, [None] * len(request.items))
    # An image is an item's source only where protobuf read `data` as the emptied field (the last of the
    # oneof: a url after it wins).
    return EncodeCall(
        request,
        [
            image if item.WhichOneof("source") == "data" and not item.data else None
            for item, image in zip(request.items, taken_apart[1])
        ],
    )


def parse_fetch_request(raw: bytes, max_keys: int) -> pb.FetchRequest:
    """Parses a Fetch request; refuses unknown fields and key lists that are empty, too long or malformed."""
    request = parse_message(raw, pb.FetchRequest)
    if not request.keys:
        raise InvalidItemError("fetch request has no keys")
    check_item_count(len(request.keys), max_keys, what="keys")
    bad = [index for index, key in enumerate(request.keys) if len(key) != 32]
    if bad:
        raise InvalidItemError(f"keys at positions {bad} are not 32-byte content keys")
    return request


def check_request_id(name: str, value: str) -> None:
    """Refuses an over-long request id before anything logs it."""
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidItemError(f"{name} is {len(value)} characters, over the limit of {MAX_REQUEST_ID_CHARS}")


def check_item_count(count: int, max_items: int, *, what: str = "items") -> None:
    if count > max_items:
        raise InvalidItemError(f"request has {count} {what}, over the limit of {max_items}")


def check_text_fields(request: pb.EncodeRequest) -> None:
    """Refuses over-long free-text fields, naming the field, before anything logs them."""
    check_request_id("request_id", request.request_id)
    if len(request.shm.probe) > MAX_PROBE_NAME_CHARS:
        raise InvalidItemError(
            f"shm.probe is {len(request.shm.probe)} characters, over the limit of {MAX_PROBE_NAME_CHARS}"
        )
    for item in request.items:
        if item.WhichOneof("source") == "url" and not item.url.startswith("data:") and len(item.url) > MAX_URL_CHARS:
            raise InvalidItemError(
                f"item {item.index}: url is {len(item.url)} characters, over the limit of {MAX_URL_CHARS}"
            )


def _modality_name(value: int) -> str:
    """A modality by its name, or by its number when this server knows no name for it (a newer client's)."""
    return pb.Modality.Name(value).lower() if value in pb.Modality.values() else f"modality number {value}"


def check_encode_request(request: pb.EncodeRequest, max_items: int) -> None:
    """Refuses an Encode request whose shape is wrong before any of its items is decoded."""
    non_image = [_modality_name(item.modality) for item in request.items if item.modality != pb.IMAGE]
    if non_image:
        raise UnsupportedModalityError(non_image)
    if not request.items:
        raise InvalidItemError("request has no items")
    check_item_count(len(request.items), max_items)
    indices = [item.index for item in request.items]
    if len(set(indices)) != len(indices):
        raise InvalidItemError(f"request repeats item indices: {indices}")


def check_sglang_encode_request(request: sglang_pb.EncodeRequest, max_items: int) -> None:
    """SGLang's own checks of an encode request, and this server's limits on ids and items."""
    if not request.req_id:
        raise InvalidItemError("missing req_id")
    check_request_id("req_id", request.req_id)  # the native request_id's limit: it is logged too
    if not request.mm_items:
        raise InvalidItemError("missing or empty mm_items")
    check_item_count(len(request.mm_items), max_items)
    if request.num_parts < 1:
        raise InvalidItemError("num_parts must be a positive integer")
    if request.part_idx >= request.num_parts:
        raise InvalidItemError(f"part_idx must be in [0, {request.num_parts})")


def check_receive_url_request(request: sglang_pb.SchedulerReceiveUrlRequest) -> None:
    if not request.req_id:
        raise InvalidItemError("missing req_id")
    check_request_id("req_id", request.req_id)
    if request.receive_count < 1:
        raise InvalidItemError("receive_count must be at least 1")
