"""Precomputed items: embeddings the caller already holds, checked against what is known of the
served model and turned into results without reaching an encoder."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from encoder_common.errors import EncoderError, InvalidItemError
from protos import encoder_pb2 as pb
from protos import wire

from .result import ItemResult

PRECOMPUTED_KEY = "precomputed_embedding"  # [num_tokens, hidden_size], any float dtype
DEEPSTACK_KEY = "precomputed_deepstack"  # [num_deepstack_layers, num_tokens, hidden_size]


def is_precomputed(item: Mapping[str, Any]) -> bool:
    """Whether the item carries its embedding; None counts as absent (an upstream cache miss)."""
    return item.get(PRECOMPUTED_KEY) is not None


def agreed_model(infos: Mapping[str, pb.ModelInfo]) -> pb.ModelInfo:
    """One encoder's ModelInfo, after checking that all of them serve the same hidden size and dtype."""
    shapes = {url: (info.hidden_size, pb.DType.Name(info.dtype)) for url, info in infos.items()}
    if len(set(shapes.values())) > 1:
        listing = ", ".join(f"{url}: hidden {hidden} {dtype}" for url, (hidden, dtype) in shapes.items())
        raise EncoderError(
            f"encoders disagree on what they serve ({listing}); their embeddings cannot be mixed"
        )
    info = next(iter(infos.values()))
    if info.dtype not in wire.TORCH_DTYPES:
        raise EncoderError(
            f"encoder reports dtype {pb.DType.Name(info.dtype)}, which the receiver cannot read"
        )
    return info


def precomputed_results(
    items: Sequence[Mapping[str, Any]],
    indices: Sequence[int],
    info: pb.ModelInfo | None,
    hidden_size: int | None = None,
) -> dict[int, ItemResult]:
    """The results of the items at `indices`, by index, checked without any network call.

    Against the served model's ModelInfo when known (see `precomputed_result`); otherwise against
    `hidden_size` when given, and always for what the tensors prove on their own: each one 2-D,
    finite and non-empty, and all of the request's as wide as the first. Without ModelInfo an item
    keeps its own dtype, and neither its weights fingerprint nor its grid's token count is checked.
    """
    if info is not None:
        return {i: precomputed_result(items[i], i, info) for i in indices}
    results: dict[int, ItemResult] = {}
    for i in indices:
        results[i] = _unserved_result(items[i], i, hidden_size)
        hidden_size = results[i].hidden_size  # the first item's width binds the rest
    return results


def _unserved_result(item: Mapping[str, Any], index: int, hidden: int | None) -> ItemResult:
    width = "hidden_size" if hidden is None else hidden
    embedding = _served_tensor(
        item[PRECOMPUTED_KEY], f"item {index}: '{PRECOMPUTED_KEY}'", (None, hidden), f"[num_tokens, {width}]", None
    )
    num_tokens, hidden = embedding.shape
    deepstack = item.get(DEEPSTACK_KEY)
    if deepstack is not None:
        deepstack = _served_tensor(
            deepstack,
            f"item {index}: '{DEEPSTACK_KEY}'",
            (None, num_tokens, hidden),
            f"[num_deepstack_layers, {num_tokens}, {hidden}]",
            None,
        )
    return ItemResult(
        index=index,
        embedding=embedding,
        grid_thw=_checked_grid(item.get("grid_thw"), index, num_tokens, merge=0, extra_tokens=0),
        encoder_url=None,
        deepstack=deepstack,
        precomputed=True,
    )


