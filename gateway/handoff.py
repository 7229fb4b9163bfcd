"""How encoded items reach vLLM: the embedding tensor its model takes, the chat content part its OpenAI
server accepts (`--enable-mm-embeds`), and the `multi_modal_data` its `LLM.generate` accepts.

Formats read from vLLM 0.31 to 0.33 (`encoder_common.vllm_releases.SUPPORTED_VLLM`; gateway/app.py refuses to
start in front of a vLLM that reports another release): a chat part `{"type": "image_embeds",
"image_embeds": {"image_embeds": base64(torch.save(tensor)), "image_grid_thw": [t, h, w]}}` for the Qwen
families (the grid a flat list; the tensor loaded with `torch.load(weights_only=True)`), the same with
`"image_sizes": [width, height]` instead of the grid for MiniCPM-V, and
`{"type": "image_embeds", "image_embeds": base64(torch.save(tensor))}` for the families vLLM takes a plain
tensor of (encoder_common/families.py says which); Qwen3-VL's `image_embeds` is the main embedding with
its deepstack levels concatenated after it along the hidden dimension (`[tokens, hidden * (1 + levels)]`).
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from encoder_common.families import FAMILIES, QWEN_GRID, Family, VllmInput, family_of
from receiver.embeddings.result import EncodeResult, ItemResult
from receiver.fleet.fetch import item_uuid

from .protocol import has_embedding_parts


def check_family(family: str, handoff: str) -> None:
    """Refuses a served family whose embeddings this hand-off cannot give vLLM, naming why; what vLLM takes
    of each family is its line in encoder_common/families.py."""
    known = family_of(family)
    if known is None:
        raise ValueError(f"the encoders serve family {family!r}, which is none of {sorted(FAMILIES)}")
    taken = known.vllm
    if handoff == "inline" and taken.image_embeds is None:
        raise ValueError(
            f"the encoders serve family {family!r}, whose image_embeds vLLM refuses: the inline hand-off cannot "
            "carry it; the connector hand-off (--handoff connector) is the one for it"
        )
    if handoff == "inline" and taken.equal_counts_only:
        raise ValueError(
            f"the encoders serve family {family!r}, whose image_embeds vLLM batches only at one token count per "
            "image, and this family's count varies with the image size (a batch of two sizes stops vLLM's engine "
            "core): the inline hand-off cannot carry it; the connector hand-off (--handoff connector) is the one "
            "for it"
        )


def engine_embedding(item: ItemResult) -> torch.Tensor:
    """The item's embedding as vLLM's model takes it: deepstack levels (Qwen3-VL) appended along hidden."""
    if item.deepstack is None:
        return item.embedding
    return torch.cat([item.embedding, *item.deepstack.unbind(0)], dim=-1)


def serialize_tensor(tensor: torch.Tensor) -> str:
    """base64 of `torch.save(tensor)`: what vLLM's chat API loads an embedding from."""
    buffer = io.BytesIO()
    tensor = tensor.contiguous()
    if tensor.untyped_storage().nbytes() != tensor.nbytes:  # a view: torch.save would write its whole storage
        tensor = tensor.clone()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getbuffer()).decode("ascii")


def image_embeds_part(item: ItemResult, taken: VllmInput = QWEN_GRID) -> dict[str, Any]:
    """One item as vLLM's `image_embeds` chat content part, in the form vLLM takes for the family (each form
    of VllmInput.image_embeds)."""
    if taken.image_embeds is None:
        raise ValueError(
            f"item {item.index}: vLLM takes no image_embeds of this family; use the connector hand-off"
        )
    tensor = serialize_tensor(engine_embedding(item))
    if taken.image_embeds == "tensor":
        return {"type": "image_embeds", "image_embeds": tensor}
    return {"type": "image_embeds", "image_embeds": {"image_embeds": tensor, **embeds_metadata(item, taken)}}


def embeds_metadata(item: ItemResult, taken: VllmInput) -> dict[str, list[int]]:
    """What vLLM sizes the item's placeholders from beside its rows, by the family's form: the patch grid
    (`image_grid_thw`, Qwen), or the image's [width, height] (`image_sizes`, MiniCPM-V; the encoder reports
    the image as loaded as the grid (1, height, width))."""
    grid = _grid(item)
    if taken.image_embeds == "image_sizes":
        return {"image_sizes": [grid[2], grid[1]]}
    return {"image_grid_thw": grid}


def _grid(item: ItemResult) -> list[int]:
    if len(item.grid_thw) != 3:
        raise ValueError(f"item {item.index} has no (t, h, w) grid; vLLM's embedding metadata needs one")
    return [int(x) for x in item.grid_thw]


