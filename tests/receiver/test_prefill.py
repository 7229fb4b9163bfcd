"""Prefill-side glue: placeholder expansion; a batch of raw, precomputed and mixed requests, in order."""

from __future__ import annotations

import pytest
import torch

from receiver import (
    EncodeResult,
    EncoderReceiver,
    InvalidItemError,
    ItemResult,
    ItemsOffsetError,
    Window,
    batch_embedding,
    expand_placeholders,
)
from testkit.images import image_bytes
from testkit.servers import running_server

IMAGE_PAD = 151655  # Qwen2-VL's <|image_pad|>
VISION_START, VISION_END = 151652, 151653
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def result_of(counts: list[int], hidden: int = 2, request_id: str = "r") -> EncodeResult:
    rows = torch.randn(sum(counts), hidden)
    return EncodeResult(
        request_id, [ItemResult(i, part, (), None) for i, part in enumerate(rows.split(counts))]
    )


def prompt(num_items: int, seed: int) -> list[int]:
    """Text tokens around each image's <|vision_start|><|image_pad|><|vision_end|>."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (num_items,), generator=generator).tolist()
    ids = torch.randint(0, 1000, (5,), generator=generator).tolist()
    for length in lengths:
        ids += [VISION_START, IMAGE_PAD, VISION_END] + torch.randint(
            0, 1000, (length,), generator=generator
        ).tolist()
    return ids


def test_expand_placeholders_repeats_each_by_its_token_count():
    result = result_of([4, 8])
    ids, items_offset = expand_placeholders([1, 2, IMAGE_PAD, 3, IMAGE_PAD, 4], IMAGE_PAD, result)
    assert ids == [1, 2] + [IMAGE_PAD] * 4 + [3] + [IMAGE_PAD] * 8 + [4]
    assert items_offset == [(2, 5), (7, 14)]
    rows, start, end = result.window(0, len(ids), items_offset)
    assert (start, end) == (0, 12) and torch.equal(rows, result.embedding)


def test_expand_placeholders_keeps_a_tensor_a_tensor_and_adjacent_placeholders_apart():
    result = result_of([3, 1, 2])
    input_ids = torch.tensor([IMAGE_PAD, IMAGE_PAD, 7, IMAGE_PAD], dtype=torch.int32)
    ids, items_offset = expand_placeholders(input_ids, IMAGE_PAD, result)
    assert isinstance(ids, torch.Tensor) and ids.dtype == torch.int32
    assert ids.tolist() == [IMAGE_PAD] * 4 + [7] + [IMAGE_PAD] * 2
    assert items_offset == [(0, 2), (3, 3), (5, 6)]


@pytest.mark.parametrize("placeholders", [1, 3])
def test_placeholder_count_must_match_the_items(placeholders):
    ids = [5] + [IMAGE_PAD] * placeholders + [6]
    with pytest.raises(
        ItemsOffsetError,
        match=rf"the prompt has {placeholders} placeholder tokens \({IMAGE_PAD}\), the result has 2 items",
    ):
        expand_placeholders(ids, IMAGE_PAD, result_of([2, 2]))


@pytest.fixture(scope="module")
async def batch(default_model_dir):
    """Three requests on a real server: all raw, all precomputed, mixed; and each one's all-raw twin."""
    images = [image_bytes(56 * (1 + i % 3), 56 * (1 + i % 2), seed=60 + i) for i in range(7)]
    async with running_server(default_model_dir) as server:
        async with EncoderReceiver([server.url]) as rx:
            raw = await rx.encode("reference", [{"data": d} for d in images])
            pre = [{"precomputed_embedding": item.embedding} for item in raw.items]
            requests = [
                await rx.encode("all-raw", [{"data": images[0]}, {"data": images[1]}]),
                await rx.encode("all-precomputed", [pre[2], pre[3], pre[4]]),
                await rx.encode("mixed", [pre[5], {"data": images[6]}, pre[0]]),
            ]
    twins = [[0, 1], [2, 3, 4], [5, 6, 0]]
    return requests, [torch.cat([raw.items[i].embedding for i in twin]) for twin in twins]


@pytest.mark.parametrize("device", DEVICES)
async def test_batch_of_raw_precomputed_and_mixed_requests_assembles_in_order(batch, device):
    requests, expected = batch
    assert [[item.precomputed for item in r.items] for r in requests] == [
        [False, False],
        [True, True, True],
        [True, False, True],
    ]
    out = batch_embedding(requests, device)
    assert out.device.type == device and out.dtype == torch.float32
    assert torch.equal(out.cpu(), torch.cat([r.embedding for r in requests]))
    torch.testing.assert_close(out.cpu(), torch.cat(expected), rtol=1e-5, atol=1e-5)
    # A request without images contributes nothing, wherever it sits in the batch.
    assert torch.equal(
        batch_embedding([None, requests[2], None, requests[0]], device).cpu(),
        torch.cat([requests[2].embedding, requests[0].embedding]),
    )


@pytest.mark.parametrize("device", DEVICES)
async def test_chunked_prefill_of_the_batch_step_by_step_covers_every_row_once(batch, device):
    requests, _ = batch
    prompts = [
        expand_placeholders(prompt(len(r.items), seed), IMAGE_PAD, r) for seed, r in enumerate(requests)
    ]
    window_size = 9  # tokens per request per step: windows start and end inside items and text alike
    steps = max(len(ids) for ids, _ in prompts) // window_size + 1
    gathered: list[list[torch.Tensor]] = [[] for _ in requests]
    for step in range(steps):
        prefix = step * window_size
        windows = [
            Window(prefix, max(0, min(window_size, len(ids) - prefix)), offsets) for ids, offsets in prompts
        ]
        out = batch_embedding(requests, device, windows).cpu()
        # Exactly one row per placeholder token inside each request's window, in batch order.
        counts = [
            ids[w.extend_prefix_len : w.extend_prefix_len + w.extend_seq_len].count(IMAGE_PAD)
            for (ids, _), w in zip(prompts, windows)
        ]
        assert out.shape[0] == sum(counts)
        for i, piece in enumerate(out.split(counts)):
            assert torch.equal(piece, requests[i].window(*windows[i])[0])
            gathered[i].append(piece)
    for request, pieces in zip(requests, gathered):
        assert torch.equal(torch.cat(pieces), request.embedding)


def test_batch_refuses_items_of_different_widths_and_bad_windows():
    with pytest.raises(
        InvalidItemError,
        match=r"request 'b' item 0: hidden 3 torch.float32, the batch's first item has hidden 2",
    ):
        batch_embedding([result_of([2], 2, "a"), result_of([1], 3, "b")], "cpu")
    with pytest.raises(ItemsOffsetError, match="covers 3 positions, the item has 2 tokens"):
        batch_embedding([result_of([2])], "cpu", [Window(0, 4, [(1, 3)])])
    with pytest.raises(ValueError, match="1 windows for 2 requests"):
        batch_embedding([result_of([2]), result_of([2])], "cpu", [None])
    with pytest.raises(ValueError, match="no multimodal items"):
        batch_embedding([None], "cpu")
