"""Vision towers by family, detected from the checkpoint's config.json."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch
from transformers import AutoConfig

from encoder_common.families import BY_MODEL_TYPE

from .base import ImageEmbedding, ModelSpec, PreparedImage, VisionEncoder
from .loading import CheckpointError

# The model types the transformers backend serves (encoder_common/families.py says which module serves each).
SUPPORTED_MODEL_TYPES = sorted(t for t, family in BY_MODEL_TYPE.items() if family.tower is not None)


def load_vision_encoder(
    model_dir: str | Path, device: str | torch.device | None, dtype: torch.dtype
) -> VisionEncoder:
    """Loads the vision tower of the checkpoint in `model_dir`, and nothing of its language model,
    on `device` (None: cuda when present, else cpu)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise CheckpointError(f"{model_dir} has no config.json: not a Hugging Face checkpoint directory")
    # Read model_type first: transformers itself may not know an unsupported one.
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    family = BY_MODEL_TYPE.get(model_type)
    if family is None or family.tower is None:
        served_elsewhere = "; the vLLM backend serves it (--backend vllm)" if family is not None else ""
        raise CheckpointError(
            f"unsupported model_type {model_type!r} in {model_dir / 'config.json'}{served_elsewhere}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    # A family's module (and the transformers classes it uses) is imported only when a checkpoint of it loads.
    module, name = family.tower.rsplit(".", 1)
    encoder_class = getattr(importlib.import_module(f".{module}", __name__), name)
    return encoder_class(model_dir, AutoConfig.from_pretrained(str(model_dir)), torch.device(device), dtype)


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "CheckpointError",
    "ImageEmbedding",
    "ModelSpec",
    "PreparedImage",
    "VisionEncoder",
    "load_vision_encoder",
]
