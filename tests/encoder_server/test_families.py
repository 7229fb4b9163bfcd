"""Each served family against the model's own get_image_features, through real servers and the receiver."""

from __future__ import annotations

import json
import math
import shutil

import grpc
import pytest
import torch

from encoder_common.families import BY_MODEL_TYPE
from encoder_server.images import decode_image
from encoder_server.models import load_vision_encoder
from encoder_server.models.kernels import (
    PackedLinear,
    PatchwiseConv3d,
    pack_linear_layers,
    use_engine_kernels,
)
from encoder_server.profiles import PROFILES
from protos import encoder_pb2 as pb
from protos import encoder_pb2_grpc
from protos.wire import CHUNK_BYTES
from receiver import EncoderReceiver, ShardError
from testkit.checkpoints import model_types, write_checkpoint
from testkit.encoders import EncoderDouble
from testkit.images import image_bytes
from testkit.reference import image_rows, reference_features
from testkit.servers import running_server

# case -> (model type, builder options): every model type the transformers backend serves, and variants.
CASES = {model_type: (model_type, {}) for model_type in model_types()} | {
    "llava-two-layers-full": ("llava", {"vision_feature_layer": [-3, -1], "select_strategy": "full"}),
    "gemma3-pan-and-scan": ("gemma3", {"pan_and_scan": True}),
}

# (width, height): tiny, square, wide, tall, photo-shaped, and one whose Qwen3-VL payload (embedding
# plus 2 deepstack layers) spans several wire chunks; most are off every family's grid.
SIZES = [(1, 1), (64, 64), (320, 96), (96, 320), (500, 375), (800, 600)]


def family_of_case(case: str) -> str:
    return BY_MODEL_TYPE[CASES[case][0]].name


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {
        case: write_checkpoint(model_type, root / case, **options)
        for case, (model_type, options) in CASES.items()
    }


def reference_deepstack(features) -> torch.Tensor | None:
    """[layers, tokens, hidden] from get_image_features' per-layer, per-image deepstack lists."""
    layers = getattr(features, "deepstack_features", None)
    return torch.stack([per_image for (per_image,) in layers]) if layers else None


