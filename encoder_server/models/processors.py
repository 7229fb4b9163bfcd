"""The checkpoint's own image processor, loaded through transformers, and its cache fingerprint."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from transformers import AutoImageProcessor


def load_image_processor(model_dir: Path):
    """The checkpoint's processor: the torchvision variant where it imports, else the PIL one.

    transformers falls back to the PIL variants (`*ImageProcessorPil`) by itself when torchvision
    is missing or broken beside the installed torch; both produce the same pixel values.
    """
    return AutoImageProcessor.from_pretrained(str(model_dir))


def processor_fingerprint(processor) -> str:
    """sha256 over every processor setting, so cache keys change whenever preprocessing would."""
    settings = processor.to_dict()
    settings.pop("image_processor_type", None)  # the PIL and torchvision variants agree
    canonical = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()
