"""`encoder-server --backend vllm`: a real server process from the engines' venv, over real gRPC, returns for
image bytes what vLLM's own in-process path computes from the same bytes (its loader, its processor, its
model's `embed_multimodal`), with the token counts and grids the receiver reassembles items by; it holds no
language-model weights; and a missing or unsupported vLLM is a one-line start-up error.

The transformers backend stays the default, needs no vLLM, and reports itself in GetModelInfo; the backend
is part of every content key (tests/encoder_server/test_cache.py).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from encoder_common.vllm_releases import (
    TOWER_BACKEND_VLLM,
    TOWER_BACKEND_VLLM_BELOW,
    TOWER_BACKEND_VLLM_FROM,
    in_supported_range,
)
from receiver import EncoderReceiver
from testkit import REPO_ROOT, load_script
from testkit.checkpoints import write_checkpoint
from testkit.engine_files import write_engine_files
from testkit.image_set import image_set
from testkit.launcher import server_argv
from testkit.servers import running_server
from testkit.vllm_server import ENGINES_PYTHON, engines_env, start_vllm_encoder

# Off the 28 px grid, thin, EXIF-rotated, transparent: what users send, through vLLM's loader and processor.
IMAGES = (
    "size-333x250",
    "size-1023x767",
    "size-2000x57-wide",
    "jpeg-exif-rotated",
    "png-rgba",
    "png-palette-trns",
)
VOCAB = 320  # the 256 byte tokens beside the special tokens at 250-255
BIG_VOCAB = 600_000  # a ~300 MB language model (embeddings and head, fp32) beside the same ~0.2 MB tower
ENGINE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "processor_config.json")


def _launch(model_dir: Path, log_dir: Path):
    """`encoder-server --backend vllm`, float32; `ready_rss` is its resident memory as it became ready."""
    server = start_vllm_encoder(model_dir, log_dir / f"{model_dir.name}.log")
    server.ready_rss = _rss_bytes(server.process.pid)
    return server


def _rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


# ---------------------------------------------------------------- without vLLM (this venv)


def test_without_vllm_the_vllm_backend_is_a_one_line_start_up_error(default_model_dir):
    run = subprocess.run(
        [*server_argv(default_model_dir, "--backend", "vllm")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode != 0
    assert "Traceback" not in run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith(
        f"encoder-server: --backend vllm needs vLLM installed beside the server ({TOWER_BACKEND_VLLM}"
    )
    assert "No module named 'vllm'" in line


async def test_the_default_backend_is_transformers_and_reports_itself(default_model_dir):
    async with running_server(default_model_dir) as server, EncoderReceiver([server.url]) as receiver:
        info = await receiver.served_model()
    assert (info.backend, info.backend_version) == ("transformers", version("transformers"))


# ---------------------------------------------------------------- with vLLM (the engines' venv)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    return write_engine_files(
        write_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl"), vocab_size=VOCAB)
    )


@pytest.fixture(scope="module")
def vllm_server(qwen_dir, tmp_path_factory):
    """One `--backend vllm` server for the module's tests."""
    server = _launch(qwen_dir, tmp_path_factory.mktemp("vllm-backend-logs"))
    try:
        yield server
    finally:
        server.stop(grace_s=10)


@pytest.fixture(scope="module")
def vllm_reference(qwen_dir, tmp_path_factory) -> dict[str, torch.Tensor]:
    """Each image's embedding as vLLM's own in-process path computes it from the bytes (a full `LLM`)."""
    bench = load_script("bench_encode_stage")  # its vLLM worker: vLLM's own path from bytes to embedding
    tmp = tmp_path_factory.mktemp("vllm-reference")
    worker = bench.VllmWorker(str(ENGINES_PYTHON), qwen_dir, "float32", threads=1)
    embeddings = {}
    try:
        for name in IMAGES:
            (tmp / name).write_bytes(image_set()[name])
            worker.run(tmp / name, embedding_out=tmp / f"{name}.pt")
            embeddings[name] = torch.cat(torch.load(tmp / f"{name}.pt"))  # the worker saves one tensor per output
    finally:
        worker.close()
    return embeddings


