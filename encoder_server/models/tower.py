"""`Tower`, the shared work of every family on the transformers backend (vision weights, the image processor
per profile, the pixel batch, the output split per image, the ModelSpec), which a family module subclasses."""

from __future__ import annotations

import abc
import contextlib
import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from PIL import Image
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from encoder_common.errors import TokenCountMismatchError
from encoder_common.families import BY_MODEL_TYPE

from ..profiles import DEFAULT_PROFILE, PROFILES, PreprocessProfile
from .base import ImageEmbedding, ModelSpec, PreparedImage, VisionEncoder
from .loading import load_vision_module, settings_fingerprint
from .processors import ImageProcessors, fused_normalize, processor_fingerprint


@dataclass(frozen=True, kw_only=True)
class Geometry:
    """The ModelSpec fields a family takes from its config."""

    hidden_size: int  # the language model's width: the rows' width
    patch_size: int
    spatial_merge_size: int  # 0: an image's token count is not its grid's (AnyRes packing)
    temporal_patch_size: int = 1
    num_deepstack_layers: int = 0
    extra_tokens_per_item: int = 0


class Tower(VisionEncoder):
    """A family's tower and projector loaded alone from a checkpoint, run as the full model runs them.

    A subclass says only what is its family's own: which checkpoint tensors are its tower and projector
    (`prefixes`, `build`), how the tower is called (`forward`), how many tokens an image gives and what the
    tower takes per image besides the pixels (`prepared`), and its geometry (`geometry`).
    """

    # Checkpoint tensor prefixes -> the prefixes of `build()`'s module (longest match wins).
    prefixes: Mapping[str, str]
    # vLLM rescales and normalizes this family's pixels on the device in one step (the "vllm" profile).
    fused_normalize = False

    def __init__(self, model_dir: Path, config: PretrainedConfig, device: torch.device, dtype: torch.dtype):
        self.config = config
        self.model_dir = model_dir
        # Built as from_pretrained builds the model: buffers keep the dtype it gives them.
        with default_dtype(dtype):
            self.tower, weights = load_vision_module(
                lambda: self.build(config), model_dir, self.prefixes, device, dtype
            )
        self.processors = ImageProcessors(model_dir)
        self.check_processor(self.processors.default)
        settings = self.settings()
        self.spec = ModelSpec(
            family=BY_MODEL_TYPE[config.model_type].name,
            model_type=config.model_type,
            dtype=dtype,
            device=device,
            # The same weights read at another layer, or with the CLS token, are other embeddings.
            weights_fingerprint=settings_fingerprint(weights, settings) if settings else weights,
            preprocess_fingerprint=processor_fingerprint(self.processors.default),
            **asdict(self.geometry()),
        )

    # ---- what a family says ----

    @abc.abstractmethod
    def build(self, config: PretrainedConfig) -> nn.Module:
        """The vision tower and projector, uninitialized (their weights come from the checkpoint)."""

    @abc.abstractmethod
    def geometry(self) -> Geometry: ...

    @abc.abstractmethod
    def prepared(self, pixel_values: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> PreparedImage:
        """One image from its processor output: `pixel_values` and the rest (`image_grid_thw`, ...)."""

    @abc.abstractmethod
    def forward(self, pixel_values: torch.Tensor, batch: Sequence[PreparedImage]) -> torch.Tensor:
        """The batch's rows, the images' one after another on dim -2: [tokens, hidden], or
        [1 + deepstack layers, tokens, hidden] where the family has deepstack features."""

    def settings(self) -> dict[str, object]:
        """Config settings that change the output for the same weights (folded into the fingerprint)."""
        return {}

    def check_processor(self, processor) -> None:
        """Refuses at start-up a processor that cannot feed this tower (every image would fail)."""

    # ---- the shared work ----

    def preprocess(
        self, image: Image.Image, profile: PreprocessProfile = PROFILES[DEFAULT_PROFILE]
    ) -> PreparedImage:
        processor = self.processors[profile.backend]
        if profile.fused_normalize and self.fused_normalize:
            inputs = dict(
                processor(images=[image], return_tensors="pt", do_rescale=False, do_normalize=False)
            )
            pixel_values = fused_normalize(processor, inputs.pop("pixel_values"))
        else:
            inputs = dict(processor(images=[image], return_tensors="pt"))
            pixel_values = inputs.pop("pixel_values")
        return self.prepared(pixel_values, inputs)

    @torch.inference_mode()
    def encode(self, batch: Sequence[PreparedImage]) -> list[ImageEmbedding]:
        device, dtype = self.spec.device, self.spec.dtype
        pixel_values = torch.cat([item.pixel_values for item in batch]).to(device=device, dtype=dtype)
        pieces = split_by_tokens(self.forward(pixel_values, batch), batch)
        return [ImageEmbedding(p) if p.dim() == 2 else ImageEmbedding(p[0], p[1:]) for p in pieces]

    def batch_input(self, batch: Sequence[PreparedImage], name: str) -> torch.Tensor:
        """One of the tower's per-image inputs for the whole batch, on the device."""
        return torch.cat([item.tower_inputs[name] for item in batch]).to(self.spec.device)


def rows_of(pooler_output: torch.Tensor | Sequence[torch.Tensor], hidden_size: int) -> torch.Tensor:
    """get_image_features' `pooler_output` as rows: per image or per tile/crop, listed or stacked."""
    if not isinstance(pooler_output, torch.Tensor):
        pooler_output = torch.cat(list(pooler_output))
    return pooler_output.reshape(-1, hidden_size)


def split_by_tokens(rows: torch.Tensor, batch: Sequence[PreparedImage]) -> list[torch.Tensor]:
    """Splits a batch's output per image along the token axis (dim -2), after checking the total.

    `rows` is [tokens, hidden] or [layers, tokens, hidden]. Copies to the CPU once for the whole
    batch; each image's piece is made contiguous so that it goes on the wire without another copy.
    """
    expected = [item.num_tokens for item in batch]
    if rows.shape[-2] != sum(expected):
        raise TokenCountMismatchError(rows.shape[-2], sum(expected))
    return [piece.contiguous() for piece in rows.cpu().split(expected, dim=-2)]


def vision_parts(
    model_class: type, config: PretrainedConfig, parts: Callable[[nn.Module], None]
) -> nn.Module:
    """An instance of the VLM's own model class (LlavaModel, Gemma3Model, ...) holding only the modules
    `parts` sets on it (tower, projector, ...): its own get_image_features then runs on them, while its
    __init__, which would build the language model, never runs."""
    model = model_class.__new__(model_class)
    PreTrainedModel.__init__(
        model, config
    )  # the config and attention settings, as the model's own init sets them
    parts(model)
    return model


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# The names most VLMs (LLaVA and its kin, Gemma 3, InternVL, ...) give their tower and projector: llava-hf
# checkpoints store `vision_tower.vision_model.*` and `multi_modal_projector.*`; transformers 5.x saves
# `vision_tower.*` (it dropped the CLIP/SigLIP wrapper's `vision_model.` level) and holds
# `model.vision_tower.*` in memory.
TOWER_AND_PROJECTOR = {
    "model.vision_tower.vision_model.": "vision_tower.",
    "vision_tower.vision_model.": "vision_tower.",
    "model.vision_tower.": "vision_tower.",
    "vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}


class TiledTower(Tower):
    """A family whose processor cuts an image into fixed-size tiles (or crops: one, for LLaVA-1.5), each a
    fixed block of tokens: pixel_values [tiles, channels, side, side], and the VLM's own
    `get_image_features` on them, the tiles' rows one after another. grid_thw is (tiles, rows, columns)
    of one tile's patch grid, and the geometry's spatial merge turns a tile's patches into its tokens."""

    prefixes = TOWER_AND_PROJECTOR
    # The VLM's model class and its projector class, as "<module under transformers.models>.<Class>".
    model_class: str
    projector_class: str

    def build(self, config: PretrainedConfig) -> nn.Module:
        from transformers import AutoModel

        def parts(model: nn.Module) -> None:
            model.vision_tower = AutoModel.from_config(config.vision_config)
            model.multi_modal_projector = _transformers_class(self.projector_class)(config)

        return vision_parts(_transformers_class(self.model_class), config, parts)

    @property
    def patch_size(self) -> int:
        return self.config.vision_config.patch_size

    def prepared(self, pixel_values: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> PreparedImage:
        tiles = int(pixel_values.shape[0])
        rows, columns = (int(side) // self.patch_size for side in pixel_values.shape[-2:])
        merge = self.spec.spatial_merge_size
        return PreparedImage(
            pixel_values=pixel_values,
            grid_thw=(tiles, rows, columns),
            num_tokens=tiles * rows * columns // merge**2 + self.spec.extra_tokens_per_item,
            num_patches=tiles * rows * columns,
        )

    def forward(self, pixel_values: torch.Tensor, batch: Sequence[PreparedImage]) -> torch.Tensor:
        return rows_of(self.tower.get_image_features(pixel_values).pooler_output, self.spec.hidden_size)


def _transformers_class(path: str) -> type:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"transformers.models.{module}"), name)
