"""LLaVA-1.5 style towers: a CLIP-like vision model, a feature layer and the multi-modal projector."""

from __future__ import annotations

from transformers import PretrainedConfig

from .tower import Geometry, TiledTower


def feature_settings(config: PretrainedConfig) -> dict[str, object]:
    """The LLaVA settings that make other embeddings of the same weights."""
    return {
        "vision_feature_layer": config.vision_feature_layer,
        "vision_feature_select_strategy": config.vision_feature_select_strategy,
        "projector_hidden_act": config.projector_hidden_act,
    }


class Llava(TiledTower):
    """Serves `LlavaModel.get_image_features`: a fixed number of tokens per image, in the language model's
    space. grid_thw is (1, rows, columns) of the tower's patch grid; with the "full" feature-select
    strategy the item has one token more than rows * columns (the CLS token is kept)."""

    model_class = "llava.modeling_llava.LlavaModel"
    projector_class = "llava.modeling_llava.LlavaMultiModalProjector"

    def settings(self) -> dict[str, object]:
        return feature_settings(self.config)

    def geometry(self) -> Geometry:
        return Geometry(
            hidden_size=self.config.text_config.hidden_size,
            patch_size=self.config.vision_config.patch_size,
            spatial_merge_size=1,
            extra_tokens_per_item=0 if self.config.vision_feature_select_strategy == "default" else 1,
        )