@pytest.mark.parametrize("case", list(CASES))
async def test_items_over_two_encoders_equal_get_image_features_fp32(case, checkpoints):
    model_dir = checkpoints[case]
    family = family_of_case(case)
    images = [image_bytes(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    expected = reference_features(model_dir, images)
    async with running_server(model_dir) as a, running_server(model_dir) as b:
        async with EncoderReceiver([a.url, b.url], seed=1) as rx:
            result = await rx.encode(case, [{"modality": "image", "data": d} for d in images])
            infos = await rx.model_info()
            # What the service produced is accepted back as precomputed items, grid_thw and all, checked
            # against ModelInfo (a request that also sends an item fetches it).
            fingerprint = (await rx.served_model()).weights_fingerprint
            back = [
                {"precomputed_embedding": i.embedding, "precomputed_deepstack": i.deepstack, "grid_thw": i.grid_thw, "weights_fingerprint": fingerprint}
                for i in result.items
            ]  # fmt: skip
            again = await rx.encode(f"{case}-back", [{"data": images[0]}, *back])
    assert [item.grid_thw for item in again.items[1:]] == [item.grid_thw for item in result.items]
    assert torch.equal(torch.cat([i.embedding for i in again.items[1:]]), result.embedding)
    assert {item.encoder_url for item in result.items} == {a.url, b.url}
    for item, features in zip(result.items, expected, strict=True):
        embedding = image_rows(features)
        assert item.embedding.dtype == torch.float32
        torch.testing.assert_close(item.embedding, embedding, rtol=1e-5, atol=1e-5)
        deepstack = reference_deepstack(features)
        if deepstack is None:
            assert item.deepstack is None
        else:
            assert item.deepstack.shape == (2, *embedding.shape)
            torch.testing.assert_close(item.deepstack, deepstack, rtol=1e-5, atol=1e-5)
    (width,) = {image_rows(features).shape[-1] for features in expected}
    deepstacks = [reference_deepstack(features) for features in expected]
    (layers,) = {0 if deepstack is None else len(deepstack) for deepstack in deepstacks}
    for info in infos.values():
        assert (info.family, info.hidden_size, info.num_deepstack_layers) == (family, width, layers)
        assert info.model_type == json.loads((model_dir / "config.json").read_text())["model_type"]
        assert info.dtype == pb.FLOAT32
        # The token count follows the grid, but where a family packs its tiles (AnyRes: merge 0).
        if info.spatial_merge_size:
            for item in result.items:
                grid_tokens = math.prod(item.grid_thw) // info.spatial_merge_size**2
                assert item.num_tokens == grid_tokens + info.extra_tokens_per_item
    if family == "llava":
        full = CASES[case][1].get("select_strategy") == "full"
        assert {item.grid_thw for item in result.items} == {(1, 4, 4)}
        assert {item.num_tokens for item in result.items} == {17 if full else 16}
    if family == "qwen3_vl":
        biggest = result.items[-1]
        assert 3 * biggest.embedding.numel() * biggest.embedding.element_size() > CHUNK_BYTES


async def test_precompute_files_of_a_llava_full_checkpoint_are_accepted_back(checkpoints, tmp_path):
    """LLaVA's "full" strategy gives 17 tokens for a (1, 4, 4) grid: the files carry that grid."""
    from precompute.backends import InProcessBackend
    from precompute.run import PrecomputeSettings, precompute
    from receiver.embeddings.precomputed_files import precomputed_item

    model_dir = checkpoints["llava-two-layers-full"]
    images = [image_bytes(64, 64, seed=i) for i in range(2)]
    for i, data in enumerate(images):
        (tmp_path / f"{i}.png").write_bytes(data)
    backend = InProcessBackend(str(model_dir), "cpu", torch.float32)
    settings = PrecomputeSettings(out=tmp_path / "out", progress=False)
    summary = await precompute(backend, sorted(tmp_path.glob("*.png")), settings)
    assert summary.encoded == 2 and not summary.failed
    items = [precomputed_item(tmp_path / "out", data) for data in images]
    assert [item["grid_thw"] for item in items] == [(1, 4, 4)] * 2
    async with running_server(model_dir) as server, EncoderReceiver([server.url]) as rx:
        result = await rx.encode("files", [{"data": images[0]}, *items])
    assert [item.num_tokens for item in result.items] == [17, 17, 17]
    assert all(item.precomputed for item in result.items[1:])
    torch.testing.assert_close(result.items[1].embedding, result.items[0].embedding, rtol=1e-5, atol=1e-5)


def _engine_kernels(model: torch.nn.Module) -> None:
    if hasattr(model.model, "visual"):  # the Qwen families
        use_engine_kernels(model.model.visual)


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_outputs_are_bit_identical_to_the_models_own_bf16_forward(case, checkpoints):
    """Built in the served dtype the way from_pretrained builds it, the tower runs the very same ops but for
    the Qwen towers' engine kernels (patch embedding as a matmul, oneDNN linears, as vLLM runs them): bit for
    bit the model's own forward with those kernels, and within one bf16 step of its stock forward."""
    images = [image_bytes(200, 150, seed=11)]
    (stock,) = reference_features(checkpoints[case], images, dtype=torch.bfloat16)
    (features,) = reference_features(
        checkpoints[case], images, dtype=torch.bfloat16, adapt_model=_engine_kernels
    )
    encoder = load_vision_encoder(checkpoints[case], "cpu", torch.bfloat16)
    (output,) = encoder.encode([encoder.preprocess(decode_image(images[0]), PROFILES["transformers"])])
    assert output.embedding.dtype == torch.bfloat16
    assert torch.equal(output.embedding, image_rows(features))
    stock_embedding = image_rows(stock).float()
    # bf16 keeps 8 significant bits: one step (ulp) is at most 2**-7 of the largest magnitude. Two roundings
    # of the same value by different kernels can be a whole step apart (seen on an AMD EPYC host).
    bf16_step = 2.0**-7 * stock_embedding.abs().max().item()
    torch.testing.assert_close(output.embedding.float(), stock_embedding, rtol=0, atol=bf16_step)
    deepstack = reference_deepstack(features)
    assert (output.deepstack is None) == (deepstack is None)
    if deepstack is not None:
        assert torch.equal(output.deepstack, deepstack)


def test_patchwise_conv3d_is_the_convolution_as_one_matmul():
    """nn.Conv3d's result (float32 rounding) on whole-kernel inputs; other inputs take the convolution."""
    torch.manual_seed(0)
    for bias in (False, True):
        conv = torch.nn.Conv3d(3, 16, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=bias)
        patches = torch.randn(37, 3, 2, 14, 14)
        expected = conv(patches)
        conv.__class__ = PatchwiseConv3d
        torch.testing.assert_close(conv(patches), expected, rtol=1e-5, atol=1e-5)
        wider = torch.randn(2, 3, 2, 28, 28)  # two kernels per side: not one patch per row
        assert conv(wider).shape == (2, 16, 1, 2, 2)


def test_packed_linear_layers_compute_what_they_computed():
    torch.manual_seed(0)
    layers = (torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 2048, bias=False))
    mlp = torch.nn.Sequential(*layers)
    x = torch.randn(108, 128)
    expected = mlp(x)
    assert pack_linear_layers(mlp) == 2
    assert all(type(layer) is PackedLinear for layer in (mlp[0], mlp[2]))
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)


