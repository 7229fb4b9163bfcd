"""Checkpoint loading: only the vision tensors, any layout real checkpoints use, and clear start-up errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from encoder_server.images import decode_image
from encoder_server.models import SUPPORTED_MODEL_TYPES, CheckpointError, load_vision_encoder
from testkit import REPO_ROOT
from testkit.checkpoints import model_types, rename_prefixes, rewrite_tensors, tensor_names, write_checkpoint
from testkit.images import image_bytes
from testkit.launcher import launch_server

# Other layouts real checkpoints store, as renames of what transformers 5.x saves: the Qwen towers
# under either prefix, and the `vision_tower` / `multi_modal_projector` families as llava-hf and Google
# publish them (with the CLIP/SigLIP wrapper's `vision_model.` level) or under the in-memory `model.`.
_TOWER_LAYOUTS = [
    {"vision_tower.": "vision_tower.vision_model."},
    {
        "vision_tower.": "model.vision_tower.vision_model.",
        "multi_modal_projector.": "model.multi_modal_projector.",
    },
    {"vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector."},
]
# The same three layouts from a checkpoint written in the Hub's layout (testkit.checkpoints.REAL_PREFIXES).
_HUB_TOWER_LAYOUTS = [
    {"vision_tower.vision_model.": "vision_tower."},
    {"vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector."},
    {
        "vision_tower.vision_model.": "model.vision_tower.",
        "multi_modal_projector.": "model.multi_modal_projector.",
    },
]


def other_layouts(model_dir) -> list[dict[str, str]]:
    names = tensor_names(model_dir)
    if any(name.startswith("visual.") for name in names):
        return [{"visual.": "model.visual."}]
    if any(name.startswith("model.visual.") for name in names):
        return [{"model.visual.": "visual."}]
    if any(name.startswith("vision_tower.vision_model.") for name in names):
        return _HUB_TOWER_LAYOUTS
    return _TOWER_LAYOUTS


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("loading")
    return {model_type: write_checkpoint(model_type, root / model_type) for model_type in model_types()}


def copy_of(model_dir, tmp_path):
    return shutil.copytree(model_dir, tmp_path / model_dir.name)


def encode_one(encoder, data: bytes):
    (output,) = encoder.encode([encoder.preprocess(decode_image(data))])
    return output


@pytest.mark.parametrize("family", model_types())
def test_sharded_and_renamed_checkpoints_serve_the_same_weights(family, checkpoints, tmp_path):
    image = image_bytes(90, 60, seed=5)
    single = load_vision_encoder(checkpoints[family], "cpu", torch.float32)
    expected = encode_one(single, image)
    sharded = write_checkpoint(family, tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    vision_shards = {file for name, file in index.items() if "vis" in name or "projector" in name}
    assert len(vision_shards) > 1, "the vision tensors should span several shards"
    layouts = [sharded]
    for number, renames in enumerate(other_layouts(sharded)):
        renamed = shutil.copytree(sharded, tmp_path / f"layout-{number}")
        rename_prefixes(renamed, renames)
        names = tensor_names(renamed)
        assert all(any(name.startswith(new) for name in names) for new in renames.values())
        layouts.append(renamed)
    for model_dir in layouts:
        encoder = load_vision_encoder(model_dir, "cpu", torch.float32)
        assert encoder.spec.weights_fingerprint == single.spec.weights_fingerprint, model_dir.name
        output = encode_one(encoder, image)
        assert torch.equal(output.embedding, expected.embedding), model_dir.name
        assert (output.deepstack is None) == (expected.deepstack is None)
        if expected.deepstack is not None:
            assert torch.equal(output.deepstack, expected.deepstack)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_served_dtype_is_applied_to_weights_but_not_to_rotary_buffers(dtype, checkpoints):
    encoder = load_vision_encoder(checkpoints["qwen2_5_vl"], "cpu", dtype)
    assert encoder.spec.dtype == dtype
    assert {p.dtype for p in encoder.tower.parameters()} == {dtype}
    # transformers keeps rotary frequencies in fp32 whatever the model dtype; rounding them shifts the output.
    assert encoder.tower.rotary_pos_emb.inv_freq.dtype == torch.float32
    assert encode_one(encoder, image_bytes(56, 56)).embedding.dtype == dtype


def drop(name):
    return lambda tensors: {k: v for k, v in tensors.items() if k != name}


def reshape(name):
    return lambda tensors: {k: (v[:-1] if k == name else v) for k, v in tensors.items()}


def add(name, like):
    def edit(tensors):
        return {**tensors, name: tensors[like].clone()} if like in tensors else tensors

    return edit


QWEN_PREFIXES = "(looked for under model.visual., visual.)"
BAD_TENSORS = {
    "missing-qwen2": (
        "qwen2_vl",
        drop("visual.merger.mlp.2.weight"),
        f"missing vision tensors {QWEN_PREFIXES}: merger.mlp.2.weight",
    ),
    "missing-qwen3-deepstack": (
        "qwen3_vl",
        drop("model.visual.deepstack_merger_list.1.norm.bias"),
        f"missing vision tensors {QWEN_PREFIXES}: deepstack_merger_list.1.norm.bias",
    ),
    "missing-llava-projector": (
        "llava",
        drop("multi_modal_projector.linear_2.bias"),
        "vision_tower.vision_model.): multi_modal_projector.linear_2.bias",
    ),
    "shape-qwen2_5": (
        "qwen2_5_vl",
        reshape("visual.patch_embed.proj.weight"),
        "tensor patch_embed.proj.weight has shape (31, 3, 2, 14, 14), the config expects (32, 3, 2, 14, 14)",
    ),
    "shape-llava": (
        "llava",
        reshape("vision_tower.embeddings.position_embedding.weight"),
        "tensor vision_tower.embeddings.position_embedding.weight has shape (16, 32), the config expects (17, 32)",
    ),
    "unexpected": (
        "qwen2_vl",
        add("visual.blocks.7.attn.qkv.weight", like="visual.blocks.0.attn.qkv.weight"),
        "unexpected vision tensors: blocks.7.attn.qkv.weight",
    ),
    "twice": (
        "qwen2_5_vl",
        add("model.visual.merger.ln_q.weight", like="visual.merger.ln_q.weight"),
        "both load into merger.ln_q.weight",
    ),
}


@pytest.mark.parametrize("family, edit, message", BAD_TENSORS.values(), ids=BAD_TENSORS.keys())
def test_bad_vision_tensors_fail_at_startup_naming_the_tensor(family, edit, message, checkpoints, tmp_path):
    model_dir = copy_of(checkpoints[family], tmp_path)
    rewrite_tensors(model_dir, edit)
    with pytest.raises(CheckpointError) as raised:
        load_vision_encoder(model_dir, "cpu", torch.float32)
    assert message in str(raised.value)


def test_a_shard_named_by_the_index_but_absent_fails_naming_it(tmp_path):
    model_dir = write_checkpoint("qwen2_vl", tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted(model_dir.glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=f"names shards that are not in .*: {shards[-1].name}"):
        load_vision_encoder(model_dir, "cpu", torch.float32)


def test_processor_cut_for_another_patch_size_fails_at_startup(checkpoints, tmp_path):
    model_dir = copy_of(checkpoints["qwen3_vl"], tmp_path)
    config_path = model_dir / "preprocessor_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "patch_size": 14}))
    with pytest.raises(
        CheckpointError,
        match="preprocessor_config.json has patch_size 14, but the vision tower's patch_size is 16",
    ):
        load_vision_encoder(model_dir, "cpu", torch.float32)


def test_unsupported_model_type_fails_listing_the_supported_ones(checkpoints, tmp_path):
    model_dir = copy_of(checkpoints["llava"], tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "fuyu"}))
    supported = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
    assert sorted(SUPPORTED_MODEL_TYPES) == sorted(model_types()) and "qwen2_5_vl" in supported
    expected = f"unsupported model_type 'fuyu' in {model_dir / 'config.json'}; supported: {supported}"
    with pytest.raises(CheckpointError) as raised:
        load_vision_encoder(model_dir, "cpu", torch.float32)
    assert str(raised.value) == expected
    # The server process refuses to start with the same message, and exits.
    with pytest.raises(RuntimeError, match=f"supported: {supported}"):
        with launch_server(model_dir, "--device", "cpu", log_dir=tmp_path):
            pass


def test_directory_without_config_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_vision_encoder(tmp_path, "cpu", torch.float32)


# Runs in a fresh interpreter: loads a small checkpoint first (imports and lazy set-up), then
# resets the kernel's peak-RSS counter and loads the big one. Torch allocations and mmapped
# pages both count in RSS; tracemalloc would see neither.
_PEAK_RSS_PROBE = textwrap.dedent(
    """
    import json, re, sys
    from pathlib import Path
    import torch
    from safetensors import safe_open
    from encoder_server.models import load_vision_encoder

    def status(field):
        text = Path("/proc/self/status").read_text()
        return int(re.search(rf"{field}:\\s+(\\d+) kB", text).group(1)) * 1024

    def peak_growth(load):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        before = status("VmRSS")
        kept = load()
        return status("VmHWM") - before, kept

    def read_every_tensor():  # what a loader that does not filter by prefix would hold
        held = []
        for path in sorted(Path(sys.argv[2]).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                held += [f.get_tensor(name).clone() for name in f.keys()]
        return held

    load_vision_encoder(sys.argv[1], "cpu", torch.float32)
    encoder_growth, encoder = peak_growth(lambda: load_vision_encoder(sys.argv[2], "cpu", torch.float32))
    vision_bytes = sum(t.numel() * t.element_size() for t in encoder.tower.state_dict().values())
    del encoder
    everything_growth, held = peak_growth(read_every_tensor)
    print(json.dumps(dict(encoder=encoder_growth, vision=vision_bytes, everything=everything_growth,
                          total=sum(t.numel() * t.element_size() for t in held))))
    """
)


def test_peak_memory_while_loading_stays_near_the_vision_weights(checkpoints, tmp_path):
    # A 600k-token vocabulary makes the language model ~300 MB (embeddings and head, fp32),
    # in shards; the vision tower stays ~0.3 MB.
    big = write_checkpoint("qwen2_vl", tmp_path / "big-lm", vocab_size=600_000, max_shard_size="50MB")
    assert len(list(big.glob("*.safetensors"))) > 1
    probe = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS_PROBE, str(checkpoints["qwen2_vl"]), str(big)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    figures = json.loads(probe.stdout.strip().splitlines()[-1])
    lm_bytes = figures["total"] - figures["vision"]
    assert lm_bytes > 250e6
    # The probe sees reads: holding every tensor grows RSS by at least the checkpoint's size.
    assert figures["everything"] > 0.9 * figures["total"], figures
    assert figures["encoder"] < figures["vision"] + 16 * 2**20, figures
    assert figures["encoder"] < lm_bytes / 20, figures
