"""SGLang's item strings to image bytes, under this server's source policy, and the image-only rule."""

from __future__ import annotations

import asyncio
import base64
import binascii
import pathlib

from encoder_common.errors import InvalidItemError, UnsupportedModalityError
from encoder_common.sources import SourceReader

# SGLang's `image_extension_names`: a string ending so is a path, not base64.
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".gif")
_URL_SCHEMES = ("http://", "https://", "file://", "data:")
_SHOWN = 64


async def read_item(item: str, sources: SourceReader) -> bytes:
    """The encoded bytes an SGLang item string names; InvalidItemError when it cannot be read,
    UnsupportedModalityError when it is a video or audio file.

    SGLang's own encoder (`load_image` in sglang.srt.utils.common) takes an http(s):// URL, a file:// URL,
    a path (absolute, or any string ending in an image extension), a data: URI, or else raw base64. The
    same forms are accepted, but URLs and paths go through the server's SourceReader: http(s) only where
    enabled, files only under the allowed roots, and only absolute paths.
    """
    lowered = item[:16].lower()
    if lowered.startswith("data:"):
        media_type = item[5:].split(",", 1)[0].split(";", 1)[0].strip().lower()
        if media_type.startswith(("video/", "audio/")):
            raise UnsupportedModalityError([media_type.split("/", 1)[0]])
    if lowered.startswith(_URL_SCHEMES):
        data = await sources.read(item)
    else:
        data = await asyncio.to_thread(_base64_or_path, item, sources)
    modality = sniff_non_image(data)
    if modality is not None:
        raise UnsupportedModalityError([modality])
    return data


def _base64_or_path(item: str, sources: SourceReader) -> bytes:
    """The bytes of raw base64, or of the file an absolute path names."""
    if (data := _base64(item)) is not None and not item.lower().endswith(IMAGE_EXTENSIONS):
        return data
    path = pathlib.PurePosixPath(item)
    if not path.is_absolute():
        raise InvalidItemError(f"{_shown(item)!r} is neither a URL, a data: URI, an absolute path nor base64")
    return sources.read_local(pathlib.Path(path).as_uri())


def _base64(item: str) -> bytes | None:
    """The bytes of a raw base64 item, or None when it is not valid base64 (then it may be a path).

    Raw base64 is tried before a path because a JPEG's base64 starts with "/9j/", which SGLang's
    loader would take for a path; a path with no dot, a length that is a multiple of 4 and only
    base64 characters is taken for base64 and then fails as "not an image".
    """
    try:
        return base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError):
        return None


# ISO base media files (MP4, MOV, 3GP) whose brand is a still-image format: HEIF/AVIF images.
_IMAGE_BRANDS = {b"avif", b"avis", b"heic", b"heix", b"heim", b"heis", b"mif1", b"msf1"}


def sniff_non_image(data: bytes) -> str | None:
    """"video" or "audio" when the bytes are a known video or audio container, else None."""
    head = data[:16]
    if head[4:8] == b"ftyp":
        return None if head[8:12] in _IMAGE_BRANDS else "video"
    if head.startswith(b"\x1a\x45\xdf\xa3"):  # Matroska / WebM
        return "video"
    if head.startswith(b"RIFF") and head[8:12] in (b"AVI ", b"WAVE"):
        return "video" if head[8:12] == b"AVI " else "audio"
    if head.startswith((b"OggS", b"fLaC", b"ID3")):
        return "audio"
    return None


def _shown(item: str) -> str:
    return item if len(item) <= _SHOWN else item[:_SHOWN] + "..."
