"""LLaVA-1.5 style towers: a CLIP-like vision model, a feature layer, and the multi-modal projector.

The embeddings are in the language model's space (after the projector), one fixed-size block of
tokens per image, exactly as `LlavaModel.get_image_features` computes them. Each item's grid_thw
is reported as (1, rows, columns) of the tower's patch grid; with the "full" feature-select
strategy the item has one token more than rows * columns (the CLS token is kept).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image
from torch import nn
from transformers import AutoModel, PretrainedConfig

from encoder_common.errors import TokenCountMismatchError

from .base import ImageEmbedding, ModelSpec, PreparedImage, VisionEncoder
from .loading import load_vision_module, settings_fingerprint
from ..profiles import DEFAULT_PROFILE, PROFILES, PreprocessProfile
from .processors import ImageProcessors, processor_fingerprint

# llava-hf checkpoints store `vision_tower.vision_model.*` and `multi_modal_projector.*`;
# transformers 5.x saves `vision_tower.*` (it dropped the CLIP wrapper's `vision_model.` level)
# and holds `model.vision_tower.*` in memory.
LLAVA_PREFIXES = {
    "model.vision_tower.vision_model.": "vision_tower.",
    "vision_tower.vision_model.": "vision_tower.",
    "model.vision_tower.": "vision_tower.",
    "vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}


class LlavaVision(nn.Module):
    """The vision tower and projector of a LLaVA checkpoint, under the VLM's own attribute names."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        super().__init__()
        self.vision_tower = AutoModel.from_config(config.vision_config, dtype=dtype)
        self.multi_modal_projector = LlavaMultiModalProjector(config).to(dtype)
        self.feature_layer: int | list[int] = config.vision_feature_layer
        self.select_strategy: str = config.vision_feature_select_strategy

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, tokens, text hidden size]: the selected layers' hidden states, projected.

        The CLS token is dropped for the "default" strategy and kept for "full".
        """
        # Asking for the selected layers only, as get_image_features does, keeps the others unstored.
        outputs = self.vision_tower(pixel_values, output_hidden_states=self.feature_layer, return_dict=True)
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else self.feature_layer
        selected = [outputs.hidden_states[layer] for layer in layers]
        if self.select_strategy == "default":
            selected = [hidden[:, 1:] for hidden in selected]
        return self.multi_modal_projector(torch.cat(selected, dim=-1))


class LlavaVisionEncoder(VisionEncoder):
    """Serves `get_image_features` of a LLaVA checkpoint: a fixed number of tokens per image."""

    def __init__(self, model_dir: Path, config: PretrainedConfig, device: torch.device, dtype: torch.dtype):
        self.model, weights = load_vision_module(
            lambda: LlavaVision(config, dtype), model_dir, LLAVA_PREFIXES, device, dtype
        )
        self.processors = ImageProcessors(model_dir)
        vision_config = config.vision_config
        self.patch_size = vision_config.patch_size
        self.extra_tokens = 0 if config.vision_feature_select_strategy == "default" else 1
        self.spec = ModelSpec(
            family="llava",
            model_type=config.model_type,
            hidden_size=config.text_config.hidden_size,
            dtype=dtype,
            device=device,
            patch_size=self.patch_size,
            spatial_merge_size=1,
            temporal_patch_size=1,
            num_deepstack_layers=0,
            # The same weights read at another layer, or with the CLS token, are other embeddings.
            weights_fingerprint=settings_fingerprint(
                weights,
                {
                    "vision_feature_layer": config.vision_feature_layer,
                    "vision_feature_select_strategy": config.vision_feature_select_strategy,
                    "projector_hidden_act": config.projector_hidden_act,
                },
            ),
            preprocess_fingerprint=processor_fingerprint(self.processors.default),
            extra_tokens_per_item=self.extra_tokens,
        )

    def preprocess(self, image: Image.Image, profile: PreprocessProfile = PROFILES[DEFAULT_PROFILE]) -> PreparedImage:
        # vLLM normalizes LLaVA's pixels in its processor, not on the device: no fused step here.
        pixel_values = self.processors[profile.backend](images=[image], return_tensors="pt")["pixel_values"]
        rows, columns = (int(side) // self.patch_size for side in pixel_values.shape[-2:])
        return PreparedImage(
            pixel_values=pixel_values,
            grid_thw=(1, rows, columns),
            num_tokens=rows * columns + self.extra_tokens,
            num_patches=rows * columns,
        )

    @torch.inference_mode()
    def encode(self, batch: Sequence[PreparedImage]) -> list[ImageEmbedding]:
        device, dtype = self.spec.device, self.spec.dtype
        pixel_values = torch.cat([item.pixel_values for item in batch]).to(device=device, dtype=dtype)
        features = self.model(pixel_values).cpu()
        for item in batch:
            if features.shape[1] != item.num_tokens:
                raise TokenCountMismatchError(features.shape[1], item.num_tokens)
        return [ImageEmbedding(rows) for rows in features]
