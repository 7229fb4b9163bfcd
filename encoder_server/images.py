"""Turns an item's bytes into an RGB PIL image, refusing what is too large before decoding it."""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError

from protos.errors import InvalidItemError

# Refuse images above this many pixels before decoding (decompression bombs); ~16k x 16k.
DEFAULT_MAX_IMAGE_PIXELS = 16384 * 16384


def decode_image(data: bytes, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Decodes an encoded image file into RGB; animated images give their first frame.

    Raises InvalidItemError for empty, truncated, oversized or non-image input.
    """
    if not data:
        raise InvalidItemError("empty image bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise InvalidItemError(
                    f"image is {width}x{height} = {width * height} pixels, over the limit of {max_pixels}"
                )
            image.seek(0)
            image.load()
    except InvalidItemError:
        raise
    except UnidentifiedImageError:
        raise InvalidItemError("bytes are not an image file of a known format") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidItemError(f"image is too large to decode: {exc}") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise InvalidItemError(f"image could not be decoded: {exc}") from None
    return _to_rgb(image)


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode.startswith("I;16") or image.mode in ("I", "F"):
        # 16-bit (or wider) grayscale: scale to 8 bits rather than clip at 255.
        values = np.asarray(image, dtype=np.float32)
        full_scale = 65535.0 if image.mode.startswith("I;16") else max(float(values.max()), 1.0)
        image = Image.fromarray((values * (255.0 / full_scale)).clip(0, 255).astype(np.uint8), "L")
    if "A" in image.getbands() or image.mode == "P" and "transparency" in image.info:
        # Composite on white, as a viewer shows it, rather than exposing undefined colour under alpha.
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
