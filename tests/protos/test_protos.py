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
    raw = wire.serialize(pb.EncodeResponse(header=header))
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