def precomputed_result(item: Mapping[str, Any], index: int, info: pb.ModelInfo) -> ItemResult:
    """The item's result from its own embedding, converted to the served dtype on the CPU.

    Raises InvalidItemError, naming the item and what was expected, unless the embedding is a
    finite, non-empty [num_tokens, hidden_size] float tensor. Optional keys are checked when
    present: "grid_thw" (must account for num_tokens after the spatial merge, plus the tokens
    the family adds per item), "weights_fingerprint" (must be the served checkpoint's), and
    "precomputed_deepstack" (required exactly when the served model emits deepstack layers).
    """
    dtype = wire.TORCH_DTYPES[info.dtype]
    hidden = info.hidden_size
    embedding = _served_tensor(
        item[PRECOMPUTED_KEY],
        f"item {index}: '{PRECOMPUTED_KEY}'",
        (None, hidden),
        f"[num_tokens, {hidden}]",
        dtype,
    )
    num_tokens = int(embedding.shape[0])
    layers = info.num_deepstack_layers
    deepstack = item.get(DEEPSTACK_KEY)
    if layers and deepstack is None:
        raise InvalidItemError(
            f"item {index}: the served model emits {layers} deepstack layers, so a precomputed item "
            f"needs '{DEEPSTACK_KEY}' of shape [{layers}, {num_tokens}, {hidden}]"
        )
    if deepstack is not None:
        if not layers:
            raise InvalidItemError(
                f"item {index}: '{DEEPSTACK_KEY}' given, but the served model has no deepstack layers"
            )
        deepstack = _served_tensor(
            deepstack,
            f"item {index}: '{DEEPSTACK_KEY}'",
            (layers, num_tokens, hidden),
            f"[{layers}, {num_tokens}, {hidden}]",
            dtype,
        )
    fingerprint = item.get("weights_fingerprint")
    if fingerprint is not None and fingerprint != info.weights_fingerprint:
        raise InvalidItemError(
            f"item {index}: precomputed by weights {fingerprint[:16]}..., the encoders serve "
            f"{info.weights_fingerprint[:16]}...; its embedding belongs to another checkpoint"
        )
    return ItemResult(
        index=index,
        embedding=embedding,
        grid_thw=_checked_grid(
            item.get("grid_thw"), index, num_tokens, info.spatial_merge_size, info.extra_tokens_per_item
        ),
        encoder_url=None,
        deepstack=deepstack,
        precomputed=True,
    )


def _served_tensor(
    value: Any, what: str, shape: tuple[int | None, ...], expected: str, dtype: torch.dtype | None
) -> torch.Tensor:
    """`value` on the CPU in `dtype` (None: its own), after checking it is a finite float tensor of `shape`."""
    if not isinstance(value, torch.Tensor):
        raise InvalidItemError(f"{what} must be a torch.Tensor {expected}, got {type(value).__name__}")
    if not value.is_floating_point():
        raise InvalidItemError(f"{what} has dtype {value.dtype}; expected a floating-point tensor {expected}")
    if value.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(value.shape, shape)
    ):
        raise InvalidItemError(f"{what} has shape {list(value.shape)}; expected {expected}")
    if value.numel() == 0:
        raise InvalidItemError(
            f"{what} is empty (shape {list(value.shape)}); expected {expected} with num_tokens >= 1"
        )
    # Convert first: a finite float32 value can still overflow a float16 served dtype.
    served = value.detach().to(device="cpu", dtype=dtype or value.dtype)
    # NaN and inf propagate through a sum (inf - inf is NaN), so a finite sum proves every value finite
    # at a fraction of isfinite().all()'s cost; only a non-finite sum (maybe an overflow) needs the count.
    if not bool(torch.isfinite(served.sum(dtype=torch.float32))):
        bad = int((~torch.isfinite(served)).sum())
        if bad:
            overflow = "" if dtype in (None, value.dtype) else f", or out of the range of the served {dtype}"
            raise InvalidItemError(
                f"{what} has {bad} non-finite values (NaN or inf{overflow}); expected finite values"
            )
    return served


def _checked_grid(grid: Any, index: int, num_tokens: int, merge: int, extra_tokens: int) -> tuple[int, ...]:
    """The item's grid_thw; with a known spatial merge it must make `num_tokens`, counting `extra_tokens`."""
    if grid is None:
        return ()
    grid = tuple(int(x) for x in grid)
    if len(grid) != 3 or min(grid) < 1:
        raise InvalidItemError(
            f"item {index}: grid_thw {list(grid)} must be three positive patch counts (t, h, w)"
        )
    # ItemHeader.grid_thw is the patch grid before the merge: each merge x merge block is one token.
    if merge and math.prod(grid) / merge**2 + extra_tokens != num_tokens:
        extra = f" plus {extra_tokens} per item" if extra_tokens else ""
        raise InvalidItemError(
            f"item {index}: grid_thw {list(grid)} makes {math.prod(grid) / merge**2 + extra_tokens:g} tokens "
            f"after the {merge}x{merge} merge{extra}, but the precomputed embedding has {num_tokens} rows"
        )
    return grid
