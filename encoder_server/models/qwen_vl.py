"""Qwen2-VL and Qwen2.5-VL vision towers: dynamic-resolution patches, 2x2 spatial merge."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image
from transformers import PretrainedConfig

from encoder_common.errors import TokenCountMismatchError

from .base import ImageEmbedding, ModelSpec, PreparedImage, VisionEncoder
from .kernels import use_engine_kernels
from .loading import CheckpointError, load_vision_module
from ..profiles import DEFAULT_PROFILE, PROFILES, PreprocessProfile
from .processors import ImageProcessors, fused_normalize, processor_fingerprint

# transformers 5.x saves `visual.*` for Qwen2/2.5-VL and `model.visual.*` for Qwen3-VL; hub
# checkpoints of each family use either.
VISUAL_PREFIXES = {"model.visual.": "", "visual.": ""}


class QwenVisionEncoder(VisionEncoder):
    """Runs `visual(pixel_values, grid_thw)` as the VLM's own get_image_features does, on engine kernels."""

    def __init__(self, model_dir: Path, config: PretrainedConfig, device: torch.device, dtype: torch.dtype):
        vision_config = config.vision_config
        tower_class = self.tower_class(config.model_type)
        self.tower, fingerprint = load_vision_module(
            lambda: tower_class._from_config(vision_config, dtype=dtype),
            model_dir,
            VISUAL_PREFIXES,
            device,
            dtype,
        )
        use_engine_kernels(self.tower)  # what vLLM runs for the same weights: see kernels.py
        self.processors = ImageProcessors(model_dir)
        _check_processor_matches_tower(self.processors.default, vision_config, model_dir)
        self.merge_size = vision_config.spatial_merge_size
        self.spec = ModelSpec(
            family=config.model_type.removesuffix("_moe"),  # a MoE language model does not change the tower
            model_type=config.model_type,
            hidden_size=_out_hidden_size(vision_config),
            dtype=dtype,
            device=device,
            patch_size=vision_config.patch_size,
            spatial_merge_size=self.merge_size,
            temporal_patch_size=vision_config.temporal_patch_size,
            num_deepstack_layers=len(getattr(vision_config, "deepstack_visual_indexes", None) or ()),
            weights_fingerprint=fingerprint,
            preprocess_fingerprint=processor_fingerprint(self.processors.default),
        )

    @staticmethod
    def tower_class(model_type: str) -> type:
        if model_type == "qwen2_vl":
            from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

            return Qwen2VisionTransformerPretrainedModel
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        return Qwen2_5_VisionTransformerPretrainedModel

    def preprocess(self, image: Image.Image, profile: PreprocessProfile = PROFILES[DEFAULT_PROFILE]) -> PreparedImage:
        processor = self.processors[profile.backend]
        if profile.fused_normalize:
            out = processor(images=[image], return_tensors="pt", do_rescale=False, do_normalize=False)
            pixel_values = fused_normalize(processor, out["pixel_values"])
        else:
            out = processor(images=[image], return_tensors="pt")
            pixel_values = out["pixel_values"]
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        return PreparedImage(
            pixel_values=pixel_values,
            grid_thw=(t, h, w),
            num_tokens=t * h * w // self.merge_size**2,
            num_patches=int(pixel_values.shape[0]),
        )

    def forward(self, batch: Sequence[PreparedImage]):
        """The tower's output for the batch's patches, concatenated as the VLM concatenates them."""
        device, dtype = self.spec.device, self.spec.dtype
        pixel_values = torch.cat([item.pixel_values for item in batch]).to(device=device, dtype=dtype)
        grid_thw = torch.tensor([item.grid_thw for item in batch], device=device)
        return self.tower(pixel_values, grid_thw=grid_thw)

    @torch.inference_mode()
    def encode(self, batch: Sequence[PreparedImage]) -> list[ImageEmbedding]:
        merged = self.forward(batch).pooler_output
        return [ImageEmbedding(rows) for rows in split_by_tokens(merged, batch)]


def _check_processor_matches_tower(processor, vision_config: PretrainedConfig, model_dir: Path) -> None:
    """A processor cut for another patch grid would make every image fail its token count: refuse it now."""
    for processor_name, tower_name in (
        ("patch_size", "patch_size"),
        ("merge_size", "spatial_merge_size"),
        ("temporal_patch_size", "temporal_patch_size"),
    ):
        cut, expected = getattr(processor, processor_name, None), getattr(vision_config, tower_name)
        if cut is not None and cut != expected:
            raise CheckpointError(
                f"{model_dir}: preprocessor_config.json has {processor_name} {cut}, "
                f"but the vision tower's {tower_name} is {expected}"
            )


def _out_hidden_size(vision_config: PretrainedConfig) -> int:
    # Qwen2-VL names the merger's output width `hidden_size` and its own width `embed_dim`.
    return getattr(vision_config, "out_hidden_size", None) or vision_config.hidden_size


def split_by_tokens(rows: torch.Tensor, batch: Sequence[PreparedImage]) -> list[torch.Tensor]:
    """Splits a batch's output per image along the token axis (dim -2), after checking the total.

    `rows` is [tokens, hidden] or [layers, tokens, hidden]. Copies to the CPU once for the whole
    batch; each image's piece is made contiguous so that it goes on the wire without another copy.
    """
    expected = [item.num_tokens for item in batch]
    if rows.shape[-2] != sum(expected):
        raise TokenCountMismatchError(rows.shape[-2], sum(expected))
    return [piece.contiguous() for piece in rows.cpu().split(expected, dim=-2)]