async def test_qwen3_vl_stream_carries_the_deepstack_layers_after_the_embedding(checkpoints):
    """What a non-Python client sees: the header's layer count and the payload layout of encoder.proto."""
    model_dir = checkpoints["qwen3_vl"]
    data = image_bytes(800, 600, seed=3)
    (features,) = reference_features(model_dir, [data])
    async with running_server(model_dir) as server:
        async with grpc.aio.insecure_channel(server.url.removeprefix("grpc://")) as channel:
            stub = encoder_pb2_grpc.EncoderServiceStub(channel)
            request = pb.EncodeRequest(
                request_id="ds", items=[pb.ImageItem(index=7, modality=pb.IMAGE, data=data)]
            )
            messages = [m async for m in stub.Encode(request)]
    header = messages[0].header
    payload = b"".join(m.chunk for m in messages[1:])
    layers = torch.cat([features.pooler_output[0][None], reference_deepstack(features)])
    assert header.index == 7 and header.num_deepstack_layers == 2 and header.hidden_size == 256
    assert header.num_tokens == layers.shape[1] and header.payload_bytes == len(payload) == layers.numel() * 4
    assert len(messages) - 1 > 1 and max(len(m.chunk) for m in messages[1:]) <= CHUNK_BYTES
    received = torch.frombuffer(bytearray(payload), dtype=torch.float32).view(layers.shape)
    torch.testing.assert_close(received, layers, rtol=1e-5, atol=1e-5)


async def test_weights_fingerprint_tells_checkpoints_apart(checkpoints, tmp_path):
    same_weights_other_layer = write_checkpoint(
        "llava", tmp_path / "llava-last-layer", vision_feature_layer=-1
    )
    assert (same_weights_other_layer / "model.safetensors").read_bytes() == (
        checkpoints["llava"] / "model.safetensors"
    ).read_bytes()
    dirs = {
        "qwen3_vl": checkpoints["qwen3_vl"],
        "qwen3_vl-again": checkpoints["qwen3_vl"],
        "qwen3_vl-seed-1": write_checkpoint("qwen3_vl", tmp_path / "qwen3_vl-seed-1", seed=1),
        "llava": checkpoints["llava"],
        "llava-last-layer": same_weights_other_layer,
    }
    fingerprints = {}
    for name, model_dir in dirs.items():
        async with running_server(model_dir, warmup=False) as server:
            async with EncoderReceiver([server.url]) as rx:
                fingerprints[name] = (await rx.model_info())[server.url].weights_fingerprint
    assert all(len(f) == 64 for f in fingerprints.values())
    assert fingerprints["qwen3_vl"] == fingerprints["qwen3_vl-again"]
    assert fingerprints["qwen3_vl"] != fingerprints["qwen3_vl-seed-1"]
    assert fingerprints["llava"] != fingerprints["llava-last-layer"]
    assert len(set(fingerprints.values())) == 4


# preprocessor_config.json as the public checkpoints ship it (Qwen2-VL-7B-Instruct, Qwen3-VL-2B-Instruct,
# llava-1.5-7b-hf), with the token counts their model cards give for a 640x480 image.
_CLIP_MEAN, _CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
HUB_PROCESSORS = {
    "qwen2_vl": (391, (1, 34, 46), dict(
        image_processor_type="Qwen2VLImageProcessor", min_pixels=3136, max_pixels=12845056, patch_size=14,
        temporal_patch_size=2, merge_size=2, image_mean=_CLIP_MEAN, image_std=_CLIP_STD,
    )),
    "qwen3_vl": (300, (1, 30, 40), dict(
        image_processor_type="Qwen2VLImageProcessorFast", size={"longest_edge": 16777216, "shortest_edge": 65536},
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )),
    "llava-336": (576, (1, 24, 24), dict(
        image_processor_type="CLIPImageProcessor", crop_size={"height": 336, "width": 336}, do_center_crop=True,
        do_convert_rgb=True, do_normalize=True, do_rescale=True, do_resize=True, image_mean=_CLIP_MEAN,
        image_std=_CLIP_STD, resample=3, rescale_factor=1 / 255, size={"shortest_edge": 336},
    )),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HUB_PROCESSORS))
def test_public_checkpoints_processor_configs_give_their_token_counts(case, checkpoints, tmp_path):
    num_tokens, grid_thw, processor_config = HUB_PROCESSORS[case]
    if case == "llava-336":
        model_dir = write_checkpoint("llava", tmp_path / case, image_size=336)
    else:
        model_dir = shutil.copytree(checkpoints[case], tmp_path / case)
    (model_dir / "preprocessor_config.json").write_text(json.dumps(processor_config))
    encoder = load_vision_encoder(model_dir, "cpu", torch.float32)
    prepared = encoder.preprocess(decode_image(image_bytes(640, 480)))
    assert (prepared.num_tokens, prepared.grid_thw) == (num_tokens, grid_thw)
    (output,) = encoder.encode([prepared])
    assert output.embedding.shape == (num_tokens, encoder.spec.hidden_size)


