"""Chunked-prefill windows: window_rows and EncodeResult.window, and their SGLang names get_embedding_chunk and
EncodeResult.chunk, against a per-position reference."""

from __future__ import annotations

import random

import pytest
import torch

from receiver import EncodeResult, ItemResult, ItemsOffsetError, get_embedding_chunk, window_rows


def reference_bounds(extend_prefix_len: int, extend_seq_len: int, items_offset) -> tuple[int, int]:
    """Lists every placeholder position; the window's rows are those whose position falls inside it."""
    positions = [p for start, end in items_offset for p in range(start, end + 1)]
    inside = [
        row for row, p in enumerate(positions) if extend_prefix_len <= p < extend_prefix_len + extend_seq_len
    ]
    if inside:
        return inside[0], inside[-1] + 1
    before = sum(p < extend_prefix_len for p in positions)
    return before, before


def random_layout(rng: random.Random) -> tuple[list[tuple[int, int]], int]:
    """Items with random gaps (0 allowed: adjacent runs) and lengths; returns offsets and prompt length."""
    offsets, position = [], rng.randint(0, 5)
    for _ in range(rng.randint(1, 6)):
        length = rng.randint(1, 9)
        offsets.append((position, position + length - 1))
        position += length + rng.choice([0, 0, 1, rng.randint(1, 10)])
    return offsets, position + rng.randint(0, 5)


def result_of(counts: list[int], hidden: int = 3) -> EncodeResult:
    rows = torch.arange(sum(counts) * hidden, dtype=torch.float32).reshape(-1, hidden)
    items = [
        ItemResult(index=i, embedding=part, grid_thw=(), encoder_url=None)
        for i, part in enumerate(rows.split(counts))
    ]
    return EncodeResult("r", items)


def test_example_from_the_issue_through_the_sglang_names():
    embedding = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    rows, start, end = get_embedding_chunk(embedding, 3, 12, [(2, 3), (6, 7)])
    assert (start, end) == (1, 4)
    assert torch.equal(rows, embedding[1:4])
    result = result_of([2, 2], hidden=2)
    rows, start, end = result.chunk(3, 12, [(2, 3), (6, 7)])
    assert (start, end) == (1, 4) and torch.equal(rows, result.embedding[1:4])


def test_matches_reference_on_thousands_of_random_layouts():
    rng = random.Random(0)
    windows_checked = 0
    for _ in range(3000):
        offsets, prompt_len = random_layout(rng)
        counts = [end - start + 1 for start, end in offsets]
        result = result_of(counts)
        cuts = sorted({0, prompt_len, *(rng.randint(0, prompt_len) for _ in range(3))})
        # Consecutive windows like a chunked prefill, plus one random window anywhere.
        windows = [(a, b - a) for a, b in zip(cuts, cuts[1:])] + [
            (rng.randint(0, prompt_len), rng.randint(0, 8))
        ]
        pieces = []
        for prefix, length in windows:
            want = reference_bounds(prefix, length, offsets)
            rows, start, end = window_rows(result.embedding, prefix, length, offsets)
            assert (start, end) == want, (offsets, prefix, length)
            assert torch.equal(rows, result.embedding[start:end])
            window, *bounds = result.window(prefix, length, offsets)
            assert tuple(bounds) == want and torch.equal(window, rows)
            if len(pieces) < len(windows) - 1:
                pieces.append(rows)
            windows_checked += 1
        # The consecutive windows of one prompt cover every row exactly once, in order.
        assert torch.equal(torch.cat(pieces), result.embedding)
    assert windows_checked > 10000


@pytest.mark.parametrize(
    "prefix, length, bounds",
    [
        (0, 20, (0, 6)),  # the whole prompt
        (0, 3, (0, 0)),  # text before the first item
        (8, 2, (4, 4)),  # text between the items
        (4, 2, (1, 3)),  # starts and ends inside item 0
        (5, 6, (2, 5)),  # starts inside item 0, ends inside item 1
        (11, 10, (5, 6)),  # starts inside item 1 and runs past the end
        (13, 4, (6, 6)),  # after the last item
        (6, 0, (3, 3)),  # an empty window
    ],
)
def test_windows_inside_around_and_between_items(prefix, length, bounds):
    offsets = [(3, 6), (10, 11)]  # prompt: 3 text, 4 image, 3 text, 2 image, text
    result = result_of([4, 2])
    rows, start, end = result.window(prefix, length, offsets)
    assert (start, end) == bounds == reference_bounds(prefix, length, offsets)
    assert torch.equal(rows, result.embedding[start:end])


@pytest.mark.parametrize(
    "offsets, message",
    [
        ([(2, 5), (5, 7)], "item 1: items_offset run (5, 7) starts at or before the previous run's end 5"),
        ([(6, 7), (2, 5)], "item 1: items_offset run (2, 5) starts at or before the previous run's end 7"),
        ([(2, 5), (9, 8)], "item 1: items_offset run (9, 8) is not an inclusive range"),
        ([(-1, 2), (9, 10)], "item 0: items_offset run (-1, 2) is not an inclusive range"),
        ([(2, 5), (9, 11)], "items_offset covers 7 positions, the embedding has 6 rows"),
    ],
)
def test_bad_offsets_are_errors_not_wrong_rows(offsets, message):
    embedding = torch.zeros(6, 2)
    with pytest.raises(ItemsOffsetError, match=message.replace("(", r"\(").replace(")", r"\)")):
        window_rows(embedding, 0, 4, offsets)


def test_result_chunk_checks_each_item_not_just_the_total():
    result = result_of([4, 2])
    # 6 positions in all, as many as rows, but split 2 + 4 instead of 4 + 2.
    window_rows(result.embedding, 0, 20, [(0, 1), (5, 8)])
    with pytest.raises(
        ItemsOffsetError, match=r"item 0: items_offset run \(0, 1\) covers 2 positions, the item has 4 tokens"
    ):
        result.window(0, 20, [(0, 1), (5, 8)])
    with pytest.raises(ItemsOffsetError, match="items_offset has 1 runs for 2 items"):
        result.window(0, 20, [(0, 5)])


def test_a_request_without_items_has_no_rows_in_any_window():
    rows, start, end = window_rows(torch.zeros(0, 3), 4, 9, [])
    assert (start, end) == (0, 0) and rows.shape == (0, 3)


def test_bad_windows_and_embeddings():
    with pytest.raises(ValueError, match="must be >= 0"):
        window_rows(torch.zeros(2, 2), -1, 4, [(0, 1)])
    with pytest.raises(ValueError, match="embedding must be"):
        window_rows(torch.zeros(1, 2, 2), 0, 4, [(0, 1)])
