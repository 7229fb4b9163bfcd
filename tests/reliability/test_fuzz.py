"""The fuzzing campaign's fixed-count run (scripts/fuzz.py): every parsed input holds on a few hundred
inputs per target, and what the campaign found stays fixed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from google.protobuf.message import DecodeError

from protos import wire
from testkit import REPO_ROOT

EXAMPLES = 200


def test_every_target_parses_or_refuses_with_a_documented_error():
    run = subprocess.run(
        [sys.executable, "scripts/fuzz.py", "--examples", str(EXAMPLES), "--seed", "1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    targets = json.loads(run.stdout.strip().splitlines()[-1])["targets"]
    assert {"encode_request", "fetch_request", "sglang_encode_request", "image_bytes", "data_url", "file_url",
            "gateway_chat", "chunk_codec", "shm_segment_name"} <= set(targets)  # fmt: skip
    for name, result in targets.items():
        assert result["inputs"] >= EXAMPLES // 2 and not result["findings"], (name, result)


@pytest.mark.parametrize("raw", [bytes([wire._CHUNK_TAG]), bytes([wire._CHUNK_TAG, 0x80]), bytes([wire._CHUNK_TAG, 5, 1])])
def test_a_chunk_whose_length_is_cut_short_is_refused_as_protobuf_refuses_it(raw):
    # Found by the campaign: a response of the chunk tag and a cut-short length raised IndexError.
    with pytest.raises(DecodeError):
        wire.parse_response(raw)


def test_a_file_url_with_a_nul_byte_is_refused_as_invalid(tmp_path):
    # Found by the campaign: the server answered INTERNAL (a ValueError from the path) instead of INVALID_ARGUMENT.
    from encoder_common.errors import InvalidItemError
    from encoder_common.file_url import read_file_url

    with pytest.raises(InvalidItemError, match="names no usable path"):
        read_file_url(f"file://{tmp_path}/a%00b.png", [tmp_path.resolve()], max_bytes=1024)


def test_an_item_of_a_modality_this_server_has_no_name_for_is_refused_as_unsupported():
    # Found by the campaign: naming an unknown enum value raised ValueError (INTERNAL) instead of refusing the item.
    from encoder_common.errors import UnsupportedModalityError
    from encoder_server.request_parsing import check_encode_request
    from protos import encoder_pb2 as pb

    request = pb.EncodeRequest(request_id="r", items=[pb.ImageItem(index=0, modality=4, data=b"x")])
    with pytest.raises(UnsupportedModalityError, match="modality number 4"):
        check_encode_request(request, 64)


def test_a_file_url_that_urllib_cannot_parse_is_refused_as_invalid(tmp_path):
    # Found by the campaign: "file://[" raised ValueError (INTERNAL) out of urllib.
    from encoder_common.errors import InvalidItemError
    from encoder_common.file_url import read_file_url

    with pytest.raises(InvalidItemError, match="not a valid file:// URL"):
        read_file_url("file://[/a.png", [tmp_path.resolve()], max_bytes=1024)
