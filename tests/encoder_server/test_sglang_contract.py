"""SGLang's encoder contract on our server, without SGLang: the service beside encoder.v1, its
refusals and statuses, item strings under the source policy, and where parts are pushed.

tests/engines/test_sglang.py drives the same server with SGLang's own receiver code (engine tests).
"""

from __future__ import annotations

import asyncio
import base64
import io
import math
import pickle
import pickletools
import re
import socket
import time

import grpc
import pytest
import torch
import zmq
import zmq.asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from encoder_common.errors import (
    DeadlineExceededError,
    InvalidItemError,
    OverloadedError,
    UnsupportedModalityError,
)
from encoder_common.sources import SourcePolicy, SourceReader
from encoder_server.models import load_vision_encoder
from encoder_server.sglang.config import SglangConfig
from encoder_server.sglang.embedding_data import LAYOUTS, layout_for
from encoder_server.sglang.items import read_item, sniff_non_image
from encoder_server.sglang.receive_urls import ReceiveUrls
from encoder_server.sglang.servicer import SEND_UNIMPLEMENTED, SERVICE_NAME
from protos import encoder_pb2 as pb
from protos import encoder_pb2_grpc as pb_grpc
from protos import sglang_encoder_pb2 as sglang_pb
from protos import sglang_encoder_pb2_grpc as sglang_grpc
from testkit.checkpoints import write_checkpoint
from testkit.encoders import EncoderDouble
from testkit.images import image_bytes
from testkit.reference import image_rows, reference_features
from testkit.servers import running_server


@pytest.fixture(scope="module")
async def server(default_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-files")
    async with running_server(default_model_dir, sources=SourcePolicy(file_roots=(root,))) as server:
        server.file_root = root  # type: ignore[attr-defined]
        yield server


@pytest.fixture
async def stub(server):
    async with grpc.aio.insecure_channel(server.url.removeprefix("grpc://")) as channel:
        yield sglang_grpc.SglangEncoderStub(channel)


@pytest.fixture
async def pull():
    """A receiver's PULL socket on loopback and its port."""
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.PULL)
    yield socket, socket.bind_to_random_port("tcp://127.0.0.1")
    socket.close(linger=0)
    context.term()


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


async def services(address: str) -> set[str]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        async for response in responses:
            return {service.name for service in response.list_services_response.service}
    return set()


