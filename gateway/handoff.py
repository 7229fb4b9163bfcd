"""How encoded items reach vLLM: the chat content parts that replace a request's images, inline
(`image_embeds` parts, `--enable-mm-embeds`) or naming leased items for the connector, and the
`multi_modal_data` its `LLM.generate` accepts; each family's form (encoder_common/vllm_inputs.py) builds
them, for the vLLM releases `encoder_common.vllm_releases.SUPPORTED_VLLM` names (gateway/app.py refuses to start
in front of another).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from encoder_common.families import FAMILIES, Family, family_of
from encoder_common.vllm_inputs import GridEmbeds, VllmInput
from receiver.embeddings.result import EncodeResult, ItemResult
from receiver.fleet.fetch import item_uuid

from .protocol import has_embedding_parts

QWEN_GRID = GridEmbeds()  # the Qwen-VL families' form, where a caller names none


def check_family(family: str, handoff: str) -> None:
    """Refuses a served family whose embeddings this hand-off cannot give vLLM, naming why; what vLLM takes
    of each family is its line in encoder_common/families.py."""
    known = family_of(family)
    if known is None:
        raise ValueError(f"the encoders serve family {family!r}, which is none of {sorted(FAMILIES)}")
    refusal = known.vllm.inline_refusal() if handoff == "inline" else None
    if refusal is not None:
        raise ValueError(
            f"the encoders serve family {family!r}, {refusal}: the inline hand-off cannot carry it; the connector "
            "hand-off (--handoff connector) is the one for it"
        )


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
            lambda: [family.vllm.inline_part(item) for item in result.items]
        )


def leased_part(item: ItemResult, taken: VllmInput = QWEN_GRID, image: bytes | None = None) -> dict[str, Any]:
    """One leased item named by its lease key as the `uuid`, by which an ec_consumer vLLM's
    EncoderServiceConnector fetches it from the encoders, in the family's form (`VllmInput.leased_part`).
    Deepstack levels (Qwen3-VL) stay on the encoder with the embedding: the connector fetches both."""
    if item.lease is None:
        raise ValueError(f"item {item.index} was encoded without a lease: nothing names it to the engine")
    return taken.leased_part(item, item_uuid(item.lease.key), image)


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


def multi_modal_data(result: EncodeResult | Sequence[ItemResult], taken: VllmInput = QWEN_GRID) -> dict[str, Any]:
    """The `multi_modal_data` for vLLM's `LLM.generate` / `AsyncLLM.generate` from encoded items, in the form
    vLLM takes of the family (`family_of(info.family).vllm`; Qwen-VL's by default):

    result = await receiver.encode(request_id, items)
    prompt = {"prompt": text, "multi_modal_data": multi_modal_data(result)}
    outputs = llm.generate(prompt, sampling_params)
    """
    items = result.items if isinstance(result, EncodeResult) else list(result)
    return {"image": taken.engine_input(items)} if items else {}
