"""The chat-completions request as the gateway sees it: which content parts are images to encode, which
pass through, which are refused, and the request rewritten with each image replaced by its embedding part."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from encoder_common.errors import InvalidItemError, UnsupportedModalityError

# Content-part types and the modality each carries, as vLLM's chat API names them.
_IMAGE_URL_TYPES = frozenset({"image_url", "input_image"})
_OTHER_MODALITIES = {
    "video_url": "video",
    "video_embeds": "video",
    "input_audio": "audio",
    "audio_url": "audio",
    "audio_embeds": "audio",
}


@dataclass(frozen=True)
class ImagePart:
    """An image content part to encode: where it sits in the request, and its URL."""

    message_index: int
    part_index: int
    url: str

    @property
    def where(self) -> str:
        return f"message {self.message_index} part {self.part_index}"


def _part_url(part: Mapping[str, Any], where: str) -> str:
    value = part.get("image_url")  # {"url": ...} in chat completions, the URL itself in input_image
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url:
        raise InvalidItemError(f"{where}: {part['type']} part has no URL")
    return url


def image_parts(body: Mapping[str, Any], *, pass_non_image: bool = False) -> list[ImagePart]:
    """The image parts of a chat request, in order; raises for a malformed message list.

    Non-image media parts raise UnsupportedModalityError listing their modalities in order, unless
    `pass_non_image` lets them through to the engine untouched. Unknown part types are left to the engine.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidItemError("'messages' must be a list")
    found: list[ImagePart] = []
    other: list[str] = []
    for message_index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidItemError(f"message {message_index}: must be an object")
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part_index, part in enumerate(content):
            where = f"message {message_index} part {part_index}"
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise InvalidItemError(f"{where}: a content part must be an object with a 'type'")
            kind = part["type"]
            if kind in _IMAGE_URL_TYPES:
                found.append(ImagePart(message_index, part_index, _part_url(part, where)))
            elif kind in _OTHER_MODALITIES:
                other.append(_OTHER_MODALITIES[kind])
    if other and not pass_non_image:
        raise UnsupportedModalityError(other)
    return found


def replace_parts(
    body: Mapping[str, Any], replacements: Mapping[ImagePart, Mapping[str, Any]]
) -> dict[str, Any]:
    """A copy of the request with each listed part replaced; the parts keep a client-given `uuid`."""
    rewritten = dict(body)
    messages = list(body["messages"])
    for part, new in replacements.items():
        message = dict(messages[part.message_index])
        content = list(message["content"])
        old = content[part.part_index]
        content[part.part_index] = {**new, **({"uuid": old["uuid"]} if "uuid" in old else {})}
        message["content"] = content
        messages[part.message_index] = message
    rewritten["messages"] = messages
    return rewritten