async def test_both_services_on_one_port_and_a_flag_turns_sglangs_off(server, default_model_dir):
    address = server.url.removeprefix("grpc://")
    assert {"encoder.v1.EncoderService", SERVICE_NAME} <= await services(address)
    async with grpc.aio.insecure_channel(address) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    async with running_server(default_model_dir, sglang=SglangConfig(serve=False)) as plain:
        plain_address = plain.url.removeprefix("grpc://")
        assert SERVICE_NAME not in await services(plain_address)
        async with grpc.aio.insecure_channel(plain_address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await sglang_grpc.SglangEncoderStub(channel).Send(sglang_pb.SendRequest())
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_send_says_which_backend_works(stub):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Send(sglang_pb.SendRequest(req_id="r"))
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert refused.value.details() == SEND_UNIMPLEMENTED and "zmq_to_tokenizer" in SEND_UNIMPLEMENTED


async def test_a_part_is_pushed_as_two_frames_and_the_response_describes_it(stub, pull, server):
    socket, port = pull
    items = [data_uri(image_bytes(64, 48, seed=1)), base64.b64encode(image_bytes(40, 40, seed=2, fmt="JPEG")).decode()]
    path = server.file_root / "third.png"
    path.write_bytes(image_bytes(56, 56, seed=3))
    items.append(str(path))
    request = sglang_pb.EncodeRequest(
        mm_items=items, req_id="r-1", num_parts=2, part_idx=1, prefill_host="127.0.0.1", embedding_port=[port]
    )
    response = await stub.Encode(request)
    meta, tensor = await asyncio.wait_for(socket.recv_multipart(), 10)
    assert response.embedding_dim == 2048 and response.embedding_len > 0
    assert len(tensor) == response.embedding_size == response.embedding_len * 2048 * 4  # float32 rows
    assert b"sglang.srt.disaggregation.encoder.receiver\nEmbeddingData" in meta and b"r-1" in meta


def pickle_globals(meta: bytes) -> set[tuple[str, str]]:
    """The (module, name) of every class an EmbeddingData pickle names."""
    return {tuple(arg.split(" ")) for op, arg, _ in pickletools.genops(meta) if op.name == "GLOBAL"}


@pytest.mark.parametrize("version", [None, "0.5.21", "0.5.15.post1"])
async def test_the_pushed_pickles_follow_the_configured_sglang_release(default_model_dir, pull, version):
    """Embeddings and errors alike; tests/encoder_server/test_sglang_version.py runs each release's unpickler on them."""
    socket, port = pull
    layout = LAYOUTS[0] if version is None else layout_for(version)
    sglang = SglangConfig() if version is None else SglangConfig(version=version)
    encoder = EncoderDouble(tokens=3, hidden_size=8, dtype=torch.float32)
    async with running_server(default_model_dir, encoder=encoder, sglang=sglang) as server:
        async with grpc.aio.insecure_channel(server.url.removeprefix("grpc://")) as channel:
            stub = sglang_grpc.SglangEncoderStub(channel)
            fields = {"num_parts": 1, "part_idx": 0, "prefill_host": "127.0.0.1", "embedding_port": [port]}
            good, bad = [data_uri(image_bytes(20, 20))], ["data:image/png;base64,AAAA"]
            await stub.Encode(sglang_pb.EncodeRequest(mm_items=good, req_id="ok", **fields))
            embedding_meta, _ = await asyncio.wait_for(socket.recv_multipart(), 10)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Encode(sglang_pb.EncodeRequest(mm_items=bad, req_id="bad", **fields))
            (error_meta,) = await asyncio.wait_for(socket.recv_multipart(), 10)
    assert pickle_globals(embedding_meta) == {layout.embedding_data, layout.modality, ("torch", "float32")}
    assert pickle_globals(error_meta) == {layout.embedding_data, layout.modality}
    assert b"bad" in error_meta and b"error_msg" in error_meta
    # the attribute only that layout's EmbeddingData has (_mr_ptr from 0.5.19, cached_embedding before)
    for name in ("_mr_ptr", "cached_embedding"):
        assert (name.encode() in embedding_meta) == (name in layout.attributes), name


async def test_deepstack_layers_go_beside_the_embedding_as_sglang_splits_them(default_model_dir, pull):
    """Qwen3-VL: SGLang's model takes the first hidden_size columns as the embedding and the rest
    as the deepstack layers in order, so a part's rows are [embedding | layer 0 | layer 1]."""
    socket, port = pull
    encoder = EncoderDouble(tokens=3, hidden_size=8, dtype=torch.float32, num_deepstack_layers=2)
    async with running_server(default_model_dir, encoder=encoder) as server:
        async with grpc.aio.insecure_channel(server.url.removeprefix("grpc://")) as channel:
            request = sglang_pb.EncodeRequest(
                mm_items=[data_uri(image_bytes(20, 20)), data_uri(image_bytes(30, 20))],
                req_id="ds", num_parts=1, part_idx=0, prefill_host="127.0.0.1", embedding_port=[port],
            )  # fmt: skip
            response = await sglang_grpc.SglangEncoderStub(channel).Encode(request)
    _, tensor = await socket.recv_multipart()
    assert (response.embedding_len, response.embedding_dim) == (6, 24)
    rows = torch.frombuffer(bytearray(tensor), dtype=torch.float32).view(6, 24)
    expected = []
    for width in (20, 30):
        output = encoder.output(width)
        expected.append(torch.cat([output.embedding, *output.deepstack], dim=1))
    assert torch.equal(rows, torch.cat(expected))


class _StandIn:
    """Whatever SGLang class an EmbeddingData pickle names: keeps the state it is built with."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        self.__dict__.update(state)


class _EmbeddingDataReader(pickle.Unpickler):
    """Reads a pushed EmbeddingData pickle without SGLang: its classes become stand-ins, torch's dtypes stay."""

    def find_class(self, module, name):
        return getattr(torch, name) if module == "torch" else _StandIn


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
async def test_qwen3_5_parts_are_the_models_own_image_features(model_type, tmp_path, pull):
    """Qwen3.5 and Qwen3.5-MoE, whose parts SGLang's --language-only server takes as Qwen-VL's: one part of
    three images off the 32 px grid is the full model's own get_image_features (float32, within 1e-5), the
    images' rows in order, with each image's grid in the EmbeddingData SGLang unpickles. (SGLang 0.5.23
    does not serve Qwen3.5 on a CPU: docs/sglang.md.)"""
    model_dir = write_checkpoint(model_type, tmp_path / model_type)
    pngs = [image_bytes(200, 150, seed=1), image_bytes(97, 301, seed=2), image_bytes(64, 77, seed=3)]
    socket, port = pull
    request = sglang_pb.EncodeRequest(
        mm_items=[data_uri(png) for png in pngs], req_id="q35", num_parts=1, part_idx=0,
        prefill_host="127.0.0.1", embedding_port=[port],
    )  # fmt: skip
    async with running_server(model_dir) as server, grpc.aio.insecure_channel(server.url[len("grpc://") :]) as channel:
        response = await sglang_grpc.SglangEncoderStub(channel).Encode(request)
    meta, tensor = await asyncio.wait_for(socket.recv_multipart(), 10)
    data = _EmbeddingDataReader(io.BytesIO(meta)).load()
    expected = reference_features(model_dir, pngs)
    want = torch.cat([image_rows(features) for features in expected])
    rows = torch.frombuffer(bytearray(tensor), dtype=torch.float32).view(-1, want.shape[1])
    assert (response.embedding_len, response.embedding_dim) == tuple(want.shape) == tuple(data.shape)
    assert data.dtype == torch.float32 and data.error_msg is None
    assert [math.prod(grid) // 4 for grid in data.grid_dim] == [len(image_rows(f)) for f in expected]
    torch.testing.assert_close(rows, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(req_id=""), "missing req_id"),
        (dict(req_id="r" * 257), "req_id is 257 characters, over the limit of 256"),
        (dict(mm_items=[]), "missing or empty mm_items"),
        (dict(num_parts=0, part_idx=0), "num_parts must be a positive integer"),
        (dict(num_parts=2, part_idx=2), "part_idx must be in [0, 2)"),
        (dict(prefill_host="host/path"), "is not a host and port"),
    ],
)
async def test_malformed_encode_requests_are_invalid_argument(stub, pull, change, message):
    fields = dict(mm_items=[data_uri(image_bytes(8, 8))], req_id="r", num_parts=1, part_idx=0)
    fields |= dict(prefill_host="127.0.0.1", embedding_port=[pull[1]]) | change
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Encode(sglang_pb.EncodeRequest(**fields))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in refused.value.details()


