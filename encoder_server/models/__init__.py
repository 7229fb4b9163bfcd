"""Vision towers by family, detected from the checkpoint's config.json."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch
from transformers import AutoConfig

from .base import ImageEmbedding, ModelSpec, PreparedImage, VisionEncoder
from .loading import CheckpointError

# model_type in config.json -> the class serving it, as "module.Class" of this package: a family's
# module (and the transformers classes it uses) is imported only when a checkpoint of it is loaded.
FAMILIES: dict[str, str] = {
    "qwen2_vl": "qwen_vl.QwenVisionEncoder",
    "qwen2_5_vl": "qwen_vl.QwenVisionEncoder",
    "qwen3_vl": "qwen3_vl.Qwen3VisionEncoder",
    "qwen3_vl_moe": "qwen3_vl.Qwen3VisionEncoder",
    "llava": "llava.LlavaVisionEncoder",
}


def load_vision_encoder(model_dir: str | Path, device: str | torch.device | None, dtype: torch.dtype) -> VisionEncoder:
    """Loads the vision tower of the checkpoint in `model_dir`, and nothing of its language model,
    on `device` (None: cuda when present, else cpu)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise CheckpointError(f"{model_dir} has no config.json: not a Hugging Face checkpoint directory")
    # Read model_type first: transformers itself may not know an unsupported one.
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    encoder_path = FAMILIES.get(model_type)
    if encoder_path is None:
        raise CheckpointError(
            f"unsupported model_type {model_type!r} in {model_dir / 'config.json'}; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    module, name = encoder_path.rsplit(".", 1)
    encoder_class = getattr(importlib.import_module(f".{module}", __name__), name)
    return encoder_class(model_dir, AutoConfig.from_pretrained(str(model_dir)), torch.device(device), dtype)


__all__ = [
    "FAMILIES",
    "CheckpointError",
    "ImageEmbedding",
    "ModelSpec",
    "PreparedImage",
    "VisionEncoder",
    "load_vision_encoder",
]
