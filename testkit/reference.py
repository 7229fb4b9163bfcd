"""The ground truth for parity checks: the full VLM's own `get_image_features`, run in-process.

Used by the demo and the tests to show that what the service streams is what the model computes.
It loads the whole checkpoint, language model included: never use it in a pod.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


def reference_features(
    model_dir: Path,
    images: list[bytes],
    dtype: torch.dtype = torch.float32,
    adapt_model: Callable[[torch.nn.Module], None] | None = None,
):
    """The full VLM's own get_image_features on each image, run in-process: the ground truth.

    Each output's `.pooler_output` holds the image's embedding: a one-element list or tuple, or per
    tile or crop (`image_rows` regroups it); Qwen3-VL's `.deepstack_features` holds, per deepstack
    layer, a one-element tuple too.
    `adapt_model`, when given, is applied to the loaded model first (to reproduce a served variant).
    """
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from encoder_server.images import decode_image

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=dtype).eval()
    if adapt_model is not None:
        adapt_model(model)
    processor = AutoImageProcessor.from_pretrained(str(model_dir))
    outputs = []
    with torch.inference_mode():
        for data in images:
            inputs = processor(images=[decode_image(data)], return_tensors="pt")
            # Everything else the processor returns (Qwen's image_grid_thw; nothing for CLIP) goes along.
            pixel_values = inputs.pop("pixel_values").to(dtype)
            outputs.append(model.get_image_features(pixel_values=pixel_values, **inputs))
    return outputs


def image_rows(features) -> torch.Tensor:
    """One image's rows, [tokens, hidden], from its get_image_features output: its per-tile (InternVL) or
    per-crop (Gemma 3) blocks one after another, in the processor's order, as the engines place them."""
    pooled = features.pooler_output
    rows = pooled if isinstance(pooled, torch.Tensor) else torch.cat(list(pooled))
    return rows.reshape(-1, rows.shape[-1])
