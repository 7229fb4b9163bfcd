"""`encoder-precompute` on real PNG/JPEG files: through a server and in-process, resumable, loaded back."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import sys
from pathlib import Path

import pytest
import torch

from precompute.command import main
from receiver import EncoderReceiver, InvalidItemError
from receiver.embeddings.precomputed_files import load_precomputed, precomputed_item
from testkit import REPO_ROOT
from testkit.images import image_bytes
from testkit.rpc_log import logged_server


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory) -> Path:
    """Three distinct images (PNG and JPEG, in a subfolder too), a duplicate, and a file that is no image."""
    root = tmp_path_factory.mktemp("images")
    (root / "sub").mkdir()
    (root / "a.png").write_bytes(image_bytes(56, 56, seed=1))
    (root / "sub" / "b.jpg").write_bytes(image_bytes(112, 56, seed=2, fmt="JPEG"))
    (root / "sub" / "c.JPEG").write_bytes(image_bytes(84, 140, seed=3, fmt="JPEG"))
    (root / "copy-of-a.png").write_bytes((root / "a.png").read_bytes())
    (root / "notes.txt").write_text("not an image, and not picked up from a folder")
    return root


def unique_images(image_dir: Path) -> list[bytes]:
    return [(image_dir / name).read_bytes() for name in ("a.png", "sub/b.jpg", "sub/c.JPEG")]


@pytest.fixture(scope="module")
async def server(default_model_dir):
    async with logged_server(default_model_dir) as server:
        yield server


async def run_command(*args: str) -> tuple[int, str, str]:
    """`python -m precompute` in a child process, as a user runs it."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "precompute",
        *args,
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    return process.returncode, stdout.decode(), stderr.decode()


async def test_precompute_through_a_server_is_resumable_and_loads_back(server, image_dir, tmp_path, capsys):
    out = tmp_path / "cache"
    code, stdout, stderr = await run_command("--encoder-url", server.url, "--out", str(out), str(image_dir))
    assert code == 0, stderr
    assert "3 encoded, 0 already present, 1 duplicates, 0 failed" in stdout
    assert "precompute: 100%" in stderr and "3/3" in stderr  # the progress bar
    images = unique_images(image_dir)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{sha(d)}.safetensors" for d in images)
    assert sorted(i for call in server.rpc_log.sent("Encode") for i in call) == [0, 1, 2]
    mtimes = {p: p.stat().st_mtime_ns for p in out.iterdir()}

    # Loaded back as precomputed items beside a new raw image: only the raw one is sent, and
    # every item equals what encoding it raw gives.
    server.rpc_log.calls.clear()
    new = image_bytes(56, 112, seed=9)
    items = [precomputed_item(out, d) for d in images] + [precomputed_item(out, new)]
    assert [("precomputed_embedding" in item) for item in items] == [True, True, True, False]
    async with EncoderReceiver([server.url]) as rx:
        mixed = await rx.encode("mixed", items)
        assert server.rpc_log.sent("Encode") == [[3]]
        raw = await rx.encode("raw", [{"data": d} for d in images + [new]])
    assert [item.precomputed for item in mixed.items] == [True, True, True, False]
    for got, want in zip(mixed.items, raw.items):
        assert got.grid_thw == want.grid_thw
        torch.testing.assert_close(got.embedding, want.embedding, rtol=1e-5, atol=1e-5)

    # A rerun skips everything; after deleting one output and adding an image it encodes those two.
    server.rpc_log.calls.clear()
    argv = ["--encoder-url", server.url, "--out", str(out), str(image_dir)]
    assert await asyncio.to_thread(main, argv) == 0
    assert "0 encoded, 3 already present, 1 duplicates, 0 failed" in capsys.readouterr().out
    assert server.rpc_log.sent("Encode") == []
    assert {p: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    (out / f"{sha(images[1])}.safetensors").unlink()
    extra = image_dir.parent / f"{image_dir.name}-extra"
    extra.mkdir()
    (extra / "new.webp").write_bytes(image_bytes(56, 112, seed=9, fmt="WEBP", mode="RGB"))
    assert await asyncio.to_thread(main, [*argv, str(extra)]) == 0
    assert "2 encoded, 2 already present, 1 duplicates, 0 failed" in capsys.readouterr().out
    assert sorted(len(call) for call in server.rpc_log.sent("Encode")) == [2]
    shutil.rmtree(extra)


def test_in_process_model_writes_the_same_files_and_refuses_to_mix_models(
    default_model_dir, image_dir, tmp_path, capsys
):
    out = tmp_path / "cache"
    argv = ["--model", str(default_model_dir), "--device", "cpu", "--out", str(out), "--no-progress"]
    assert main([*argv, "--dtype", "float32", str(image_dir / "a.png"), str(image_dir / "sub")]) == 0
    assert "3 encoded, 0 already present, 0 duplicates, 0 failed" in capsys.readouterr().out
    for data in unique_images(image_dir):
        item = load_precomputed(out / f"{sha(data)}.safetensors")
        assert item["precomputed_embedding"].dtype == torch.float32
        h, w = item["grid_thw"][1:]
        assert item["precomputed_embedding"].shape == (h * w // 4, 2048)
    # The same directory cannot take another model's outputs (here: another served dtype).
    assert main([*argv, "--dtype", "bfloat16", str(image_dir)]) == 2
    error = capsys.readouterr().err
    assert "made by qwen2_5_vl float32 hidden 2048" in error and "now encoding (qwen2_5_vl bfloat16" in error
    assert "use another output directory" in error


async def test_broken_files_are_reported_and_the_rest_is_written(server, image_dir, tmp_path, capsys):
    good, broken = tmp_path / "good.png", tmp_path / "broken.png"
    good.write_bytes(image_bytes(56, 56, seed=5))
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    listing = tmp_path / "list.txt"
    listing.write_text(f"{broken}\n{good}\n")
    out = tmp_path / "cache"
    code = await asyncio.to_thread(
        main, ["--encoder-url", server.url, "--out", str(out), "--no-progress", f"@{listing}"]
    )
    captured = capsys.readouterr()
    assert code == 1
    assert "1 encoded, 0 already present, 0 duplicates, 1 failed" in captured.out
    assert f"failed: {broken}: " in captured.err and "INVALID_ARGUMENT" in captured.err
    assert [p.name for p in out.iterdir()] == [f"{sha(good.read_bytes())}.safetensors"]
    with pytest.raises(InvalidItemError, match="not an encoder-precompute/1 file|cannot load"):
        load_precomputed(broken)
