"""How vLLM 0.31-0.33 takes an image whose embedding was computed elsewhere, one class per form (as vLLM's
`MultiModalFieldConfig` has one per way a field batches): each builds the `image_embeds` chat part, the part
naming a leased item, and `LLM.generate`'s input, and says what vLLM sizes the placeholders from."""

from __future__ import annotations

import base64
import io
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch


class EncodedItem(Protocol):
    """What a form reads of one encoded item (receiver.embeddings.result.ItemResult)."""

    index: int
    embedding: torch.Tensor  # [tokens, hidden]
    deepstack: torch.Tensor | None  # [levels, tokens, hidden]
    grid_thw: tuple[int, ...]
    image_size: tuple[int, int] | None  # (width, height) of the image as the encoder loaded it


def engine_embedding(item: EncodedItem) -> torch.Tensor:
    """The item's embedding as vLLM's model takes it: deepstack levels (Qwen3-VL) appended along hidden."""
    if item.deepstack is None:
        return item.embedding
    return torch.cat([item.embedding, *item.deepstack.unbind(0)], dim=-1)


def serialize_tensor(tensor: torch.Tensor) -> str:
    """base64 of `torch.save(tensor)`: what vLLM's chat API loads an embedding from
    (`torch.load(weights_only=True)`)."""
    buffer = io.BytesIO()
    tensor = tensor.contiguous()
    if tensor.untyped_storage().nbytes() != tensor.nbytes:  # a view: torch.save would write its whole storage
        tensor = tensor.clone()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getbuffer()).decode("ascii")


def image_url_part(image: bytes, uuid: str) -> dict[str, Any]:
    """The raw image as a data URL beside `uuid`: vLLM's processor sizes the placeholders from it."""
    url = "data:application/octet-stream;base64," + base64.b64encode(image).decode("ascii")
    return {"type": "image_url", "image_url": {"url": url}, "uuid": uuid}


class VllmInput(ABC):
    """One way vLLM takes a family's encoded image. A chat request carries it inline (`image_embeds`
    parts, `--enable-mm-embeds`) or, through the connector hand-off, names it by a lease `uuid` that
    EncoderServiceConnector fetches by."""

    # vLLM sizes the placeholders from `metadata` alone (its parser's `allow_missing_mm_embeddings`): a
    # connector part then carries no image. Otherwise the image travels beside the uuid for vLLM's processor
    # to size them, and its tower still does not run.
    sized_without_image: ClassVar[bool] = False

    def inline_refusal(self) -> str | None:
        """Why the inline hand-off cannot carry the family (None: it can)."""
        return None

    @abstractmethod
    def image_embeds(self, item: EncodedItem) -> str | dict[str, Any]:
        """The value of the item's inline `image_embeds` part, its tensor base64(torch.save)."""

    @abstractmethod
    def engine_input(self, items: Sequence[EncodedItem]) -> Any:
        """The items as `LLM.generate`'s `multi_modal_data["image"]`."""

    def metadata(self, item: EncodedItem) -> dict[str, list[int]]:
        """What vLLM sizes the item's placeholders from beside its rows."""
        return {}

    def inline_part(self, item: EncodedItem) -> dict[str, Any]:
        """The chat content part carrying the item's embedding."""
        return {"type": "image_embeds", "image_embeds": self.image_embeds(item)}

    def leased_part(self, item: EncodedItem, uuid: str, image: bytes | None) -> dict[str, Any]:
        """The chat content part naming a leased item by `uuid`: its metadata alone where vLLM sizes the
        placeholders from that, else the raw image (`image`, the bytes encoded)."""
        if self.sized_without_image:
            return {"type": "image_embeds", "image_embeds": self.metadata(item), "uuid": uuid}
        if image is None:
            raise ValueError(f"item {item.index}: vLLM sizes this family's placeholders from the image; none given")
        return image_url_part(image, uuid)


