"""Loading embeddings `encoder-precompute` wrote: one safetensors file per image, named by the sha256 of
its bytes, turned back into a precomputed item. Needs only the receiver's dependencies."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from encoder_common.errors import InvalidItemError

from .precomputed import DEEPSTACK_KEY, PRECOMPUTED_KEY

FORMAT = "encoder-precompute/1"


def content_key(data: bytes) -> str:
    """The file key of an image: sha256 over its encoded bytes, in hex."""
    return hashlib.sha256(data).hexdigest()


def output_path(out_dir: str | Path, key: str) -> Path:
    return Path(out_dir) / f"{key}.safetensors"


def read_metadata(path: Path) -> dict[str, str]:
    """The file's metadata (grid_thw and the model stamp), after checking it is one of ours."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if metadata.get("format") != FORMAT:
        raise InvalidItemError(f"{path} is not an {FORMAT} file")
    return metadata


def load_precomputed(path: str | Path) -> dict[str, Any]:
    """A precomputed item from one file, with the grid_thw and weights fingerprint the receiver checks."""
    path = Path(path)
    try:
        metadata = read_metadata(path)
        with safe_open(str(path), framework="pt") as f:
            item = {
                "modality": "image",
                PRECOMPUTED_KEY: f.get_tensor("embedding"),
                "grid_thw": tuple(json.loads(metadata["grid_thw"])),
                "weights_fingerprint": metadata["weights_fingerprint"],
            }
            if "deepstack" in f.keys():
                item[DEEPSTACK_KEY] = f.get_tensor("deepstack")
    except (SafetensorError, OSError, KeyError, ValueError) as exc:
        raise InvalidItemError(f"cannot load precomputed embedding {path}: {exc}") from None
    return item


def precomputed_item(cache_dir: str | Path, data: bytes) -> dict[str, Any]:
    """The item for these image bytes: precomputed when `cache_dir` holds their file, raw otherwise."""
    path = output_path(cache_dir, content_key(data))
    return load_precomputed(path) if path.exists() else {"modality": "image", "data": data}
