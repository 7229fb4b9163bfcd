"""The checkpoint's own image processor, loaded through transformers per backend, and its fingerprint."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import torch
from transformers import AutoImageProcessor

DEFAULT_BACKEND = "torchvision"  # what transformers picks beside torchvision, as vLLM and SGLang run it


class ImageProcessors:
    """The checkpoint's image processor per backend ("torchvision", "pil"), each loaded once, on first use.

    The two backends agree on the 28 px grid and differ off it (their resizes differ), so the backend
    is a profile's choice (encoder_server/profiles.py), never left to what happens to be installed.
    """

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self._loaded: dict[str, object] = {}
        self._lock = threading.Lock()
        self.default = self[DEFAULT_BACKEND]  # loaded now: a broken preprocessor config fails at start-up

    def __getitem__(self, backend: str):
        processor = self._loaded.get(backend)
        if processor is None:
            with self._lock:  # preprocessing threads may ask at once
                processor = self._loaded.get(backend)
                if processor is None:
                    processor = AutoImageProcessor.from_pretrained(str(self.model_dir), backend=backend)
                    self._loaded[backend] = processor
        return processor


def fused_normalize(processor, raw_pixel_values: torch.Tensor) -> torch.Tensor:
    """vLLM's device-side normalization of Qwen patches ([patches, channels * rest], unrescaled): one
    float32 affine step per channel, x * (rescale / std) + (-mean / std), with the processor's own
    settings; the processor's rescale-then-normalize gives values a last bit apart."""
    rescale = processor.rescale_factor if processor.do_rescale else 1.0
    channels = len(processor.image_mean)
    normalize = processor.do_normalize
    mean = torch.tensor(processor.image_mean if normalize else [0.0] * channels, dtype=torch.float32)
    std = torch.tensor(processor.image_std if normalize else [1.0] * channels, dtype=torch.float32)
    patches, size = raw_pixel_values.shape
    by_channel = raw_pixel_values.reshape(patches, channels, size // channels)
    normalized = by_channel * (rescale / std).view(1, channels, 1) + (-mean / std).view(1, channels, 1)
    return normalized.view(patches, size).to(torch.float32)


def processor_fingerprint(processor) -> str:
    """sha256 over every processor setting, so cache keys change whenever preprocessing would (the
    backend is the profile's, which the cache namespace holds beside this)."""
    settings = processor.to_dict()
    settings.pop("image_processor_type", None)
    canonical = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()
