"""SGLang's own receiver code (sglang 0.5.23, gRPC mode) against our encoder servers.

One driver process (testkit/sglang_driver.py, run in .venv-engines) plays every scenario against
in-process servers of this test: what SGLang assembles must equal transformers' get_image_features
(float32) or our own stream (bf16), and failures must reach SGLang's receiver as its error shape.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import sys
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf import descriptor_pb2
from safetensors.torch import load_file

from encoder_common.sources import SourcePolicy
from encoder_server.batcher import BatchingConfig
from encoder_server.images import decode_image
from encoder_server.models import load_vision_encoder
from encoder_server.sglang.embedding_data import SGLANG_VERSION
from protos import encoder_pb2 as pb
from protos import encoder_pb2_grpc as pb_grpc
from protos import sglang_encoder_pb2 as sglang_pb
from receiver import EncoderReceiver
from testkit import REPO_ROOT, encoders
from testkit.encoders import EncoderDouble
from testkit.images import image_bytes
from testkit.reference import reference_features
from testkit.servers import running_server
from testkit.sglang_driver import LogLines

pytestmark = pytest.mark.engine

ENGINE_PYTHON = REPO_ROOT / ".venv-engines" / "bin" / "python"
SIZES = [(64, 48), (640, 480), (90, 120), (32, 32), (896, 672)]  # up to 768 tokens: multi-MiB frames
# Far below what SGLang would otherwise wait: its gRPC timeout (60 s) and receive timeout (180 s).
PROMPT_S = 20.0


def sglang_items(images: list[bytes], image_dir: Path) -> list[str]:
    """The images as SGLang users give them, in turn: a data: URI, raw base64, an absolute path."""
    items = []
    for i, data in enumerate(images):
        if i % 3 == 0:
            items.append("data:image/png;base64," + base64.b64encode(data).decode())
        elif i % 3 == 1:
            items.append(base64.b64encode(data).decode())
        else:
            path = image_dir / f"image-{i}.png"
            path.write_bytes(data)
            items.append(str(path))
    return items


def expected_grids(model_dir: Path, images: list[bytes]) -> torch.Tensor:
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(str(model_dir))
    return torch.cat([processor(images=[decode_image(d)], return_tensors="pt")["image_grid_thw"] for d in images])


@contextlib.asynccontextmanager
async def overloaded(server, gated: EncoderDouble):
    """Holds the server's forward and fills its one-item queue with native Encode calls."""
    gated.hold()
    channel = grpc.aio.insecure_channel(server.url.removeprefix("grpc://"))
    stub = pb_grpc.EncoderServiceStub(channel)

    async def native_call(seed: int) -> None:
        item = pb.ImageItem(index=0, modality=pb.IMAGE, data=image_bytes(40, 40, seed=seed))
        async for _ in stub.Encode(pb.EncodeRequest(request_id=f"filler-{seed}", items=[item])):
            pass

    fillers = [asyncio.create_task(native_call(100))]
    while not gated.in_forward.is_set():
        await asyncio.sleep(0.01)
    fillers.append(asyncio.create_task(native_call(101)))
    while server._batcher.queue_depth < 1:
        await asyncio.sleep(0.01)
    try:
        yield
    finally:
        gated.release()
        await asyncio.gather(*fillers, return_exceptions=True)
        await channel.close()


