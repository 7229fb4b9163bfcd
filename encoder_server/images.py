"""Turns an item's bytes into an RGB PIL image, refusing what is too large before decoding it."""

from __future__ import annotations

import io

from PIL import Image, UnidentifiedImageError

from encoder_common.errors import InvalidItemError

# Refuse images above this many pixels before decoding (decompression bombs). Pillow's own
# threshold (~89.5M pixels, 9459 x 9459): up to it Pillow stays silent, and it refuses anything
# over twice it by itself, so a configured limit above ~179M pixels has no effect.
DEFAULT_MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS
# Longest side over shortest side. Qwen2-VL's processor refuses more than 200; for families that
# resize the shortest side up (CLIP), a thin strip would become a huge image.
DEFAULT_MAX_ASPECT_RATIO = 200.0


def decode_image(
    data: bytes,
    *,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
) -> Image.Image:
    """Decodes an encoded image file into RGB. Animated images (GIF, APNG, WebP) give their first frame.

    Raises InvalidItemError for empty, truncated, oversized, too thin or non-image input; the
    size and shape checks read only the file's header.
    """
    if not data:
        raise InvalidItemError("empty image bytes")
    try:
        image = Image.open(io.BytesIO(data))
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
        image.seek(0)
        image.load()
        return _to_rgb(image)
    except InvalidItemError:
        raise
    except UnidentifiedImageError:
        raise InvalidItemError("bytes are not an image file of a known format") from None
    except Image.DecompressionBombError:
        limit = min(max_pixels, 2 * Image.MAX_IMAGE_PIXELS)
        raise InvalidItemError(f"image is over the limit of {limit} pixels (refused while reading its header)") from None
    except Exception as exc:  # any failure on untrusted bytes is the input's fault, not the server's
        raise InvalidItemError(f"image could not be decoded: {exc.__class__.__name__}: {exc}") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    """The RGB image the checkpoint's own processor makes of what Pillow opened (transformers'
    `convert_to_rgb`): every mode through Pillow's own conversion, so 16-bit and wider greyscale is
    clipped at 255 exactly as in-process, not rescaled; transparency composited on white."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
