"""The contract every vision-tower family implements: preprocess one image, encode a batch."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version

import torch
from PIL import Image

from ..profiles import DEFAULT_PROFILE, PROFILES, PreprocessProfile


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What a loaded tower serves; the server's ModelInfo RPC reports it."""

    family: str
    model_type: str
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    num_deepstack_layers: int
    weights_fingerprint: str
    # Every image-processor setting that changes the output, canonicalized: part of cache keys.
    preprocess_fingerprint: str
    # Tokens per item beyond grid_thw's merged patches (LLaVA's "full" strategy keeps the CLS token).
    extra_tokens_per_item: int = 0
    # Whose code runs the tower and preprocessing ("transformers", or "vllm": models/vllm_backend.py) and
    # its release; both are part of cache keys, since two backends' embeddings of one image may differ.
    backend: str = "transformers"
    backend_version: str = field(default_factory=lambda: version("transformers"))


@dataclass(frozen=True)
class PreparedImage:
    """One image after the checkpoint's own image processor, ready for the tower."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]  # patch grid before merging; (tiles, rows, columns) for tiled towers
    num_tokens: int  # what the tower must produce for this image
    num_patches: int  # patches the tower runs over for this image: the forward's cost unit
    # What the tower's call takes per image besides the pixels (LLaVA-NeXT's image_sizes), one row each.
    tower_inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)
    # (width, height) of the image as loaded, which the item's header reports; set by the server's pipeline.
    image_size: tuple[int, int] | None = None


@dataclass(frozen=True)
class ImageEmbedding:
    """One image's output: LLM-space embedding rows, plus deepstack features where the family has them."""

    embedding: torch.Tensor  # [num_tokens, hidden_size]
    deepstack: torch.Tensor | None = None  # [num_deepstack_layers, num_tokens, hidden_size]


class VisionEncoder(abc.ABC):
    """A loaded vision tower (and projector) of one checkpoint, on one device and dtype.

    `preprocess` runs on CPU worker threads and is safe to call concurrently; `encode` runs one
    forward for a batch, on one thread at a time.
    """

    spec: ModelSpec

    @abc.abstractmethod
    def preprocess(self, image: Image.Image, profile: PreprocessProfile = PROFILES[DEFAULT_PROFILE]) -> PreparedImage:
        """Runs the checkpoint's image processor on one RGB image as the profile's engine runs it
        (its backend, and where it normalizes)."""

    @abc.abstractmethod
    def encode(self, batch: Sequence[PreparedImage]) -> list[ImageEmbedding]:
        """One forward pass over the batch; outputs are on the CPU, in the served dtype.

        Raises TokenCountMismatchError when the tower's output does not match the images'
        `num_tokens`; the batcher then encodes the batch's items one by one to fail only the
        item at fault, so the error does not name a batch position.
        """
