"""Precomputed embeddings mixed with raw items in a request, through real servers that log what they get."""

from __future__ import annotations

import socket

import pytest
import torch

from protos import encoder_pb2 as pb
from receiver import EncoderError, EncoderReceiver, InvalidItemError, UnsupportedModalityError
from receiver.embeddings.precomputed import precomputed_result
from testkit.images import image_bytes
from testkit.rpc_log import logged_server
from testkit.servers import running_server

IMAGES = [
    image_bytes(56 * (1 + i % 2), 56 * (1 + i // 2), seed=40 + i) for i in range(4)
]  # 4, 8, 8, 16 tokens


@pytest.fixture(scope="module")
async def two_servers(default_model_dir):
    async with logged_server(default_model_dir) as a, logged_server(default_model_dir) as b:
        yield [a, b]


@pytest.fixture
def servers(two_servers):
    """The two servers with empty RPC logs."""
    for server in two_servers:
        server.rpc_log.calls.clear()
    return two_servers


@pytest.fixture(scope="module")
async def all_raw(two_servers):
    async with EncoderReceiver([s.url for s in two_servers], seed=0) as rx:
        return await rx.encode("all-raw", [{"modality": "image", "data": d} for d in IMAGES])


def sent_indices(servers) -> list[int]:
    return sorted(i for s in servers for call in s.rpc_log.sent("Encode") for i in call)


async def test_raw_precomputed_raw_precomputed_equals_all_raw_and_sends_only_raw_items(servers, all_raw):
    for seed in range(4):
        for server in servers:
            server.rpc_log.calls.clear()
        async with EncoderReceiver([s.url for s in servers], seed=seed) as rx:
            items = [
                {"modality": "image", "data": IMAGES[0]},
                {"modality": "image", "precomputed_embedding": all_raw.items[1].embedding.double()},
                {"modality": "image", "data": IMAGES[2], "precomputed_embedding": None},  # a cache miss
                {
                    "modality": "image",
                    "data": IMAGES[3],
                    "precomputed_embedding": all_raw.items[3].embedding.clone(),
                },
            ]
            result = await rx.encode(f"mixed-{seed}", items)
            again = await rx.encode(f"mixed-{seed}-again", items)
        # Only items 0 and 2 travel, one to each encoder (twice: two requests); ModelInfo once per receiver.
        assert sent_indices(servers) == [0, 0, 2, 2]
        assert all(len(call) == 1 for s in servers for call in s.rpc_log.sent("Encode"))
        assert all(len(s.rpc_log.sent("Encode")) == 2 for s in servers)
        assert [len(s.rpc_log.sent("GetModelInfo")) for s in servers] == [1, 1]
        assert [item.index for item in result.items] == [0, 1, 2, 3]
        assert [item.precomputed for item in result.items] == [False, True, False, True]
        assert [item.encoder_url is None for item in result.items] == [False, True, False, True]
        assert {result.items[0].encoder_url, result.items[2].encoder_url} == {s.url for s in servers}
        for got, want in zip(result.items, all_raw.items):
            assert got.embedding.dtype == torch.float32 and got.embedding.shape == want.embedding.shape
            torch.testing.assert_close(got.embedding, want.embedding, rtol=1e-5, atol=1e-5)
        assert torch.equal(result.items[1].embedding, all_raw.items[1].embedding)
        assert torch.equal(result.items[3].embedding, all_raw.items[3].embedding)
        torch.testing.assert_close(result.embedding, all_raw.embedding, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(again.embedding, all_raw.embedding, rtol=1e-5, atol=1e-5)


async def test_all_precomputed_request_makes_no_rpc(servers, all_raw):
    items = [{"precomputed_embedding": item.embedding} for item in all_raw.items]
    async with EncoderReceiver([s.url for s in servers]) as rx:
        first = await rx.encode("first", items)  # ModelInfo not fetched: not even GetModelInfo
        second = await rx.encode("second", items)
    assert [s.rpc_log.calls for s in servers] == [[], []]
    for result in (first, second):
        assert all(item.precomputed for item in result.items)
        assert torch.equal(result.embedding, all_raw.embedding)


def unreachable_url() -> str:
    """A loopback port nobody listens on (bound by the OS, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"grpc://127.0.0.1:{s.getsockname()[1]}"


async def test_precomputed_only_requests_are_served_while_every_encoder_is_down(all_raw):
    rows = [item.embedding for item in all_raw.items]
    async with EncoderReceiver([unreachable_url(), unreachable_url()], timeout=5.0) as rx:
        result = await rx.encode("down", [{"precomputed_embedding": r, "grid_thw": (1, 4, 4)} for r in rows])
        assert torch.equal(result.embedding, all_raw.embedding)
        assert result.items[0].grid_thw == (1, 4, 4)  # no ModelInfo: only its shape is checked
        bf16 = await rx.encode("bf16", [{"precomputed_embedding": rows[0].to(torch.bfloat16)}])
        assert bf16.items[0].embedding.dtype == torch.bfloat16  # no served dtype known: kept as given
        # Without ModelInfo, what the tensors prove: each 2-D, finite, non-empty, all as wide as the first.
        refused = {
            r"item 1: 'precomputed_embedding' has shape \[4, 1024\]; expected \[num_tokens, 2048\]": [rows[0], torch.zeros(4, 1024)],
            r"item 0: 'precomputed_embedding' has shape \[1, 4, 2048\]": [torch.zeros(1, 4, 2048)],
            r"item 0: 'precomputed_embedding' has 1 non-finite values": [torch.zeros(4, 8).index_fill_(1, torch.tensor([3]), float("nan"))[:1]],
            r"item 0: 'precomputed_embedding' is empty": [torch.zeros(0, 2048)],
            r"item 0: 'precomputed_deepstack' has shape \[2, 3, 2048\]; expected \[num_deepstack_layers, 4, 2048\]": [
                {"precomputed_embedding": rows[0], "precomputed_deepstack": torch.zeros(2, 3, 2048)}
            ],
        }
        for message, tensors in refused.items():
            items = [t if isinstance(t, dict) else {"precomputed_embedding": t} for t in tensors]
            with pytest.raises(InvalidItemError, match=message):
                await rx.encode("bad", items)
    # A hidden size the caller configured is checked from the first item on.
    async with EncoderReceiver([unreachable_url()], hidden_size=1024) as rx:
        with pytest.raises(InvalidItemError, match=r"item 0: .* has shape \[4, 2048\]; expected \[num_tokens, 1024\]"):
            await rx.encode("configured", [{"precomputed_embedding": rows[0]}])
        assert (await rx.encode("fits", [{"precomputed_embedding": torch.ones(3, 1024)}])).items[0].hidden_size == 1024


BAD = {
    "wrong hidden": (torch.zeros(4, 2047), r"has shape \[4, 2047\]; expected \[num_tokens, 2048\]"),
    "3-D": (torch.zeros(1, 4, 2048), r"has shape \[1, 4, 2048\]; expected \[num_tokens, 2048\]"),
    "NaN": (torch.zeros(4, 2048).index_fill_(1, torch.tensor([7]), float("nan")), "has 4 non-finite values"),
    "inf": (torch.full((2, 2048), float("-inf"), dtype=torch.bfloat16), "has 4096 non-finite values"),
    "empty": (torch.zeros(0, 2048), r"is empty \(shape \[0, 2048\]\)"),
    "integer": (
        torch.zeros(4, 2048, dtype=torch.int64),
        "has dtype torch.int64; expected a floating-point tensor",
    ),
    "not a tensor": ([[0.0] * 2048], "must be a torch.Tensor"),
}


@pytest.mark.parametrize("case", list(BAD))
async def test_bad_precomputed_tensor_fails_naming_the_item_before_any_encode_call(servers, case):
    tensor, message = BAD[case]
    items = [{"data": IMAGES[0]}, {"data": IMAGES[1]}, {"precomputed_embedding": tensor}, {"data": IMAGES[3]}]
    async with EncoderReceiver([s.url for s in servers]) as rx:
        with pytest.raises(InvalidItemError, match=r"^item 2: 'precomputed_embedding' " + message):
            await rx.encode(case, items)
        assert sent_indices(servers) == []
        # The receiver keeps working after the refusal.
        result = await rx.encode("after", items[:2])
    assert [item.num_tokens for item in result.items] == [4, 8]


async def test_grid_thw_and_weights_fingerprint_are_checked_when_given(servers, all_raw):
    rows = all_raw.items[1].embedding  # 8 tokens, grid (1, 4, 8)
    async with EncoderReceiver([s.url for s in servers]) as rx:
        fingerprint = (await rx.served_model()).weights_fingerprint
        ok = await rx.encode(
            "ok",
            [
                {
                    "precomputed_embedding": rows,
                    "grid_thw": all_raw.items[1].grid_thw,
                    "weights_fingerprint": fingerprint,
                }
            ],
        )
        assert ok.items[0].grid_thw == all_raw.items[1].grid_thw == (1, 4, 8)
        with pytest.raises(
            InvalidItemError,
            match=r"item 1: grid_thw \[1, 4, 4\] makes 4 tokens after the 2x2 merge, "
            r"but the precomputed embedding has 8 rows",
        ):
            await rx.encode(
                "grid", [{"data": IMAGES[0]}, {"precomputed_embedding": rows, "grid_thw": (1, 4, 4)}]
            )
        with pytest.raises(
            InvalidItemError, match="item 0: precomputed by weights 0000000000000000..., the encoders serve"
        ):
            await rx.encode("stale", [{"precomputed_embedding": rows, "weights_fingerprint": "0" * 64}])
    assert sent_indices(servers) == []


async def test_image_only_rule_covers_precomputed_items_before_any_network_call(servers, all_raw):
    items = [{"data": IMAGES[0]}, {"modality": "video", "precomputed_embedding": all_raw.items[0].embedding}]
    async with EncoderReceiver([s.url for s in servers]) as rx:
        with pytest.raises(UnsupportedModalityError, match=r"got: \['video'\]"):
            await rx.encode("video", items)
    assert [s.rpc_log.calls for s in servers] == [[], []]


async def test_precomputed_items_take_the_served_dtype(servers, all_raw):
    rows = all_raw.items[0].embedding
    async with EncoderReceiver([s.url for s in servers]) as rx:
        await rx.served_model()  # known from now on, so precomputed-only requests use it too
        result = await rx.encode("bf16", [{"precomputed_embedding": rows.to(torch.bfloat16)}])
    assert result.items[0].embedding.dtype == torch.float32
    assert torch.equal(result.items[0].embedding, rows.to(torch.bfloat16).float())


async def test_encoders_serving_different_dtypes_refuse_precomputed_items(
    default_model_dir, servers, all_raw
):
    async with running_server(default_model_dir, dtype=torch.bfloat16) as bf16:
        urls = [servers[0].url, bf16.url]
        async with EncoderReceiver(urls) as rx:
            with pytest.raises(EncoderError, match="encoders disagree on what they serve") as raised:
                await rx.encode(
                    "mixed-dtypes", [{"data": IMAGES[0]}, {"precomputed_embedding": all_raw.items[0].embedding}]
                )
    assert f"{servers[0].url}: hidden 2048 FLOAT32" in str(raised.value)
    assert f"{bf16.url}: hidden 2048 BFLOAT16" in str(raised.value)


def test_overflow_into_a_half_precision_served_dtype_is_refused():
    info = pb.ModelInfo(hidden_size=4, dtype=pb.FLOAT16)
    with pytest.raises(
        InvalidItemError, match="1 non-finite values .* out of the range of the served torch.float16"
    ):
        precomputed_result({"precomputed_embedding": torch.tensor([[1.0, 2.0, 7e4, 0.0]])}, 0, info)
    converted = precomputed_result({"precomputed_embedding": torch.tensor([[1.0, 2.0, 3.0, 0.0]])}, 0, info)
    assert converted.embedding.dtype == torch.float16


def test_deepstack_is_required_exactly_when_the_served_model_has_it():
    rows = torch.randn(3, 4)
    deep = pb.ModelInfo(hidden_size=4, dtype=pb.FLOAT32, num_deepstack_layers=2)
    with pytest.raises(
        InvalidItemError, match=r"item 5: the served model emits 2 deepstack layers.*\[2, 3, 4\]"
    ):
        precomputed_result({"precomputed_embedding": rows}, 5, deep)
    with pytest.raises(
        InvalidItemError, match=r"'precomputed_deepstack' has shape \[2, 2, 4\]; expected \[2, 3, 4\]"
    ):
        precomputed_result(
            {"precomputed_embedding": rows, "precomputed_deepstack": torch.zeros(2, 2, 4)}, 5, deep
        )
    result = precomputed_result(
        {"precomputed_embedding": rows, "precomputed_deepstack": torch.ones(2, 3, 4)}, 5, deep
    )
    assert result.deepstack.shape == (2, 3, 4) and result.index == 5
    flat = pb.ModelInfo(hidden_size=4, dtype=pb.FLOAT32)
    with pytest.raises(InvalidItemError, match="served model has no deepstack layers"):
        precomputed_result(
            {"precomputed_embedding": rows, "precomputed_deepstack": torch.ones(2, 3, 4)}, 5, flat
        )


def test_finite_values_whose_sum_overflows_are_accepted():
    info = pb.ModelInfo(hidden_size=4, dtype=pb.FLOAT32)
    huge = torch.full((3, 4), 3e38)
    assert not torch.isfinite(huge.sum())
    assert torch.equal(precomputed_result({"precomputed_embedding": huge}, 0, info).embedding, huge)