class Handoff(Protocol):
    """Turns a request's encoded items into the content parts that replace its images, in item order.

    The seam where another transport (e.g. an encoder-cache connector) plugs in: it may move the
    tensors out of band and return parts that only name them.
    """

    # Keyword arguments of EncoderReceiver.encode this hand-off needs (a lease, for one).
    encode_options: Mapping[str, Any]

    def for_request(self, body: Mapping[str, Any]) -> Handoff:
        """The hand-off to use for this request (itself, or another where this one cannot serve it)."""
        ...

    async def content_parts(
        self, request_id: str, result: EncodeResult, *, family: Family, images: Sequence[bytes]
    ) -> list[dict[str, Any]]:
        """The parts for the request's items, for the family the encoders serve; `images` are the items'
        bytes, as encoded (what vLLM sizes the placeholders from where it must see the image)."""
        ...


class InlineEmbedsHandoff:
    """Sends each embedding inside the chat request, as base64(torch.save) in an `image_embeds` part."""

    encode_options: Mapping[str, Any] = {}

    def for_request(self, body: Mapping[str, Any]) -> Handoff:
        return self

    async def content_parts(
        self, request_id: str, result: EncodeResult, *, family: Family, images: Sequence[bytes]
    ) -> list[dict[str, Any]]:
        return await asyncio.to_thread(
            lambda: [image_embeds_part(item, family.vllm) for item in result.items]
        )


def leased_part(item: ItemResult, taken: VllmInput = QWEN_GRID, image: bytes | None = None) -> dict[str, Any]:
    """One leased item named by its lease key as the `uuid`, by which an ec_consumer vLLM's
    EncoderServiceConnector fetches it from the encoders: a metadata-only `image_embeds` part (its grid)
    where vLLM sizes the family's placeholders from that, else the raw image (`image`, the bytes encoded),
    which vLLM's processor sizes them from while its tower does not run. Deepstack levels (Qwen3-VL) stay
    on the encoder with the embedding: the connector fetches both."""
    if item.lease is None:
        raise ValueError(f"item {item.index} was encoded without a lease: nothing names it to the engine")
    uuid = item_uuid(item.lease.key)
    if taken.sized_without_image:
        return {"type": "image_embeds", "image_embeds": embeds_metadata(item, taken), "uuid": uuid}
    if image is None:
        raise ValueError(
            f"item {item.index}: vLLM sizes this family's placeholders from the image; none given"
        )
    url = "data:application/octet-stream;base64," + base64.b64encode(image).decode("ascii")
    return {"type": "image_url", "image_url": {"url": url}, "uuid": uuid}


class ConnectorHandoff:
    """Leaves each embedding on its encoder under a lease (the gateway receives headers only) and names
    it in the chat request; vLLM's EncoderServiceConnector (receiver/vllm/connector.py) fetches it."""

    def __init__(self, lease_ttl_s: float):
        self.encode_options: Mapping[str, Any] = {
            "lease_ms": int(lease_ttl_s * 1000),
            "withhold_payloads": True,
        }
        self._inline = InlineEmbedsHandoff()

    def for_request(self, body: Mapping[str, Any]) -> Handoff:
        """Inline for a request that brings image_embeds parts of its own: vLLM 0.32 refuses one request
        mixing parts that carry a tensor with metadata-only ones ("All dictionaries in the list of
        embeddings must have the same keys", `_merge_embeds` in vllm/renderers/chat_utils.py)."""
        return self._inline if has_embedding_parts(body) else self

    async def content_parts(
        self, request_id: str, result: EncodeResult, *, family: Family, images: Sequence[bytes]
    ) -> list[dict[str, Any]]:
        return [
            leased_part(item, family.vllm, image) for item, image in zip(result.items, images, strict=True)
        ]


HANDOFFS = ("inline", "connector")


def handoff_for(name: str, *, lease_ttl_s: float) -> Handoff:
    """The hand-off a gateway is configured with by name."""
    if name == "inline":
        return InlineEmbedsHandoff()
    if name == "connector":
        return ConnectorHandoff(lease_ttl_s)
    raise ValueError(f"unknown hand-off {name!r}; use one of {HANDOFFS}")


def multi_modal_data(result: EncodeResult | Sequence[ItemResult]) -> dict[str, Any]:
    """The `multi_modal_data` for vLLM's `LLM.generate` / `AsyncLLM.generate` from encoded items:

    result = await receiver.encode(request_id, items)
    prompt = {"prompt": text, "multi_modal_data": multi_modal_data(result)}
    outputs = llm.generate(prompt, sampling_params)
    """
    items = result.items if isinstance(result, EncodeResult) else list(result)
    if not items:
        return {}
    grid = torch.tensor([_grid(item) for item in items], dtype=torch.int64)
    return {
        "image": {
            "image_embeds": torch.cat([engine_embedding(item) for item in items]),
            "image_grid_thw": grid,
        }
    }
