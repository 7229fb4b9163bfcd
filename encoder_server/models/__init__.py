"""Vision towers by family, detected from the checkpoint's config.json."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from .base import ImageEmbedding, ModelSpec, PreparedImage, VisionEncoder
from .loading import CheckpointError


# Each family's module imports its transformers classes only when a checkpoint of it is loaded.
def _qwen_vl(model_dir: Path, config: PretrainedConfig, device: torch.device, dtype: torch.dtype) -> VisionEncoder:
    from .qwen_vl import QwenVisionEncoder

    return QwenVisionEncoder(model_dir, config, device, dtype)


def _qwen3_vl(model_dir: Path, config: PretrainedConfig, device: torch.device, dtype: torch.dtype) -> VisionEncoder:
    from .qwen3_vl import Qwen3VisionEncoder

    return Qwen3VisionEncoder(model_dir, config, device, dtype)


def _llava(model_dir: Path, config: PretrainedConfig, device: torch.device, dtype: torch.dtype) -> VisionEncoder:
    from .llava import LlavaVisionEncoder

    return LlavaVisionEncoder(model_dir, config, device, dtype)


# model_type in config.json -> loader
FAMILIES: dict[str, Callable[[Path, PretrainedConfig, torch.device, torch.dtype], VisionEncoder]] = {
    "qwen2_vl": _qwen_vl,
    "qwen2_5_vl": _qwen_vl,
    "qwen3_vl": _qwen3_vl,
    "llava": _llava,
}


def load_vision_encoder(model_dir: str | Path, device: str | torch.device, dtype: torch.dtype) -> VisionEncoder:
    """Loads the vision tower of the checkpoint in `model_dir`, and nothing of its language model."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise CheckpointError(f"{model_dir} has no config.json: not a Hugging Face checkpoint directory")
    # Read model_type first: transformers itself may not know an unsupported one.
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    loader = FAMILIES.get(model_type)
    if loader is None:
        raise CheckpointError(
            f"unsupported model_type {model_type!r} in {model_dir / 'config.json'}; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return loader(model_dir, AutoConfig.from_pretrained(str(model_dir)), torch.device(device), dtype)


__all__ = [
    "FAMILIES",
    "CheckpointError",
    "ImageEmbedding",
    "ModelSpec",
    "PreparedImage",
    "VisionEncoder",
    "load_vision_encoder",
]
