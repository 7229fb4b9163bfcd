"""Prefill-side glue: expanding a prompt's image placeholders into `items_offset`, and gathering a
prefill batch's embedding rows, request after request, onto one device."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from encoder_common.errors import InvalidItemError, ItemsOffsetError

from .result import EncodeResult
from .windows import Window


def expand_placeholders(
    input_ids: Sequence[int] | torch.Tensor, placeholder_token_id: int, result: EncodeResult
) -> tuple[list[int] | torch.Tensor, list[tuple[int, int]]]:
    """Repeats the i-th placeholder token `result.items[i].num_tokens` times.

    `input_ids` holds exactly one `placeholder_token_id` per item of `result`, in item order.
    Returns the expanded ids (a list, or a 1-D tensor on the same device when given one) and
    `items_offset`, each item's inclusive (start, end) positions in them, ready for
    `EncodeResult.window`. Raises ItemsOffsetError when placeholders and items do not pair up.
    """
    ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
    positions = [i for i, token in enumerate(ids) if token == placeholder_token_id]
    if len(positions) != len(result.items):
        raise ItemsOffsetError(
            f"request {result.request_id!r}: the prompt has {len(positions)} placeholder tokens "
            f"({placeholder_token_id}), the result has {len(result.items)} items"
        )
    expanded: list[int] = []
    items_offset: list[tuple[int, int]] = []
    copied = 0
    for position, item in zip(positions, result.items):
        expanded += ids[copied:position]
        items_offset.append((len(expanded), len(expanded) + item.num_tokens - 1))
        expanded += [placeholder_token_id] * item.num_tokens
        copied = position + 1
    expanded += ids[copied:]
    if isinstance(input_ids, torch.Tensor):
        return torch.tensor(expanded, dtype=input_ids.dtype, device=input_ids.device), items_offset
    return expanded, items_offset


def batch_embedding(
    results: Sequence[EncodeResult | None],
    device: str | torch.device,
    windows: Sequence[Window | None] | None = None,
) -> torch.Tensor:
    """The multimodal embedding rows a prefill batch needs, in batch order, on `device`.

    `results[i]` is request i's result (raw, precomputed or mixed items alike), or None for a
    request without images. Without a window a request contributes all its rows; with
    `windows[i]` only the rows of that step (as `EncodeResult.window`). Rows are copied once,
    item by item, into one [rows, hidden_size] tensor allocated on `device`. Raises
    InvalidItemError if the items disagree on hidden size or dtype.
    """
    if windows is not None and len(windows) != len(results):
        raise ValueError(f"{len(windows)} windows for {len(results)} requests")
    spans: list[tuple[EncodeResult, int, int]] = []
    for i, result in enumerate(results):
        if result is None:
            continue
        window = windows[i] if windows is not None else None
        start, end = (0, result.num_tokens) if window is None else result.window_bounds(*window)
        spans.append((result, start, end))
    items = [(result.request_id, item) for result, _, _ in spans for item in result.items]
    if not items:
        raise ValueError("the batch has no multimodal items")
    first = items[0][1].embedding
    for request_id, item in items:
        if item.hidden_size != first.shape[1] or item.embedding.dtype != first.dtype:
            raise InvalidItemError(
                f"request {request_id!r} item {item.index}: "
                f"hidden {item.hidden_size} {item.embedding.dtype}, "
                f"the batch's first item has hidden {first.shape[1]} {first.dtype}"
            )
    out = torch.empty(
        (sum(end - start for _, start, end in spans), first.shape[1]), dtype=first.dtype, device=device
    )
    row = 0
    for result, start, end in spans:
        for rows in _item_rows(result, start, end):
            out[row : row + rows.shape[0]].copy_(rows, non_blocking=True)
            row += rows.shape[0]
    return out


def _item_rows(result: EncodeResult, start: int, end: int) -> Iterator[torch.Tensor]:
    """Rows start:end of the request's embedding as slices of its items, without concatenating them."""
    first_row = 0
    for item in result.items:
        lo, hi = max(start, first_row), min(end, first_row + item.num_tokens)
        if lo < hi:
            yield item.embedding[lo - first_row : hi - first_row]
        first_row += item.num_tokens
