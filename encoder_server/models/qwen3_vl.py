"""Qwen3-VL vision tower: patch 16, 2x2 merge, and the deepstack features the prefill node needs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import ImageEmbedding, PreparedImage
from .qwen_vl import QwenVisionEncoder, split_by_tokens


class Qwen3VisionEncoder(QwenVisionEncoder):
    """Serves each image's merged embedding and its deepstack features, as get_image_features returns them.

    The deepstack features are one [num_tokens, hidden_size] tensor per deepstack layer (the
    config's `deepstack_visual_indexes`), which the language model adds to its first layers'
    hidden states at the image positions.
    """

    @staticmethod
    def tower_class(model_type: str) -> type:
        # The MoE checkpoints (Qwen3-VL-30B-A3B, ...) have the same tower under their own class.
        if model_type == "qwen3_vl_moe":
            from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

            return Qwen3VLMoeVisionModel
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel

    @torch.inference_mode()
    def encode(self, batch: Sequence[PreparedImage]) -> list[ImageEmbedding]:
        output = self.forward(batch)
        # [1 + layers, tokens, hidden]: one device-to-host copy and one split for everything.
        stacked = torch.stack([output.pooler_output, *output.deepstack_features])
        return [ImageEmbedding(piece[0], piece[1:]) for piece in split_by_tokens(stacked, batch)]
