"""Normalizes a request's items: the image-only rule, reading each image's bytes on this side, and a
request's items sorted into precomputed results and raw bytes before any Encode call."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from encoder_common.errors import InvalidItemError, UnsupportedModalityError
from encoder_common.sources import SourcePolicy, SourceReader

from .embeddings.result import ItemResult
from .fleet.served_model import ServedModel

# The keys an item may carry; anything else is a typo or a feature this receiver lacks, and
# guessing would send the wrong bytes. An item carrying its embedding may omit data and url.
PRECOMPUTED_KEYS = frozenset({"precomputed_embedding", "precomputed_deepstack", "grid_thw", "weights_fingerprint"})
ITEM_KEYS = frozenset({"modality", "data", "url"}) | PRECOMPUTED_KEYS


def modality_name(item: Mapping[str, Any]) -> str:
    """The item's modality as a lower-case name; items without one are images."""
    modality = item.get("modality", "image")
    if isinstance(modality, enum.Enum):
        modality = modality.name
    return str(modality).lower()


def check_items(items: Sequence[Mapping[str, Any]]) -> None:
    """The checks that come before any network call: every item a mapping, the image-only rule
    (UnsupportedModalityError listing every non-image modality, in item order), no unknown keys."""
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise InvalidItemError(f"item {index}: must be a mapping (dict), got {type(item).__name__}")
    non_image = [modality_name(item) for item in items if modality_name(item) != "image"]
    if non_image:
        raise UnsupportedModalityError(non_image)
    for index, item in enumerate(items):
        unknown = sorted(str(key) for key in item if key not in ITEM_KEYS)
        if unknown:
            raise InvalidItemError(f"item {index}: unknown keys {unknown}; an item may carry {sorted(ITEM_KEYS)}")


def local_reader(file_roots: Sequence[Path] | None) -> SourceReader:
    """The reader of a receiver's items: `data:` URIs and `file://` URLs under `file_roots` (None: any
    path), each at most SourcePolicy's max_fetch_bytes; http(s) is the caller's to fetch."""
    roots = (Path("/"),) if file_roots is None else tuple(file_roots)
    return SourceReader(SourcePolicy(file_roots=roots))


def read_image_bytes(item: Mapping[str, Any], index: int, file_roots: Sequence[Path] | None) -> bytes:
    """The encoded image bytes of an item given as `data` (bytes) or `url` (file:// or data:), read under
    `local_reader(file_roots)`."""
    data = item.get("data")
    url = item.get("url")
    if data is not None and url is not None:
        raise InvalidItemError(f"item {index}: has both 'data' and 'url'; give one")
    if data is not None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidItemError(f"item {index}: 'data' must be bytes, got {type(data).__name__}")
        return bytes(data)
    if url is None:
        raise InvalidItemError(f"item {index}: has neither 'data' nor 'url'")
    if not isinstance(url, str):
        raise InvalidItemError(f"item {index}: 'url' must be a string, got {type(url).__name__}")
    try:
        return local_reader(file_roots).read_local(url)
    except InvalidItemError as exc:
        raise InvalidItemError(f"item {index}: {exc}") from None


async def sort_items(
    served: ServedModel, items: Sequence[Mapping[str, Any]], file_roots: Sequence[Path] | None
) -> tuple[dict[int, ItemResult], dict[int, bytes]]:
    """The precomputed items' results, and the other items' image bytes, by index."""
    results = await served.precomputed_results(items)
    raw = [index for index in range(len(items)) if index not in results]

    def read() -> dict[int, bytes]:
        return {index: read_image_bytes(items[index], index, file_roots) for index in raw}

    if all(items[index].get("data") is not None for index in raw):  # nothing to read: no thread hop
        return results, read()
    return results, await asyncio.to_thread(read)