async def test_a_receiver_that_is_not_listening_fails_the_call_within_the_connect_timeout(stub):
    with zmq.Context() as context:  # a port nobody listens on: bound, then closed
        probe = context.socket(zmq.PULL)
        port = probe.bind_to_random_port("tcp://127.0.0.1")
        probe.close(linger=0)
    started = time.monotonic()
    request = sglang_pb.EncodeRequest(
        mm_items=[data_uri(image_bytes(8, 8))], req_id="gone", num_parts=1, part_idx=0, prefill_host="127.0.0.1", embedding_port=[port]
    )
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await stub.Encode(request)
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert f"no SGLang receiver listening at tcp://127.0.0.1:{port}" in failed.value.details()
    assert time.monotonic() - started < 15  # the 3 s connect timeout, not the 30 s push timeout


async def test_zmq_to_scheduler_waits_for_every_rank_then_pushes_to_each(stub):
    context = zmq.asyncio.Context()
    ranks = [context.socket(zmq.PULL) for _ in range(2)]
    ports = [rank.bind_to_random_port("tcp://127.0.0.1") for rank in ranks]
    try:
        encode = asyncio.ensure_future(
            stub.Encode(sglang_pb.EncodeRequest(mm_items=[data_uri(image_bytes(30, 30))], req_id="s", num_parts=1, part_idx=0))
        )
        await stub.SchedulerReceiveUrl(sglang_pb.SchedulerReceiveUrlRequest(req_id="s", receive_url=f"127.0.0.1:{ports[0]}", receive_count=2))
        # One rank of two has registered: nothing is pushed yet, and the call waits.
        assert await ranks[0].poll(300) == 0 and not encode.done()
        with pytest.raises(grpc.aio.AioRpcError) as mismatch:
            await stub.SchedulerReceiveUrl(sglang_pb.SchedulerReceiveUrlRequest(req_id="s", receive_url="127.0.0.1:9", receive_count=3))
        assert mismatch.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await stub.SchedulerReceiveUrl(sglang_pb.SchedulerReceiveUrlRequest(req_id="s", receive_url=f"127.0.0.1:{ports[1]}", receive_count=2))
        response = await asyncio.wait_for(encode, 30)
        frames = [await asyncio.wait_for(rank.recv_multipart(), 10) for rank in ranks]
        assert frames[0] == frames[1] and len(frames[0][1]) == response.embedding_size
    finally:
        for rank in ranks:
            rank.close(linger=0)
        context.term()


