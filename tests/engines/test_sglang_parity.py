"""SglangEncoder against SGLang's own encoder, on the parity image set (testkit/image_set.py): the float32
embedding SGLang's own `MMReceiverGrpc` assembles from our server equals what SGLang's own loading and
processor (its encoder's `EncoderPreprocessor`) and the checkpoint's tower give for the same bytes."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from testkit import REPO_ROOT
from testkit.image_set import image_set
from testkit.servers import running_server
from testkit.vllm_server import ENGINES_PYTHON, engines_env

pytestmark = pytest.mark.engine

IMAGES = image_set()


def engines_run(script: str, *args: str) -> None:
    run = subprocess.run(
        [str(ENGINES_PYTHON), str(REPO_ROOT / "testkit" / script), *args],
        env=engines_env(SGLANG_HOST_IP="127.0.0.1"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]


@pytest.fixture(scope="module")
def sglang_own(default_model_dir, tmp_path_factory):
    """SGLang's own preprocessing of every image (pixel values and grid), then the checkpoint's tower."""
    from transformers import AutoModelForImageTextToText

    if not ENGINES_PYTHON.exists():
        pytest.fail(f"{ENGINES_PYTHON} is missing: run ./scripts/setup_engines.sh (scripts/test.sh does)")
    out = tmp_path_factory.mktemp("sglang-pixels")
    engines_run("engine_pixels.py", str(default_model_dir), str(out), "sglang")
    pixels = load_file(str(out / "pixels.safetensors"))
    model = AutoModelForImageTextToText.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    embeddings = {}
    with torch.inference_mode():
        for name in IMAGES:
            grid = pixels[f"sglang/{name}/grid_thw"].reshape(1, 3)
            pixel_values = pixels[f"sglang/{name}/pixel_values"]
            features = model.get_image_features(pixel_values=pixel_values, image_grid_thw=grid)
            embeddings[name] = (features.pooler_output[0], grid)
    return embeddings


@pytest.fixture(scope="module")
async def sglang_received(default_model_dir, tmp_path_factory):
    """What SGLang's MMReceiverGrpc assembles from our float32 server, one request per image."""
    out = tmp_path_factory.mktemp("sglang-received")
    async with running_server(default_model_dir) as server:
        plan = {
            "model_dir": str(default_model_dir),
            "scenarios": [
                dict(
                    name=name,
                    kind="tokenizer",
                    urls=[server.url],
                    items=["data:image/png;base64," + base64.b64encode(data).decode()],
                )
                for name, data in IMAGES.items()
            ],
        }
        (out / "plan.json").write_text(json.dumps(plan))
        # Off the event loop: the server answers SGLang's calls meanwhile.
        await asyncio.to_thread(engines_run, "sglang_driver.py", str(out / "plan.json"), str(out))
    return json.loads((out / "results.json").read_text()), load_file(str(out / "tensors.safetensors"))


@pytest.mark.parametrize("name", list(IMAGES))
def test_sglang_receives_what_sglangs_own_encoder_computes(sglang_own, sglang_received, name):
    results, tensors = sglang_received
    assert results["scenarios"][name]["assembled"], results["scenarios"][name]
    embedding, grid = tensors[f"{name}/embedding"], tensors[f"{name}/img_grid_thw"]
    want, want_grid = sglang_own[name]
    assert torch.equal(grid.reshape(-1, 3), want_grid)
    assert embedding.dtype == torch.float32 and embedding.shape == want.shape
    print(f"\n{name}: largest difference {(embedding - want).abs().max().item():.1e}")
    torch.testing.assert_close(embedding, want, rtol=1e-5, atol=1e-5)
