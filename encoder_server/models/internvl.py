"""InternVL 3 / 3.5 in the Hugging Face format (`InternVLForConditionalGeneration`): 448 px tiles,
each one's patches pixel-shuffled and projected."""

from __future__ import annotations

from .loading import CheckpointError
from .tower import Geometry, TiledTower


def _side(value) -> int:
    """InternVL's vision config gives sizes as [height, width]; its tiles are square."""
    return value if isinstance(value, int) else value[0]


class InternVL(TiledTower):
    """Serves `InternVLModel.get_image_features`: per image, its tiles' blocks in the processor's order.

    The processor cuts an image into tiles on the grid nearest its aspect ratio, plus a thumbnail of the
    whole image when there are several; each tile's patches (CLS dropped) are pixel-shuffled by
    `downsample_ratio` (0.5: 2x2 patches per token, 256 tokens per tile). grid_thw is (tiles, patches per
    side, patches per side), and the spatial merge is the pixel shuffle's.
    """

    model_class = "internvl.modeling_internvl.InternVLModel"
    projector_class = "internvl.modeling_internvl.InternVLMultiModalProjector"

    @property
    def patch_size(self) -> int:
        return _side(self.config.vision_config.patch_size)

    def settings(self) -> dict[str, object]:
        return {
            "vision_feature_layer": self.config.vision_feature_layer,
            "downsample_ratio": self.config.downsample_ratio,
            "projector_hidden_act": self.config.projector_hidden_act,
        }

    def geometry(self) -> Geometry:
        if self.config.vision_feature_select_strategy != "default":
            # The pixel shuffle needs a square of patches: the CLS token must go.
            raise CheckpointError(
                f"{self.model_dir}: InternVL with vision_feature_select_strategy "
                f"{self.config.vision_feature_select_strategy!r} is not served; its tiles need 'default'"
            )
        return Geometry(
            hidden_size=self.config.text_config.hidden_size,
            patch_size=self.patch_size,
            spatial_merge_size=round(1 / self.config.downsample_ratio),
        )