async def test_sglang_and_native_calls_share_forwards_and_the_cache(default_model_dir, pull):
    """Items of SGLang calls go through the native path: one batcher, one embedding cache (under the
    sglang profile's keys)."""
    socket, port = pull
    gated = EncoderDouble(load_vision_encoder(default_model_dir, "cpu", torch.float32))
    async with running_server(default_model_dir, encoder=gated) as server:
        async with grpc.aio.insecure_channel(server.url.removeprefix("grpc://")) as channel:
            native, sglang = pb_grpc.EncoderServiceStub(channel), sglang_grpc.SglangEncoderStub(channel)

            async def native_call(data: bytes) -> None:
                item = pb.ImageItem(index=0, modality=pb.IMAGE, data=data)
                async for _ in native.Encode(pb.EncodeRequest(request_id="native", items=[item])):
                    pass

            def sglang_call(data: bytes, req_id: str):
                return sglang.Encode(
                    sglang_pb.EncodeRequest(
                        mm_items=[data_uri(data)], req_id=req_id, num_parts=1, part_idx=0,
                        prefill_host="127.0.0.1", embedding_port=[port],
                    )
                )  # fmt: skip

            gated.reset()  # the warm-up forward
            gated.hold()
            first = asyncio.ensure_future(native_call(image_bytes(30, 30, seed=1)))
            while not gated.in_forward.is_set():
                await asyncio.sleep(0.01)
            calls = [asyncio.ensure_future(native_call(image_bytes(40, 40, seed=2))), sglang_call(image_bytes(50, 50, seed=3), "s1")]
            while server._batcher.queue_depth < 2:
                await asyncio.sleep(0.01)
            gated.release()
            await asyncio.gather(first, *calls)
            assert gated.batches == [1, 2]  # the SGLang item rode in the native call's forward
            await socket.recv_multipart()
            # The same image again through the same contract: a cache hit, no forward.
            await native_call(image_bytes(40, 40, seed=2))
            await sglang_call(image_bytes(50, 50, seed=3), "s2")
            assert gated.batches == [1, 2]
            assert server.cache.hits == 2
            # Through the other contract it is computed again: each follows its own engine's
            # preprocessing (docs/parity.md), so their embeddings are kept apart.
            await native_call(image_bytes(50, 50, seed=3))
            assert gated.batches == [1, 2, 1]


