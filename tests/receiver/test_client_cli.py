"""`encoder-client` against real servers: printed shapes and encoders, saved safetensors, exit codes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from receiver import EncoderReceiver
from receiver import cli as client_cli
from testkit.images import image_bytes
from testkit.servers import running_server


@pytest.fixture(scope="module")
async def two_servers(default_model_dir):
    async with running_server(default_model_dir, warmup=False) as a, running_server(default_model_dir, warmup=False) as b:
        yield [a, b]


async def test_prints_each_item_and_saves_the_embeddings(two_servers, tmp_path, capsys):
    files = []
    for i, (w, h) in enumerate([(56, 84), (28, 28), (100, 60)]):
        files.append(tmp_path / f"img{i}.png")
        files[-1].write_bytes(image_bytes(w, h, seed=20 + i))
    urls = ",".join(s.url for s in two_servers)
    out = tmp_path / "out.safetensors"
    args = client_cli.build_parser().parse_args(
        [*map(str, files), "--url", urls, "--request-id", "cli-test", "--seed", "1", "--info", "--save", str(out)]
    )
    assert await client_cli.run(args) == 0
    lines = capsys.readouterr().out.splitlines()
    info_lines = [line for line in lines if line.startswith("encoder ")]
    assert sorted(line.split()[1].removesuffix(":") for line in info_lines) == sorted(s.url for s in two_servers)
    assert all("qwen2_5_vl" in line and "hidden 2048" in line and "RANDOM WEIGHTS" in line for line in info_lines)

    async with EncoderReceiver([two_servers[0].url]) as rx:
        expected = await rx.encode("ref", [{"data": f.read_bytes()} for f in files])
    item_lines = [line for line in lines if line.startswith("item ")]
    assert len(item_lines) == 3
    for line, path, item in zip(item_lines, files, expected.items):
        assert line.startswith(f"item {item.index} {path.name}: {item.num_tokens} x 2048 float32, grid_thw {list(item.grid_thw)}")
        assert "encoder grpc://127.0.0.1:" in line and "forward " in line
    assert lines[-2].startswith(f"request cli-test: 3 items, {expected.num_tokens} tokens in ")
    assert lines[-1] == f"saved to {out}"

    with safe_open(str(out), "pt") as saved:
        metadata = saved.metadata()
        assert metadata["request_id"] == "cli-test"
        details = json.loads(metadata["items"])
        assert [d["file"] for d in details] == [str(f) for f in files]
        assert {d["encoder"] for d in details} <= {s.url for s in two_servers}
        for item in expected.items:
            torch.testing.assert_close(saved.get_tensor(f"item.{item.index}.embedding"), item.embedding, rtol=1e-5, atol=1e-5)
        assert sorted(saved.keys()) == [f"item.{i}.embedding" for i in range(3)]


async def test_an_unreadable_file_exits_1_naming_it(two_servers, tmp_path, capsys):
    args = client_cli.build_parser().parse_args([str(tmp_path / "missing.png"), "--url", two_servers[0].url])
    assert await client_cli.run(args) == 1
    assert "item 0: cannot read" in capsys.readouterr().err


def test_a_bad_url_exits_2(capsys):
    with pytest.raises(SystemExit) as exited:
        client_cli.main(["x.png", "--url", "http://encoder:50051"])
    assert exited.value.code == 2
    assert "unsupported encoder URL 'http://encoder:50051'" in capsys.readouterr().err