@pytest.mark.engine
async def test_embeddings_over_grpc_are_vllms_own_for_the_same_bytes(vllm_server, vllm_reference):
    images = image_set()
    async with EncoderReceiver([vllm_server.url]) as receiver:
        info = await receiver.served_model()
        together = await receiver.encode("together", [{"data": images[name]} for name in IMAGES])
        again = await receiver.encode("again", [{"data": images[IMAGES[0]]}])
    assert (info.backend, info.family, info.model_type) == ("vllm", "qwen2_5_vl", "qwen2_5_vl")
    assert in_supported_range(info.backend_version, TOWER_BACKEND_VLLM_FROM, TOWER_BACKEND_VLLM_BELOW)
    assert (info.spatial_merge_size, info.hidden_size) == (2, 64)
    for name, item in zip(IMAGES, together.items, strict=True):
        expected = vllm_reference[name]
        t, h, w = item.grid_thw
        assert item.num_tokens == expected.shape[0] == t * h * w // 4, name
        # The batcher may have run the items in one forward, as vLLM's encoder step batches them: the
        # same kernels on more rows, equal to float rounding.
        assert torch.allclose(item.embedding, expected, rtol=0, atol=1e-5), name
    # Alone in its forward, as in vLLM's own path: bit for bit; and a repeat is the cache's.
    (item,) = again.items
    assert item.cache_hit
    assert torch.equal(item.embedding, vllm_reference[IMAGES[0]])


@pytest.mark.engine
async def test_a_much_larger_language_model_does_not_grow_the_servers_memory(qwen_dir, vllm_server, tmp_path):
    """The same tower (same seed) beside a ~300 MB language model, in shards with their index (vLLM's
    encoder-only load then skips the language model's shards): the server's RSS once serving is that of the
    small checkpoint's server, and it serves the same tower."""
    big = write_checkpoint("qwen2_5_vl", tmp_path / "big-lm", vocab_size=BIG_VOCAB, max_shard_size="50MB")
    for name in ENGINE_FILES:  # the same tokenizer: ids beyond it are never asked for
        shutil.copy(qwen_dir / name, big / name)
    lm_bytes = (
        sum(f.stat().st_size for f in big.glob("*.safetensors"))
        - (qwen_dir / "model.safetensors").stat().st_size
    )
    assert lm_bytes > 250e6 and (big / "model.safetensors.index.json").exists()
    server = _launch(big, tmp_path)
    try:
        big_rss = _rss_bytes(server.process.pid)
        async with EncoderReceiver([vllm_server.url, server.url]) as receiver:
            infos = await receiver.model_info()
    finally:
        server.stop(grace_s=10)
    assert infos[vllm_server.url].weights_fingerprint == infos[server.url].weights_fingerprint
    growth = big_rss - vllm_server.ready_rss
    print(f"\nRSS once serving: {vllm_server.ready_rss / 2**20:.0f} MiB (small LM), {big_rss / 2**20:.0f} MiB "
          f"(LM {lm_bytes / 2**20:.0f} MiB larger)")  # fmt: skip
    # Loading the language model would add all of its 293 MiB; two servers of the same checkpoint have
    # become ready up to 85 MiB apart (an AMD EPYC host), so the line is drawn at half of it.
    assert growth < lm_bytes / 2, (growth, lm_bytes)


@pytest.mark.engine
def test_the_encode_stage_benchmark_times_the_vllm_backend_against_vllms_own_path(qwen_dir, tmp_path):
    out = tmp_path / "encode_stage.json"
    argv = [str(ENGINES_PYTHON), str(REPO_ROOT / "scripts" / "bench_encode_stage.py"), "--backend", "vllm"]
    argv += ["--model", str(qwen_dir), "--rounds", "1", "--images", "333x250", "--json", str(out)]
    run = subprocess.run(
        argv, cwd=REPO_ROOT, env=engines_env(), capture_output=True, text=True, timeout=900, check=False
    )
    assert run.returncode == 0, run.stderr[-5000:]
    report = json.loads(out.read_text())
    (result,) = report["images"].values()
    assert report["backend"] == "vllm" and report["threads"] == 1
    assert result["tokens"] == 12 * 9  # 333x250 resizes to 336x252: 12x9 merged tokens of 28 px
    assert result["largest_embedding_difference"] == 0  # the same code on the same bytes
    assert result["ratio"] > 0 and "vllm backend" in run.stdout


@pytest.mark.engine
def test_a_vllm_release_outside_the_range_is_a_one_line_start_up_error(qwen_dir, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import vllm\nvllm.__version__ = '0.34.0'\n")
    env = engines_env()
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    run = subprocess.run(
        [str(ENGINES_PYTHON), *server_argv(qwen_dir, "--backend", "vllm")[1:]],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode != 0
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        f"encoder-server: --backend vllm runs on vLLM {TOWER_BACKEND_VLLM}, and the installed vLLM is 0.34.0; "
        "install a release in that range, or serve with --backend transformers"
    )