async def test_receive_urls_registered_before_or_after_the_encode_that_waits_for_them():
    urls = ReceiveUrls(keep_s=60, max_pending=2)
    urls.register("early", "127.0.0.1:1", 1)
    assert await urls.wait("early", 1) == ["127.0.0.1:1"]
    waiting = asyncio.ensure_future(urls.wait("late", 5))
    await asyncio.sleep(0)
    urls.register("late", "127.0.0.1:2", 2)
    urls.register("late", "127.0.0.1:2", 2)  # a repeated registration counts once
    await asyncio.sleep(0)
    assert not waiting.done()
    urls.register("late", "[::1]:3", 2)
    assert await waiting == ["127.0.0.1:2", "[::1]:3"]
    with pytest.raises(InvalidItemError, match="already has its 2 receive URLs"):
        urls.register("late", "127.0.0.1:4", 2)
    with pytest.raises(OverloadedError):
        urls.register("third", "127.0.0.1:5", 1)
    with pytest.raises(DeadlineExceededError, match=r"0 of \? receive URLs registered for 'nobody'"):
        await urls.wait("nobody", 0.05)


async def read(item: str, policy: SourcePolicy) -> bytes:
    return await read_item(item, SourceReader(policy))


async def test_item_strings_as_sglang_takes_them_under_the_source_policy(tmp_path):
    png = image_bytes(10, 10)
    jpeg = image_bytes(10, 10, fmt="JPEG")
    (tmp_path / "a.png").write_bytes(png)
    files = SourcePolicy(file_roots=(tmp_path,))
    assert await read(data_uri(png), SourcePolicy()) == png
    assert await read(base64.b64encode(jpeg).decode(), SourcePolicy()) == jpeg  # starts with "/9j/"
    assert await read(str(tmp_path / "a.png"), files) == png
    assert await read((tmp_path / "a.png").as_uri(), files) == png
    web = SourcePolicy(http_urls="public")
    # Listening sockets that never answer: the refusal comes before any connection, from the address.
    with socket.create_server(("127.0.0.1", 0)) as v4, socket.create_server(("::1", 0), family=socket.AF_INET6) as v6:
        refusals = [
            (str(tmp_path / "a.png"), SourcePolicy(), "file:// URLs are disabled"),
            ("/etc/passwd.png", files, "outside the allowed directories"),
            ("a.png", files, "neither a URL, a data: URI, an absolute path nor base64"),
            ("http://127.0.0.1:9/a.png", SourcePolicy(), "http:// URLs are disabled"),
            (f"http://127.0.0.1:{v4.getsockname()[1]}/a.png", web, "127.0.0.1 is a loopback address"),
            (f"http://[::1]:{v6.getsockname()[1]}/a.png", web, "::1 is a loopback address"),
        ]
        for item, policy, message in refusals:
            with pytest.raises(InvalidItemError, match=re.escape(message)):
                await read(item, policy)


async def test_video_and_audio_items_are_refused_as_such():
    mp4_head = b"\x00\x00\x00\x1cftypisom\x00\x00\x02\x00isomiso2mp41"
    with pytest.raises(UnsupportedModalityError, match=r"got: \['video'\]"):
        await read("data:video/mp4;base64,AAAA", SourcePolicy())
    with pytest.raises(UnsupportedModalityError, match=r"got: \['video'\]"):
        await read(base64.b64encode(mp4_head).decode(), SourcePolicy())
    assert sniff_non_image(b"RIFF\0\0\0\0WAVEfmt ") == "audio"
    assert sniff_non_image(b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00") is None  # an AVIF image
    assert sniff_non_image(image_bytes(8, 8)) is None
