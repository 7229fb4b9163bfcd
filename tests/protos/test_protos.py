"""The contract: generated code matches the .proto, and the chunk framing is valid protobuf."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from protos import encoder_pb2 as pb
from protos import wire
from protos.generate import stale_files
from testkit import REPO_ROOT


def test_committed_generated_code_matches_the_proto():
    assert stale_files() == [], "run `python -m protos.generate` and commit the result"


def test_receiver_imports_without_model_code():
    code = "import sys, receiver; bad = [m for m in ('transformers', 'encoder_server') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 127, 1000])
def test_chunk_framing_round_trips_through_protobuf_and_the_fast_parser(dtype, rows):
    tensor = torch.randn(rows, 777).to(dtype)
    payload = wire.tensor_bytes(tensor)
    messages = list(wire.chunk_messages(payload, chunk_bytes=100_003))
    fast = b"".join(bytes(wire.parse_response(m)) for m in messages)
    slow = b"".join(pb.EncodeResponse.FromString(m).chunk for m in messages)
    assert fast == slow == bytes(payload)
    assert all(len(m) <= 100_003 + 8 for m in messages)
    rebuilt = torch.frombuffer(bytearray(fast), dtype=torch.uint8).view(dtype).reshape(rows, 777)
    assert torch.equal(rebuilt, tensor)


def test_headers_parse_as_headers():
    header = pb.ItemHeader(index=3, num_tokens=4, grid_thw=[1, 4, 4], hidden_size=8, dtype=pb.BFLOAT16, payload_bytes=64)
    raw = pb.EncodeResponse(header=header).SerializeToString()
    assert wire.parse_response(raw) == header
    with pytest.raises(ValueError):
        wire.parse_response(pb.EncodeResponse().SerializeToString())


def test_encode_request_frames_the_same_message_protobuf_would():
    images = [b"\xff\xd8" + bytes(range(256)) * 600, b"", b"x" * 127, b"y" * 128]  # lengths around varint steps
    items = [(pb.ImageItem(index=i, modality=pb.IMAGE), image) for i, image in enumerate(images)]
    request = pb.EncodeRequest(request_id="r-1", shm=pb.ShmOffer(probe="p"), lease=pb.Lease(ttl_ms=5))
    framed = wire.encode_request(request, items)
    expected = pb.EncodeRequest(
        request_id="r-1",
        items=[pb.ImageItem(index=i, modality=pb.IMAGE, data=image) for i, image in enumerate(images)],
        shm=pb.ShmOffer(probe="p"),
        lease=pb.Lease(ttl_ms=5),
    )
    assert pb.EncodeRequest.FromString(framed) == expected
    assert len(framed) == expected.ByteSize()


def _item(*fields: bytes) -> bytes:
    """An EncodeRequest.items field holding the ImageItem fields given, serialized one after another."""
    body = b"".join(fields)
    return bytes((0x12,)) + wire._varint(len(body)) + body


def _data(value: bytes) -> bytes:
    return pb.ImageItem(data=value).SerializeToString()


REQUESTS = {
    "two items": wire.encode_request(
        pb.EncodeRequest(request_id="r", shm=pb.ShmOffer(probe="p"), lease=pb.Lease(ttl_ms=5)),
        [(pb.ImageItem(index=i, modality=pb.IMAGE, content_sha256=b"s" * 32), b"\xff" * (i * 200)) for i in range(2)],
    ),
    "no image": pb.EncodeRequest(items=[pb.ImageItem(index=0, url="data:,x")]).SerializeToString(),
    "an image twice": _item(pb.ImageItem(index=3).SerializeToString(), _data(b"first"), _data(b"second" * 50)),
    "a url after the image": _item(_data(b"image"), pb.ImageItem(url="data:,x").SerializeToString()),
    "an image after a url": _item(pb.ImageItem(url="data:,x").SerializeToString(), _data(b"image")),
    "unknown fields": _item(_data(b"image"), b"\x30\x07", b"\x3a\x02zz") + b"\x48\x01" + _item(_data(b"b")),
    "a key spelled long": b"\x92\x00" + wire._varint(7) + _data(b"image"),
}


@pytest.mark.parametrize("name", REQUESTS)
def test_request_images_reads_each_image_where_protobuf_reads_it(name):
    raw = REQUESTS[name]
    stripped, images = wire.request_images(raw)
    request, whole = pb.EncodeRequest.FromString(stripped), pb.EncodeRequest.FromString(raw)
    assert len(images) == len(request.items) == len(whole.items)
    assert len(stripped) <= len(raw) - sum(len(image) for image in images if image is not None)
    for item, image in zip(request.items, images):
        if item.WhichOneof("source") == "data":
            assert item.data == b"" and image is not None
            item.data = bytes(image)
    assert request == whole  # everything else, unknown fields included, parsed as from the whole bytes


@pytest.mark.parametrize("raw", [_item(_data(b"image"))[:-1], b"\x12\x05\x1b\x00\x00\x00\x00", b"\x12\xff\xff\xff"])
def test_request_images_leaves_to_protobuf_what_it_does_not_take_apart(raw):
    assert wire.request_images(raw) is None  # a cut image, a group, a length past the end


def test_request_images_leaves_a_key_past_32_bits_to_protobuf():
    # Five varint bytes hold 35 bits: a key whose low bits say "items" but which protobuf refuses.
    raw = bytes((0x92, 0x80, 0x80, 0x80, 0x10)) + wire._varint(7) + _data(b"image")
    assert wire.request_images(raw) is None
