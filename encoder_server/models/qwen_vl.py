"""Qwen2-VL and Qwen2.5-VL vision towers: dynamic-resolution patches, 2x2 spatial merge."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image
from transformers import PretrainedConfig
from transformers.initialization import no_init_weights

from protos.errors import TokenCountMismatchError

from .base import ImageEmbedding, ModelSpec, PreparedImage, VisionEncoder
from .loading import load_strict, read_vision_tensors
from .processors import load_image_processor, processor_fingerprint

VISUAL_PREFIXES = {"model.visual.": "", "visual.": ""}


def _tower_class(model_type: str) -> type:
    if model_type == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        return Qwen2VisionTransformerPretrainedModel
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    return Qwen2_5_VisionTransformerPretrainedModel


class QwenVisionEncoder(VisionEncoder):
    """Runs `visual(pixel_values, grid_thw)` exactly as the VLM's own get_image_features does."""

    def __init__(self, model_dir: Path, config: PretrainedConfig, device: torch.device, dtype: torch.dtype):
        vision_config = config.vision_config
        with no_init_weights():
            tower = _tower_class(config.model_type)._from_config(vision_config)
        tensors, fingerprint = read_vision_tensors(model_dir, VISUAL_PREFIXES, dtype)
        load_strict(tower, tensors, model_dir)
        self.tower = tower.to(device=device, dtype=dtype).eval()
        self.processor = load_image_processor(model_dir)
        self.merge_size = vision_config.spatial_merge_size
        self.spec = ModelSpec(
            family=config.model_type,
            model_type=config.model_type,
            hidden_size=_out_hidden_size(vision_config),
            dtype=dtype,
            device=device,
            patch_size=vision_config.patch_size,
            spatial_merge_size=self.merge_size,
            temporal_patch_size=vision_config.temporal_patch_size,
            num_deepstack_layers=0,
            weights_fingerprint=fingerprint,
            preprocess_fingerprint=processor_fingerprint(self.processor),
        )

    def preprocess(self, image: Image.Image) -> PreparedImage:
        out = self.processor(images=[image], return_tensors="pt")
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        return PreparedImage(
            pixel_values=out["pixel_values"],
            grid_thw=(t, h, w),
            num_tokens=t * h * w // self.merge_size**2,
            num_patches=int(out["pixel_values"].shape[0]),
        )

    @torch.inference_mode()
    def encode(self, batch: Sequence[PreparedImage]) -> list[ImageEmbedding]:
        device, dtype = self.spec.device, self.spec.dtype
        pixel_values = torch.cat([item.pixel_values for item in batch]).to(device=device, dtype=dtype)
        grid_thw = torch.tensor([item.grid_thw for item in batch], device=device)
        merged = self.tower(pixel_values, grid_thw=grid_thw).pooler_output
        return [ImageEmbedding(rows) for rows in split_by_tokens(merged, batch)]


def _out_hidden_size(vision_config: PretrainedConfig) -> int:
    # Qwen2-VL names the merger's output width `hidden_size` and its own width `embed_dim`.
    return getattr(vision_config, "out_hidden_size", None) or vision_config.hidden_size


def split_by_tokens(rows: torch.Tensor, batch: Sequence[PreparedImage]) -> list[torch.Tensor]:
    """Splits a batch's output rows per image, after checking the total against preprocessing.

    Copies to the CPU once for the whole batch.
    """
    expected = [item.num_tokens for item in batch]
    if rows.shape[0] != sum(expected):
        index = 0 if len(batch) == 1 else None
        raise TokenCountMismatchError(rows.shape[0], sum(expected), index)
    return list(rows.cpu().split(expected))
