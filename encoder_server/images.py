"""Turns an item's bytes into an RGB PIL image the way the engine a profile follows loads it (vLLM's or
SGLang's loader, or transformers' own conversion), refusing what is too large before decoding it."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable

from PIL import Image, ImageOps, UnidentifiedImageError

from encoder_common.errors import InvalidItemError

# The transformers profile's limit: Pillow's warning threshold (~89.5M pixels, 9459 x 9459). Pillow
# refuses anything over twice it by itself, so no configured limit above ~179M pixels has an effect.
DEFAULT_MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS
# The engines' limit: vLLM's VLLM_MAX_IMAGE_PIXELS default (178,956,970), which is also where Pillow
# refuses by itself, under SGLang as everywhere.
ENGINE_MAX_IMAGE_PIXELS = 2 * Image.MAX_IMAGE_PIXELS
# Longest side over shortest side. Qwen2-VL's processor refuses more than 200; for families that
# resize the shortest side up (CLIP), a thin strip would become a huge image.
DEFAULT_MAX_ASPECT_RATIO = 200.0
WHITE = (255, 255, 255)

# The Pillow formats vLLM 0.32 opens untrusted media in (vllm/multimodal/image.py); others (EPS, which
# may run Ghostscript, WMF, the stub drivers) it refuses.
VLLM_IMAGE_FORMATS = (
    "AVIF", "BLP", "BMP", "CUR", "DCX", "DDS", "DIB", "FITS", "FLI", "FTEX", "GBR", "GIF", "ICNS",
    "ICO", "IM", "IMT", "IPTC", "JPEG", "JPEG2000", "MCIDAS", "MSP", "PCD", "PCX", "PIXAR", "PNG",
    "PPM", "PSD", "QOI", "SGI", "SPIDER", "SUN", "TGA", "TIFF", "WEBP", "XBM", "XPM", "XVTHUMB",
)  # fmt: skip


def decode_image(
    data: bytes,
    *,
    loader: str = "transformers",
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
    background: tuple[int, int, int] = WHITE,
) -> Image.Image:
    """Decodes an encoded image file into RGB as `loader` ("vllm", "sglang", "transformers") does.
    Animated images (GIF, APNG, WebP) give their first frame.

    Raises InvalidItemError for empty, truncated, oversized, too thin or non-image input, and for a
    format outside vLLM's allowlist; the size and shape checks read only the file's header.
    `background` is what transparency is composited on, where the loader composites it.
    """
    if not data:
        raise InvalidItemError("empty image bytes")
    try:
        # Every loader opens vLLM's audited formats only: SGLang and transformers would also open EPS,
        # which runs Ghostscript where it is installed, and formats that need external handlers.
        image = Image.open(io.BytesIO(data), formats=VLLM_IMAGE_FORMATS)
        _check_size(image, max_pixels, max_aspect_ratio)
        rgb = _LOADERS[loader](image, background)
        # The loader alone decides what transparency means: transformers 5.24's processors composite a
        # transparency key left on an RGB image, those beside the engines (5.19) ignore it.
        rgb.info.pop("transparency", None)
        return rgb
    except InvalidItemError:
        raise
    except UnidentifiedImageError:
        if loader == "vllm":
            raise InvalidItemError(
                "bytes are not an image file of a format vLLM opens (see docs/parity.md)"
            ) from None
        raise InvalidItemError("bytes are not an image file of a known format") from None
    except Image.DecompressionBombError:
        limit = min(max_pixels, 2 * Image.MAX_IMAGE_PIXELS)
        raise InvalidItemError(
            f"image is over the limit of {limit} pixels (refused while reading its header)"
        ) from None
    except Exception as exc:  # any failure on untrusted bytes is the input's fault, not the server's
        raise InvalidItemError(f"image could not be decoded: {exc.__class__.__name__}: {exc}") from None


def _check_size(image: Image.Image, max_pixels: int, max_aspect_ratio: float) -> None:
    width, height = image.size
    if width * height > max_pixels:
        raise InvalidItemError(
            f"image is {width}x{height} = {width * height} pixels, over the limit of {max_pixels}"
        )
    if width < 1 or height < 1:
        raise InvalidItemError(f"image is {width}x{height}")
    ratio = max(width, height) / min(width, height)
    if ratio > max_aspect_ratio:
        raise InvalidItemError(
            f"image is {width}x{height}, an aspect ratio of {ratio:.0f}:1, over the limit of {max_aspect_ratio:g}:1"
        )


def _load_like_vllm(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """vLLM 0.32's `ImageMediaIO.load_bytes`: the EXIF orientation applied (a failing one ignored), then
    every kind of transparency (alpha, or a tRNS key in P, L and RGB images) composited on `background`
    through the alpha mask; other modes through Pillow's own conversion."""
    with contextlib.suppress(Exception):  # vLLM serves the image as stored when its EXIF cannot be applied
        image = ImageOps.exif_transpose(image)
    image.load()
    if image.mode == "RGB":
        return image
    if image.mode not in ("RGBA", "LA", "PA") and "transparency" not in image.info:
        return image.convert("RGB")
    rgba = image if image.mode == "RGBA" else image.convert("RGBA")
    flat = Image.new("RGB", rgba.size, background)
    flat.paste(rgba, mask=rgba.getchannel("A"))
    return flat


def _load_like_sglang(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """SGLang 0.5.23's encoder (`load_image`, then the preprocessor's `convert("RGB")`): no EXIF
    orientation, and any alpha or transparency key dropped rather than composited."""
    image.load()
    return image if image.mode == "RGB" else image.convert("RGB")


def _load_like_transformers(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """transformers 5.24's `convert_to_rgb`: every mode through Pillow's own conversion, so 16-bit and wider
    greyscale is clipped at 255 exactly as in-process, not rescaled; transparency composited on
    `background` with Pillow's alpha_composite; no EXIF orientation."""
    image.seek(0)
    image.load()
    if "A" in image.getbands() or image.info.get("transparency") is not None:  # a key on RGB too
        rgba = image.convert("RGBA")
        flat = Image.new("RGBA", rgba.size, (*background, 255))
        return Image.alpha_composite(flat, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


_LOADERS: dict[str, Callable[[Image.Image, tuple[int, int, int]], Image.Image]] = {
    "vllm": _load_like_vllm,
    "sglang": _load_like_sglang,
    "transformers": _load_like_transformers,
}