@pytest.fixture(scope="module")
async def sglang_run(default_model_dir, tmp_path_factory):
    if not ENGINE_PYTHON.exists():
        pytest.skip(".venv-engines is missing: run ./scripts/setup_engines.sh (scripts/test.sh does)")
    tmp = tmp_path_factory.mktemp("sglang")
    images = [image_bytes(w, h, seed=i, fmt="JPEG" if i % 3 == 1 else "PNG") for i, (w, h) in enumerate(SIZES)]
    items = sglang_items(images, tmp)
    files = SourcePolicy(file_roots=(tmp,))
    log_lines = LogLines(logging.INFO)
    metrics_log = logging.getLogger("encoder_server.metrics")
    metrics_log.addHandler(log_lines)
    log_level = metrics_log.level
    metrics_log.setLevel(logging.INFO)
    # The gates hold forwards for the whole driver run, which includes SGLang's slow import.
    gate_timeout, encoders.GATE_TIMEOUT_S = encoders.GATE_TIMEOUT_S, 600.0
    gated_full = EncoderDouble(load_vision_encoder(default_model_dir, "cpu", torch.float32))
    gated_slow = EncoderDouble(load_vision_encoder(default_model_dir, "cpu", torch.float32))
    async with contextlib.AsyncExitStack() as stack:
        start = lambda **kw: stack.enter_async_context(running_server(default_model_dir, sources=files, **kw))  # noqa: E731
        a32, b32 = await start(), await start()
        # One image per forward: in bf16 an image's rows can differ by a rounding step with the other
        # images of its batch, and SGLang's split and the receiver's are random, so only unbatched
        # forwards compare bit for bit.
        one_by_one = BatchingConfig(max_batch_images=1)
        a16 = await start(dtype=torch.bfloat16, batching=one_by_one)
        b16 = await start(dtype=torch.bfloat16, batching=one_by_one)
        full = await start(encoder=gated_full, cache_bytes=0, batching=BatchingConfig(max_queue_items=1))
        slow = await start(encoder=gated_slow, cache_bytes=0)
        await stack.enter_async_context(overloaded(full, gated_full))
        gated_slow.hold()
        stack.callback(gated_slow.release)

        def tokenizer(name, urls, count, **extra):
            return dict(name=name, kind="tokenizer", urls=[s.url for s in urls], items=items[:count], **extra)

        def error(name, server, item, **extra):
            return dict(name=name, kind="tokenizer_error", urls=[server.url], items=[item], **extra)

        garbage = "data:image/png;base64," + base64.b64encode(b"this is no image").decode()
        plan = {
            "model_dir": str(default_model_dir),
            "scenarios": [
                tokenizer("f32_1", [a32], 1),
                tokenizer("f32_2_split", [a32, b32], 2),
                tokenizer("f32_5_split", [a32, b32], 5),
                tokenizer("f32_2", [a32], 2),
                tokenizer("f32_5", [a32], 5),
                tokenizer("bf16_1", [a16], 1),
                tokenizer("bf16_2_split", [a16, b16], 2),
                tokenizer("bf16_5_split", [a16, b16], 5),
                dict(name="scheduler", kind="scheduler", urls=[a32.url], items=items[:2], receive_count=2),
                error("bad_image", a32, garbage),
                dict(name="bad_image_e2e", kind="tokenizer", urls=[a32.url], items=[items[0], garbage]),
                error("video_data_uri", a32, "$MP4_DATA_URI"),
                error("video_base64", a32, "$MP4_BASE64"),
                dict(name="video_data_field", kind="tokenizer", urls=[a32.url], items=["$MP4_DATA_URI"], field="video_data"),
                error("overloaded", full, items[0]),
                error("deadline", slow, items[0], grpc_timeout_s=2),
            ],
        }
        plan_path = tmp / "plan.json"
        plan_path.write_text(json.dumps(plan))
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "SGLANG_HOST_IP": "127.0.0.1"}
        process = await asyncio.create_subprocess_exec(
            str(ENGINE_PYTHON), str(REPO_ROOT / "testkit" / "sglang_driver.py"), str(plan_path), str(tmp),
            env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await asyncio.wait_for(process.communicate(), timeout=600)
        if process.returncode != 0:
            sys.stderr.write(output.decode(errors="replace")[-8000:])
        assert process.returncode == 0, "the SGLang driver failed (its output is above)"
        results = json.loads((tmp / "results.json").read_text())
        yield dict(
            results=results,
            tensors=load_file(str(tmp / "tensors.safetensors")),
            images=images,
            items=items,
            servers=dict(a32=a32, b32=b32, a16=a16, b16=b16),
            log=log_lines.lines,
        )
    metrics_log.removeHandler(log_lines)
    metrics_log.setLevel(log_level)
    encoders.GATE_TIMEOUT_S = gate_timeout


def assembled(run, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    outcome = run["results"]["scenarios"][name]
    assert outcome["assembled"], f"{name}: SGLang assembled nothing: {outcome}"
    return run["tensors"][f"{name}/embedding"], run["tensors"][f"{name}/img_grid_thw"]


@pytest.mark.parametrize("name,count", [("f32_1", 1), ("f32_2", 2), ("f32_5", 5), ("f32_2_split", 2), ("f32_5_split", 5)])
def test_float32_embeddings_sglang_assembles_equal_get_image_features(sglang_run, default_model_dir, name, count):
    embedding, grid = assembled(sglang_run, name)
    images = sglang_run["images"][:count]
    reference = torch.cat([features.pooler_output[0] for features in reference_features(default_model_dir, images)])
    assert embedding.dtype == torch.float32 and embedding.shape == reference.shape
    torch.testing.assert_close(embedding, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(grid, expected_grids(default_model_dir, images))


@pytest.mark.parametrize("name,count", [("bf16_1", 1), ("bf16_2_split", 2), ("bf16_5_split", 5)])
async def test_bf16_embeddings_sglang_assembles_are_our_own_stream_bit_for_bit(sglang_run, name, count):
    embedding, grid = assembled(sglang_run, name)
    servers = sglang_run["servers"]
    async with EncoderReceiver([servers["a16"].url, servers["b16"].url]) as rx:
        ours = await rx.encode("bf16-stream", [{"modality": "image", "data": d} for d in sglang_run["images"][:count]])
    assert embedding.dtype == torch.bfloat16
    assert torch.equal(embedding, ours.embedding)
    assert torch.equal(grid, torch.tensor([list(item.grid_thw) for item in ours.items]))


def test_zmq_to_scheduler_every_rank_gets_the_embedding(sglang_run, default_model_dir):
    ranks = sglang_run["results"]["scenarios"]["scheduler"]["ranks"]
    assert [rank["status"] for rank in ranks] == ["SUCCESS", "SUCCESS"]
    reference = torch.cat([f.pooler_output[0] for f in reference_features(default_model_dir, sglang_run["images"][:2])])
    for rank in range(2):
        embedding = sglang_run["tensors"][f"scheduler/rank{rank}/embedding"]
        torch.testing.assert_close(embedding, reference, rtol=1e-5, atol=1e-5)


def test_sglang_0_5_23_grpc_dispatch_of_zmq_to_scheduler_cannot_run(sglang_run):
    """SGLang's own zmq_to_scheduler dispatch calls MMReceiverGrpc.encode(time_stats_json=...), which
    that method does not take (a TypeError): that mode's server side is tested above with SGLang's
    receiving code instead. When this fails, SGLang fixed it: drive the full dispatch."""
    assert sglang_run["results"]["checks"]["grpc_encode_takes_time_stats_json"] is False


def received_error(outcome: dict) -> str:
    lines = [line for line in outcome["log"] if line.startswith("Encoder error for req_id=")]
    assert len(lines) == 1, f"SGLang's receiver read no error from the encoder: {outcome}"
    return lines[0]


@pytest.mark.parametrize(
    "name,status,message,code",
    [
        ("bad_image", "INVALID_ARGUMENT", "item 0: bytes are not an image file of a known format", 400),
        ("video_data_uri", "INVALID_ARGUMENT", "gRPC encode only supports IMAGE modality, got: ['video']", 400),
        ("video_base64", "INVALID_ARGUMENT", "gRPC encode only supports IMAGE modality, got: ['video']", 400),
        ("overloaded", "RESOURCE_EXHAUSTED", "encoder queue is full", 503),
        ("deadline", "DEADLINE_EXCEEDED", "was cancelled or ran out of time", 504),
    ],
)
def test_failures_reach_sglangs_receiver_as_its_error_shape_promptly(sglang_run, name, status, message, code):
    outcome = sglang_run["results"]["scenarios"][name]
    assert outcome["status"] == status
    if status != "DEADLINE_EXCEEDED":  # the client's own deadline: no details from the server
        assert message in outcome["details"]
    line = received_error(outcome)
    assert message in line and line.endswith(f"error_code={code}")
    assert outcome["assembled"] is False
    assert outcome["seconds"] < PROMPT_S


def test_a_failed_part_fails_the_whole_sglang_request_promptly(sglang_run):
    outcome = sglang_run["results"]["scenarios"]["bad_image_e2e"]
    assert outcome["assembled"] is False and outcome["seconds"] < PROMPT_S


def test_sglang_itself_refuses_video_items_over_grpc(sglang_run):
    """SGLang's gRPC receiver never sends a video_data item: it refuses it before any call."""
    outcome = sglang_run["results"]["scenarios"]["video_data_field"]
    assert outcome["assembled"] is False and outcome["seconds"] < PROMPT_S


def test_our_pickle_rebuilds_sglangs_own_embedding_data(sglang_run):
    checks = sglang_run["results"]["checks"]
    assert sglang_run["results"]["sglang_version"] == checks["pinned_version"] == SGLANG_VERSION
    for name, compared in checks["pickles"].items():
        assert compared["is_sglang_class"], name
        assert compared["ours"] == compared["theirs"], name


def _shape(file: descriptor_pb2.FileDescriptorProto) -> tuple:
    messages = {
        m.name: sorted((f.name, f.number, f.type, f.label, f.type_name) for f in m.field) for m in file.message_type
    }
    services = {
        s.name: sorted((r.name, r.input_type, r.output_type, r.client_streaming, r.server_streaming) for r in s.method)
        for s in file.service
    }
    return file.package, messages, services


def test_our_proto_matches_the_published_sglang_encoder_proto(sglang_run):
    published = descriptor_pb2.FileDescriptorProto.FromString(
        base64.b64decode(sglang_run["results"]["checks"]["smg_descriptor"])
    )
    ours = descriptor_pb2.FileDescriptorProto.FromString(sglang_pb.DESCRIPTOR.serialized_pb)
    assert _shape(ours) == _shape(published)


def test_metrics_cache_and_log_lines_cover_sglang_calls(sglang_run):
    sample = sglang_run["servers"]["a32"].metrics.registry.get_sample_value
    # a32 served one part of each successful fp32 request (f32_1, f32_2, f32_5, both splits) and
    # the scheduler one; b32 the other part of each split. The same images recur, so the
    # embedding cache served some.
    assert sample("encoder_requests_total", {"outcome": "ok", "code": "OK"}) == 6
    assert sample("encoder_requests_total", {"outcome": "invalid", "code": "INVALID_ARGUMENT"}) == 4
    assert sample("encoder_cache_hits_total") > 0
    b32 = sglang_run["servers"]["b32"].metrics.registry.get_sample_value
    assert b32("encoder_requests_total", {"outcome": "ok", "code": "OK"}) == 2
    assert any(line.startswith("request scheduler-req: OK, 2/2 items") for line in sglang_run["log"])
    assert any(line.startswith("request bad_image-req: INVALID_ARGUMENT, 0/1 items") for line in sglang_run["log"])
