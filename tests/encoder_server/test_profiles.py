"""Preprocessing profiles without the engines: each loader's handling of orientation and transparency,
the profile in ModelInfo and in the cache keys, the SGLang service on its own profile, and the one
table of checked engine versions shown in docs/parity.md."""

from __future__ import annotations

import numpy as np
import pytest

from encoder_common.errors import InvalidItemError
from encoder_server.cache import cache_namespace
from encoder_server.images import decode_image
from encoder_server.profiles import PROFILES
from protos import encoder_pb2 as pb
from receiver import EncoderReceiver
from testkit import REPO_ROOT
from testkit.image_set import KIND_SIZE, image_set, refused_images
from testkit.servers import running_server


def decoded(name: str, loader: str) -> np.ndarray:
    return np.asarray(decode_image(image_set()[name], loader=loader, max_pixels=10**9))


def test_only_the_vllm_loader_applies_the_exif_orientation():
    width, height = KIND_SIZE
    assert decoded("jpeg-exif-rotated", "vllm").shape == (height, width, 3)
    for loader in ("sglang", "transformers"):
        assert decoded("jpeg-exif-rotated", loader).shape == (width, height, 3)


@pytest.mark.parametrize("name", ["png-rgba", "png-la", "webp-alpha", "png-palette-trns"])
def test_transparency_is_composited_on_white_except_by_sglang(name):
    """The alpha image's first quarter of rows is fully clear: white for vLLM and transformers."""
    for loader in ("vllm", "transformers"):
        clear_rows = decoded(name, loader)[: KIND_SIZE[1] // 4]
        if name != "png-palette-trns":
            assert (clear_rows == 255).all(), loader
    sglang, vllm = decoded(name, "sglang"), decoded(name, "vllm")
    assert not np.array_equal(sglang, vllm)


def test_an_rgb_transparency_key_is_left_alone_by_the_engines_and_no_key_reaches_the_processor():
    data = image_set()["png-rgb-trns"]
    for loader in ("vllm", "sglang"):
        image = decode_image(data, loader=loader)
        assert "transparency" not in image.info
        assert (np.asarray(image)[-1, 0] == (10, 20, 30)).all(), loader  # the keyed colour, kept
    assert (decoded("png-rgb-trns", "transformers")[-1, 0] == 255).all()


def test_every_loader_refuses_formats_outside_vllms_allowlist():
    """EPS would run Ghostscript under SGLang's and transformers' own loading where it is installed."""
    eps, _ = refused_images()["eps"]
    with pytest.raises(InvalidItemError, match="not an image file of a format vLLM opens"):
        decode_image(eps, loader="vllm")
    for loader in ("sglang", "transformers"):
        with pytest.raises(InvalidItemError, match="not an image file of a known format"):
            decode_image(eps, loader=loader)


def test_the_profile_limits_follow_their_engines():
    header_only, _ = refused_images()["over-pixel-limit"]
    for profile in PROFILES.values():
        with pytest.raises(InvalidItemError, match="over the limit"):
            profile.decode(header_only, max_pixels=None, max_aspect_ratio=200)
    assert PROFILES["vllm"].default_max_pixels == 178_956_970


def test_docs_show_the_table_of_checked_versions():
    text = (REPO_ROOT / "docs" / "parity.md").read_text()
    for profile in PROFILES.values():
        assert f"| `{profile.name}` | {', '.join(profile.checked_against)} |" in text


async def test_model_info_names_the_profile_and_profiles_never_share_an_embedding(default_model_dir):
    data = image_set()["jpeg-exif-rotated"]
    grids = {}
    for name in ("vllm", "transformers"):
        async with running_server(default_model_dir, preprocess_profile=name) as server:
            async with EncoderReceiver([server.url]) as receiver:
                (info,) = (await receiver.model_info()).values()
                result = await receiver.encode(name, [{"data": data}])
            assert isinstance(info, pb.ModelInfo) and info.preprocess_profile == name
            grids[name] = tuple(result.items[0].grid_thw)
            assert server.cache is not None and len(server.cache) == 1
    assert grids["vllm"] != grids["transformers"]  # upright for vLLM, as stored for transformers


async def test_the_sglang_service_keys_its_items_apart_from_native_encode(default_model_dir):
    async with running_server(default_model_dir) as server:
        sglang = server.sglang.pipeline
        assert sglang.profile.name == "sglang"
        assert sglang.namespace != cache_namespace(server.encoder.spec, PROFILES["vllm"])