@pytest.mark.parametrize("case", ["qwen3_vl", "llava"])
async def test_token_count_mismatch_fails_the_item_with_internal_and_sends_nothing_for_it(case, checkpoints):
    model_dir = checkpoints[case]
    encoder = EncoderDouble(load_vision_encoder(model_dir, "cpu", torch.float32), miscount_width=100)
    good, bad = image_bytes(64, 64, seed=1), image_bytes(100, 64, seed=2)
    produced = encoder.inner.preprocess(decode_image(bad)).num_tokens
    message = f"Encoder produced {produced} tokens, but preprocessing expected {produced + 1}"
    async with running_server(model_dir, encoder=encoder) as server:
        async with grpc.aio.insecure_channel(server.url.removeprefix("grpc://")) as channel:
            stub = encoder_pb2_grpc.EncoderServiceStub(channel)
            items = [
                pb.ImageItem(index=i, modality=pb.IMAGE, data=d) for i, d in enumerate([good, bad, good])
            ]
            call = stub.Encode(pb.EncodeRequest(request_id="miscount", items=items))
            messages = []
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for m in call:
                    messages.append(m)
        assert raised.value.code() == grpc.StatusCode.INTERNAL
        assert raised.value.details() == message
        headers = [m.header for m in messages if m.WhichOneof("kind") == "header"]
        assert [h.index for h in headers] == [0]  # item 0 arrived whole, then nothing for item 1
        assert (
            sum(len(m.chunk) for m in messages if m.WhichOneof("kind") == "chunk") == headers[0].payload_bytes
        )

        async with EncoderReceiver([server.url]) as rx:
            with pytest.raises(ShardError) as shard_error:
                await rx.encode("miscount", [{"data": good}, {"data": bad}])
            assert shard_error.value.code == grpc.StatusCode.INTERNAL
            assert shard_error.value.item_indices == [1] and message in str(shard_error.value)
            # The server keeps serving.
            assert (await rx.encode("after", [{"data": good}])).items[0].num_tokens > 0


# Runs under the engines' transformers: each case's full model on the pixels this venv's processor made.
_ENGINE_FEATURES = """
import json, sys
from pathlib import Path
import torch, transformers
from transformers import AutoModelForImageTextToText

gaps = {}
for case_dir in sorted(Path(sys.argv[1]).iterdir()):
    model = AutoModelForImageTextToText.from_pretrained(str(case_dir / "model")).eval()
    for name, (inputs, expected) in torch.load(case_dir / "inputs.pt").items():
        with torch.inference_mode():
            pooled = model.get_image_features(**inputs).pooler_output
        rows = pooled if isinstance(pooled, torch.Tensor) else torch.cat(list(pooled))
        rows = rows.reshape(-1, rows.shape[-1])
        gaps[f"{case_dir.name}/{name}"] = (rows - expected).abs().max().item() if rows.shape == expected.shape else None
print(json.dumps({"version": transformers.__version__, "gaps": gaps}))
"""


@pytest.mark.engine
def test_checkpoints_give_the_same_features_under_the_engines_transformers(checkpoints, tmp_path):
    """vLLM pins transformers below 5.20: every case's checkpoint, written by this venv's transformers,
    loads under the engines' one, and its get_image_features on the same pixels equals this venv's."""
    import subprocess

    import transformers
    from transformers import AutoImageProcessor

    from testkit.vllm_server import ENGINES_PYTHON, engines_env

    if not ENGINES_PYTHON.exists():
        pytest.fail(f"{ENGINES_PYTHON} is missing: run ./scripts/setup_engines.sh (scripts/test.sh does)")
    images = {"wide": image_bytes(1000, 200, seed=1), "photo": image_bytes(500, 375, seed=2)}
    for case, model_dir in checkpoints.items():
        (tmp_path / case).mkdir()
        (tmp_path / case / "model").symlink_to(model_dir)
        processor = AutoImageProcessor.from_pretrained(str(model_dir))
        inputs = {
            name: dict(processor(images=[decode_image(d)], return_tensors="pt")) for name, d in images.items()
        }
        expected = reference_features(model_dir, list(images.values()))
        torch.save(
            {name: (inputs[name], image_rows(features)) for name, features in zip(images, expected)},
            tmp_path / case / "inputs.pt",
        )
    done = subprocess.run(
        [str(ENGINES_PYTHON), "-c", _ENGINE_FEATURES, str(tmp_path)],
        env=engines_env(), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["version"] != transformers.__version__  # the engines' pin, not this venv's
    assert len(report["gaps"]) == 2 * len(checkpoints)
    assert all(gap is not None and gap <= 1e-5 for gap in report["gaps"].values()), report
