"""Pixel-value parity: the installed vLLM's and SGLang's own image loading and processors, run on the parity
image set (testkit/image_set.py), give exactly the pixel values of the encoder's `vllm` and `sglang`
profiles, and refuse what the profiles refuse. A new engine release that changes them fails here."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from encoder_common.errors import InvalidItemError
from encoder_server.images import DEFAULT_MAX_ASPECT_RATIO
from encoder_server.models import load_vision_encoder
from encoder_server.profiles import PROFILES
from testkit import REPO_ROOT
from testkit.image_set import image_set, refused_images
from testkit.vllm_server import ENGINES_PYTHON, engines_env

pytestmark = pytest.mark.engine

ENGINES = ("vllm", "sglang")
# float32 pixel values from the same uint8 image: equal, up to the last bit of the normalization.
PIXEL_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def engine_pixels(default_model_dir, tmp_path_factory):
    """What the installed engines' own code makes of every image (one .venv-engines process for both)."""
    if not ENGINES_PYTHON.exists():
        pytest.fail(f"{ENGINES_PYTHON} is missing: run ./scripts/setup_engines.sh (scripts/test.sh does)")
    out = tmp_path_factory.mktemp("engine-pixels")
    run = subprocess.run(
        [
            str(ENGINES_PYTHON),
            str(REPO_ROOT / "testkit" / "engine_pixels.py"),
            str(default_model_dir),
            str(out),
        ],
        env=engines_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return json.loads((out / "results.json").read_text()), load_file(str(out / "pixels.safetensors"))


@pytest.fixture(scope="module")
def encoder(default_model_dir):
    return load_vision_encoder(default_model_dir, "cpu", torch.float32)


def test_the_engines_checked_are_the_ones_installed(engine_pixels):
    """The profile table names the releases this test ran against: a new one must be checked and named."""
    versions = engine_pixels[0]["versions"]
    for engine in ENGINES:
        for package in PROFILES[engine].checked_against:
            name, version = package.split()
            assert versions[name].split("+")[0] == version, (engine, package, versions)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", list(image_set()))
def test_profile_pixel_values_equal_the_engines_own(engine_pixels, encoder, engine, name):
    results, tensors = engine_pixels
    assert name not in results["refused"][engine], results["refused"][engine][name]
    profile = PROFILES[engine]
    image = profile.decode(image_set()[name], max_pixels=None, max_aspect_ratio=DEFAULT_MAX_ASPECT_RATIO)
    prepared = encoder.preprocess(image, profile)
    want = tensors[f"{engine}/{name}/pixel_values"]
    assert list(prepared.grid_thw) == tensors[f"{engine}/{name}/grid_thw"].flatten().tolist()
    assert prepared.pixel_values.shape == want.shape
    difference = (prepared.pixel_values - want).abs().max().item()
    print(f"\n{engine} {name}: grid {list(prepared.grid_thw)}, largest pixel difference {difference:.1e}")
    assert difference <= PIXEL_TOLERANCE, f"{engine} {name}: pixel values differ by up to {difference}"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", list(refused_images()))
def test_what_the_engine_refuses_the_profile_refuses(engine_pixels, encoder, engine, name):
    results, _ = engine_pixels
    data, phrase = refused_images()[name]
    assert name in results["refused"][engine], f"{engine} accepted {name}"
    profile = PROFILES[engine]
    with pytest.raises(InvalidItemError) as refused:
        image = profile.decode(data, max_pixels=None, max_aspect_ratio=DEFAULT_MAX_ASPECT_RATIO)
        encoder.preprocess(image, profile)
    if engine == "vllm":  # SGLang names the failure in its own words, the profile in the encoder's
        assert phrase in str(refused.value)


def test_the_profiles_differ_where_the_engines_do(engine_pixels):
    """The set holds the cases that tell vLLM's and SGLang's loading apart (EXIF, transparency)."""
    _, tensors = engine_pixels
    for name in ("jpeg-exif-rotated", "png-rgba", "png-rgb-trns", "png-la", "webp-alpha"):
        vllm, sglang = (tensors[f"{engine}/{name}/pixel_values"] for engine in ENGINES)
        assert vllm.shape != sglang.shape or not torch.equal(vllm, sglang), name
