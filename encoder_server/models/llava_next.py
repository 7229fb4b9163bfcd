"""LLaVA-NeXT (1.6) and LLaVA-OneVision: AnyRes tiles of the image plus the whole image, through a CLIP or
SigLIP tower and the projector, unpadded to the image's aspect ratio with `image_newline` after each row."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from transformers import AutoModel, PretrainedConfig

from .base import PreparedImage
from .llava import feature_settings
from .tower import TOWER_AND_PROJECTOR, Geometry, Tower, rows_of, vision_parts

# model_type -> the module of transformers holding its model and projector classes, and their prefix
MODELS = {
    "llava_next": ("llava_next.modeling_llava_next", "LlavaNext"),
    "llava_onevision": ("llava_onevision.modeling_llava_onevision", "LlavaOnevision"),
}


class LlavaNext(Tower):
    """Serves `LlavaNextModel.get_image_features` / `LlavaOnevisionModel.get_image_features`, per image
    (OneVision pools the tiles' features down past `anyres_max_9`).

    An image's token count depends on its size, tile grid and the packing: the model's own
    `pack_image_features` counts it, run on one channel of zeros, before the forward. grid_thw is (tiles,
    rows, columns) of the tower's patch grid per tile; ModelInfo's spatial_merge_size is 0, since the
    token count is not the grid's.
    """

    prefixes = {
        **TOWER_AND_PROJECTOR,
        "model.image_newline": "image_newline",
        "image_newline": "image_newline",
    }

    def build(self, config: PretrainedConfig) -> nn.Module:
        module, prefix = MODELS[config.model_type]
        classes = importlib.import_module(f"transformers.models.{module}")

        def parts(model: nn.Module) -> None:
            model.vision_tower = AutoModel.from_config(config.vision_config)
            model.multi_modal_projector = getattr(classes, f"{prefix}MultiModalProjector")(config)
            model.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size))

        return vision_parts(getattr(classes, f"{prefix}Model"), config, parts)

    def settings(self) -> dict[str, object]:
        return {
            **feature_settings(self.config),
            "image_grid_pinpoints": self.config.image_grid_pinpoints,
            "vision_aspect_ratio": getattr(self.config, "vision_aspect_ratio", None),
        }

    @property
    def tile_side(self) -> int:
        """Patches per side of one tile."""
        vision = self.config.vision_config
        return vision.image_size // vision.patch_size

    def geometry(self) -> Geometry:
        return Geometry(
            hidden_size=self.config.text_config.hidden_size,
            patch_size=self.config.vision_config.patch_size,
            spatial_merge_size=0,
        )

    def prepared(self, pixel_values: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> PreparedImage:
        tiles = pixel_values[0]  # [tiles, channels, side, side]: the whole image first, then the AnyRes tiles
        image_sizes = inputs["image_sizes"]
        side = self.tile_side
        return PreparedImage(
            pixel_values=tiles,
            grid_thw=(int(tiles.shape[0]), side, side),
            num_tokens=self.count_tokens(int(tiles.shape[0]), image_sizes),
            num_patches=int(tiles.shape[0]) * side * side,
            tower_inputs={"image_sizes": image_sizes},
        )

    def count_tokens(self, tiles: int, image_sizes: torch.Tensor) -> int:
        """The image's token count as the model's own packing makes it, on one channel instead of the features."""
        # One channel of real (CPU) zeros: the packing's interpolation runs its C++ kernel on a few KiB, where
        # on meta tensors it would go through torch's Python decomposition (~6 ms an image).
        shapes = torch.zeros((tiles, self.tile_side**2, 1))
        newline = torch.zeros(1)
        if self.config.model_type == "llava_onevision":
            packed, _ = self.tower.pack_image_features(
                [shapes],
                image_sizes,
                image_newline=newline,
                vision_aspect_ratio=self.config.vision_aspect_ratio,
            )
        else:
            packed, _ = self.tower.pack_image_features(
                [shapes], image_sizes, self.config.vision_feature_select_strategy, image_newline=newline
            )
        return int(packed[0].shape[0])

    def forward(self, pixel_values: torch.Tensor, batch: Sequence[PreparedImage]) -> torch.Tensor:
        features = self.tower.get_image_features(pixel_values, self.batch_input(batch, "image_sizes"))
        return rows_of(features.pooler_output, self.spec.hidden_size)
