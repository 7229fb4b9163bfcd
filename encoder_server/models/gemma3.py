"""Gemma 3's tower: SigLIP at one fixed size, patches average-pooled to `mm_tokens_per_image`, projected."""

from __future__ import annotations

from .tower import Geometry, TiledTower


class Gemma3(TiledTower):
    """Serves `Gemma3Model.get_image_features`: per image, its blocks (whole image, then crops) in order.

    The image is taken at one fixed size (896 px in the released checkpoints); with pan-and-scan on in the
    processor, a long image also gives crops, each a block of the same size: grid_thw is (1 + crops,
    patches per side, patches per side), and the spatial merge is the pooling's kernel.
    """

    model_class = "gemma3.modeling_gemma3.Gemma3Model"
    projector_class = "gemma3.modeling_gemma3.Gemma3MultiModalProjector"

    def geometry(self) -> Geometry:
        vision = self.config.vision_config
        patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(self.config.mm_tokens_per_image**0.5)
        return Geometry(
            hidden_size=self.config.text_config.hidden_size,
            patch_size=vision.patch_size,
            spatial_merge_size=patches_per_side // tokens_per_side,
        )
