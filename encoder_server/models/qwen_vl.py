"""The Qwen-VL towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, and their MoE checkpoints): dynamic-resolution
patches, a 2x2 spatial merge, and for Qwen3-VL the deepstack features the prefill node needs."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

from .base import PreparedImage
from .kernels import use_engine_kernels
from .loading import CheckpointError
from .tower import Geometry, Tower

# model_type -> the tower class of transformers (module, class); a MoE language model keeps its
# family's tower, under a class of its own.
TOWERS = {
    "qwen2_vl": ("qwen2_vl.modeling_qwen2_vl", "Qwen2VisionTransformerPretrainedModel"),
    "qwen2_5_vl": ("qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel"),
    "qwen3_vl": ("qwen3_vl.modeling_qwen3_vl", "Qwen3VLVisionModel"),
    "qwen3_vl_moe": ("qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeVisionModel"),
    "qwen3_5": ("qwen3_5.modeling_qwen3_5", "Qwen3_5VisionModel"),
    "qwen3_5_moe": ("qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeVisionModel"),
}


class QwenVL(Tower):
    """Runs `visual(pixel_values, grid_thw)` as the VLM's own get_image_features does, on engine kernels.

    Qwen3-VL's deepstack features are one [num_tokens, hidden_size] tensor per deepstack layer (the
    config's `deepstack_visual_indexes`), which the language model adds to its first layers' hidden
    states at the image positions.
    """

    # transformers 5.x saves `visual.*` for Qwen2/2.5-VL and `model.visual.*` for Qwen3-VL and Qwen3.5;
    # hub checkpoints of each family use either.
    prefixes = {"model.visual.": "", "visual.": ""}
    fused_normalize = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        use_engine_kernels(self.tower)  # what vLLM runs for the same weights: see kernels.py

    def build(self, config: PretrainedConfig) -> nn.Module:
        module, name = TOWERS[config.model_type]
        tower_class = getattr(importlib.import_module(f"transformers.models.{module}"), name)
        return tower_class._from_config(config.vision_config, dtype=torch.get_default_dtype())

    def geometry(self) -> Geometry:
        vision = self.config.vision_config
        return Geometry(
            # Qwen2-VL names the merger's output width `hidden_size` and its own width `embed_dim`.
            hidden_size=getattr(vision, "out_hidden_size", None) or vision.hidden_size,
            patch_size=vision.patch_size,
            spatial_merge_size=vision.spatial_merge_size,
            temporal_patch_size=vision.temporal_patch_size,
            num_deepstack_layers=len(getattr(vision, "deepstack_visual_indexes", None) or ()),
        )

    def check_processor(self, processor) -> None:
        """A processor cut for another patch grid would make every image fail its token count: refuse it now."""
        vision = self.config.vision_config
        for processor_name, tower_name in (
            ("patch_size", "patch_size"),
            ("merge_size", "spatial_merge_size"),
            ("temporal_patch_size", "temporal_patch_size"),
        ):
            cut, expected = getattr(processor, processor_name, None), getattr(vision, tower_name)
            if cut is not None and cut != expected:
                raise CheckpointError(
                    f"{self.model_dir}: preprocessor_config.json has {processor_name} {cut}, "
                    f"but the vision tower's {tower_name} is {expected}"
                )

    def prepared(self, pixel_values: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> PreparedImage:
        t, h, w = (int(x) for x in inputs["image_grid_thw"][0])
        return PreparedImage(
            pixel_values=pixel_values,
            grid_thw=(t, h, w),
            num_tokens=t * h * w // self.config.vision_config.spatial_merge_size**2,
            num_patches=int(pixel_values.shape[0]),
        )

    def forward(self, pixel_values: torch.Tensor, batch: Sequence[PreparedImage]) -> torch.Tensor:
        grid_thw = torch.tensor([item.grid_thw for item in batch], device=pixel_values.device)
        output = self.tower(pixel_values, grid_thw=grid_thw)
        deepstack = getattr(output, "deepstack_features", None)
        if not deepstack:
            return output.pooler_output
        # [1 + layers, tokens, hidden]: one device-to-host copy and one split for everything.
        return torch.stack([output.pooler_output, *deepstack])