@dataclass(frozen=True)
class TensorEmbeds(VllmInput):
    """The plain [tokens, hidden] tensor (LLaVA, LLaVA-NeXT/OneVision, InternVL); vLLM sizes the placeholders
    from the image. `equal_counts_only`: vLLM validates an encoder batch of the family's `image_embeds` as one
    stacked tensor (`TensorShape("bn", "ifs", "hs")`), so images of different token counts in one batch, of one
    request or of several, raise "data contains inconsistent shapes" in its engine core, which then stops."""

    equal_counts_only: bool = False

    def inline_refusal(self) -> str | None:
        if self.equal_counts_only:
            return (
                "whose image_embeds vLLM batches only at one token count per image, and this family's count varies "
                "with the image size (a batch of two sizes stops vLLM's engine core)"
            )
        return None

    def image_embeds(self, item: EncodedItem) -> str:
        return serialize_tensor(engine_embedding(item))

    def engine_input(self, items: Sequence[EncodedItem]) -> list[torch.Tensor]:
        return [engine_embedding(item) for item in items]


class DictEmbeds(VllmInput):
    """`{"image_embeds": rows, **metadata}`: the rows with what vLLM sizes their placeholders from."""

    @abstractmethod
    def metadata(self, item: EncodedItem) -> dict[str, list[int]]: ...

    def image_embeds(self, item: EncodedItem) -> dict[str, Any]:
        return {"image_embeds": serialize_tensor(engine_embedding(item)), **self.metadata(item)}


@dataclass(frozen=True)
class GridEmbeds(DictEmbeds):
    """Qwen-VL: the rows with their patch grid (`image_grid_thw`, a flat [t, h, w]: vLLM refuses a nested list,
    "Metadata image_grid_thw must be a finite numeric array"); vLLM sizes the placeholders from the grid."""

    sized_without_image = True

    def metadata(self, item: EncodedItem) -> dict[str, list[int]]:
        if len(item.grid_thw) != 3:
            raise ValueError(f"item {item.index} has no (t, h, w) grid; vLLM's embedding metadata needs one")
        return {"image_grid_thw": [int(x) for x in item.grid_thw]}

    def engine_input(self, items: Sequence[EncodedItem]) -> dict[str, torch.Tensor]:
        # A flat field: the items' rows one after another, split again by their grids.
        grids = [self.metadata(item)["image_grid_thw"] for item in items]
        return {
            "image_embeds": torch.cat([engine_embedding(item) for item in items]),
            "image_grid_thw": torch.tensor(grids, dtype=torch.int64),
        }


@dataclass(frozen=True)
class ImageSizeEmbeds(DictEmbeds):
    """MiniCPM-V: the rows with the image's [width, height] (`image_sizes`). Its data parser declares
    image_sizes as metadata, but vLLM 0.32's 4.6 processor keeps no image_sizes field
    (`_minicpmv4_6_field_config`): a metadata-only part becomes no item ("Expected there to be 1 image items
    ... but only found 0"), so a leased item travels with its image."""

    def metadata(self, item: EncodedItem) -> dict[str, list[int]]:
        if item.image_size is None:
            raise ValueError(f"item {item.index} has no image size; vLLM sizes this family's embeddings by it")
        width, height = item.image_size
        return {"image_sizes": [int(width), int(height)]}

    def engine_input(self, items: Sequence[EncodedItem]) -> dict[str, Any]:
        # A batched field: one entry per image.
        return {
            "image_embeds": [engine_embedding(item) for item in items],
            "image_sizes": torch.tensor([self.metadata(item)["image_sizes"] for item in items], dtype=torch.int64),
        }


@dataclass(frozen=True)
class NoEmbeds(VllmInput):
    """vLLM takes no `image_embeds` of the family ("Gemma3 does not support image_embeds."): only the connector
    hand-off, with the image, carries it."""

    def inline_refusal(self) -> str:
        return "whose image_embeds vLLM refuses"

    def image_embeds(self, item: EncodedItem) -> str:
        raise ValueError(f"item {item.index}: vLLM takes no image_embeds of this family; use the connector hand-off")

    def engine_input(self, items: Sequence[EncodedItem]) -> Any:
        raise ValueError("vLLM takes no image_embeds of this family: give LLM.generate the images")
