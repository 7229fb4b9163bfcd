"""The Encode stream's codec: tensors as raw bytes in ~1 MiB chunk messages, parsed without copies; and
an Encode request's images, framed by the receiver and read in place by the server, without copies either.

A chunk is an `EncodeResponse` whose only field is `chunk` (field 2, length-delimited). Its wire
form is one tag byte, a varint length and the bytes, so the server frames a slice of the tensor's
memory directly and the receiver takes a zero-copy view of the payload instead of running a
protobuf parse. Every message stays valid protobuf: grpcurl and generated stubs read it as usual.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from protos import encoder_pb2 as pb

# About 1 MiB per message: far from the 4 MiB default receive limit, and large enough that
# Python's per-message cost stays small (measured on a 2-core x86-64 VM: 1 MiB chunks streamed at
# ~0.9-1.1 GB/s; 256 KiB chunks were measurably slower).
CHUNK_BYTES = 1 << 20

_CHUNK_TAG = 0x12  # field 2, wire type 2 (length-delimited)

TORCH_DTYPES: dict[int, torch.dtype] = {
    pb.BFLOAT16: torch.bfloat16,
    pb.FLOAT16: torch.float16,
    pb.FLOAT32: torch.float32,
}
WIRE_DTYPES: dict[torch.dtype, int] = {v: k for k, v in TORCH_DTYPES.items()}
DTYPE_NAMES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a CPU tensor's memory (row-major), bf16 included."""
    return memoryview(tensor.contiguous().view(torch.uint8).reshape(-1).numpy())


def chunk_messages(payload: memoryview, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Serialized `EncodeResponse{chunk}` messages covering `payload`, one copy per chunk."""
    for start in range(0, len(payload), chunk_bytes):
        part = payload[start : start + chunk_bytes]
        yield b"".join((bytes((_CHUNK_TAG,)), _varint(len(part)), part))


def frame_parts(parts: Sequence[torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """An item's payload (its tensors, one after the other) as chunk messages, framed one at a time."""
    for part in parts:
        yield from chunk_messages(tensor_bytes(part), chunk_bytes)


def framed_size(part_sizes: Sequence[int], chunk_bytes: int = CHUNK_BYTES) -> int:
    """How many bytes the chunk messages of `frame_parts` take, for parts of these sizes in bytes."""
    total = 0
    for size in part_sizes:
        full, rest = divmod(size, chunk_bytes)
        total += size + full * (1 + len(_varint(chunk_bytes))) + (1 + len(_varint(rest)) if rest else 0)
    return total


def serialize(message: pb.EncodeRequest | bytes) -> bytes:
    """The receiver's Encode request serializer: a message, or the bytes of `encode_request` untouched."""
    return message if isinstance(message, bytes) else message.SerializeToString()


_ITEMS_TAG = 0x12  # EncodeRequest.items: field 2, length-delimited
_DATA_TAG = 0x1A  # ImageItem.data: field 3, length-delimited


def encode_request(request: pb.EncodeRequest, data: Sequence[tuple[pb.ImageItem, bytes | None]]) -> bytes:
    """`request` serialized with one more item per (item, its image bytes): each image copied once, into
    the request's bytes, instead of into an ImageItem and again when that is serialized (measured with a
    465 KB JPEG: ~30 us instead of ~140 us). `item` carries the other fields and no `data`; an item
    whose image is None goes as it is (a reference by content_sha256).

    Protobuf reads fields in any order, so the items framed here follow the request's own fields.
    """
    parts = [request.SerializeToString()]
    for item, image in data:
        head = item.SerializeToString()
        if image is None:
            parts += [bytes((_ITEMS_TAG,)), _varint(len(head)), head]
            continue
        head += bytes((_DATA_TAG,)) + _varint(len(image))
        parts += [bytes((_ITEMS_TAG,)), _varint(len(head) + len(image)), head, image]
    return b"".join(parts)


class _Unscannable(Exception):
    """Bytes `request_images` leaves to protobuf."""


def _read_varint(raw: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it."""
    value = shift = 0
    while pos < end and shift < 64:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise _Unscannable


def _read_key(raw: bytes, pos: int, end: int) -> tuple[int, int]:
    """A field's key (its number and wire type) and the position after it; a key past 32 bits, which
    protobuf refuses, is left to protobuf."""
    key, pos = _read_varint(raw, pos, end)
    if key >> 32:
        raise _Unscannable
    return key, pos


def _field_end(raw: bytes, pos: int, end: int, wire_type: int) -> int:
    """Where the value of a field of `wire_type` that starts at `pos` ends."""
    if wire_type == 0:
        return _read_varint(raw, pos, end)[1]
    if wire_type == 2:
        length, pos = _read_varint(raw, pos, end)
    elif wire_type in (1, 5):
        length = 8 if wire_type == 1 else 4
    else:  # groups, and wire types that do not exist
        raise _Unscannable
    if pos + length > end:
        raise _Unscannable
    return pos + length


def _item_without_data(raw: bytes, start: int, end: int) -> tuple[bytes, memoryview] | None:
    """The ImageItem in raw[start:end] with every `data` value emptied, and a view of the last one (the
    one protobuf keeps); None when it has no `data`."""
    pieces, kept, pos, last = [], start, start, None
    while pos < end:
        key, value = _read_key(raw, pos, end)
        pos = _field_end(raw, value, end, key & 7)
        if key == _DATA_TAG:
            image = _read_varint(raw, value, end)[1]
            pieces += [raw[kept:value], b"\x00"]
            kept, last = pos, (image, pos)
    if last is None:
        return None
    pieces.append(raw[kept:end])
    return b"".join(pieces), memoryview(raw)[last[0] : last[1]]


def request_images(raw: bytes) -> tuple[bytes, list[memoryview | None]] | None:
    """A serialized EncodeRequest taken apart without copying its images: the request with each item's
    `data` emptied (left in place, so protobuf still sees whether `data` or `url` came last), and per
    item, in order, a view of its image bytes in `raw` (None for an item without `data`). Parsing the
    images with protobuf and reading `ImageItem.data` copy each one twice; a 465 KB JPEG in a cached
    item's call is otherwise the largest copy its server makes. None when `raw` holds something this
    does not take apart (a group, a length past the end, a varint over 64 bits): protobuf decides then.
    """
    try:
        pieces, images, kept, pos, end = [], [], 0, 0, len(raw)
        while pos < end:
            key, value = _read_key(raw, pos, end)
            field_end = _field_end(raw, value, end, key & 7)
            if key == _ITEMS_TAG:
                item = _item_without_data(raw, _read_varint(raw, value, end)[1], field_end)
                images.append(None if item is None else item[1])
                if item is not None:
                    pieces += [raw[kept:value], _varint(len(item[0])), item[0]]
                    kept = field_end
            pos = field_end
    except _Unscannable:
        return None
    pieces.append(raw[kept:])
    return b"".join(pieces), images


def parse_response(raw: bytes) -> pb.ItemHeader | memoryview:
    """Response deserializer for the receiver: a chunk's payload view, or an item's header."""
    if raw and raw[0] == _CHUNK_TAG:
        try:
            length, offset = _read_varint(raw, 1, len(raw))
        except _Unscannable:
            pass  # a length cut short falls through to protobuf, which refuses it
        else:
            if offset + length == len(raw):
                return memoryview(raw)[offset:]
    message = pb.EncodeResponse.FromString(raw)
    kind = message.WhichOneof("kind")
    if kind == "chunk":  # a chunk framed some other valid way
        return memoryview(message.chunk)
    if kind is None:
        raise ValueError("EncodeResponse with neither header nor chunk")
    return message.header
