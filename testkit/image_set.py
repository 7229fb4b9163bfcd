"""The parity image set: the images users really send, made with pillow. Sizes off the 28 px grid (28 to
2,000 px, thin and wide) and the file kinds phones, browsers and tools write, plus files vLLM refuses."""

from __future__ import annotations

import functools
import io
import struct
import zlib

import numpy as np
from PIL import Image

# Sides chosen off the 28 px grid (except the smallest), so every one of them is resized.
SIZES = {
    "size-28x28": (28, 28),
    "size-333x250": (333, 250),
    "size-1023x767": (1023, 767),
    "size-2000x57-wide": (2000, 57),
    "size-31x1500-thin": (31, 1500),
    "size-2000x301": (2000, 301),
}
KIND_SIZE = (301, 203)  # every file kind at this off-grid size (EXIF-rotated ones are stored turned)
EXIF_ORIENTATION = 0x0112


def scene(width: int, height: int, seed: int = 0) -> Image.Image:
    """An RGB picture with smooth areas and sharp edges (coarse random blocks, a gradient, a bar), so
    that lossy codecs and resizes have both to work on, unlike pure noise."""
    rng = np.random.RandomState(seed)
    coarse = rng.randint(0, 256, (max(2, height // 16), max(2, width // 16), 3), dtype=np.uint8)
    image = Image.fromarray(coarse, "RGB").resize((width, height), Image.NEAREST)
    pixels = np.asarray(image).copy()
    pixels[:, :, 1] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
    pixels[height // 3 : height // 3 + max(1, height // 8), :, :] = (20, 200, 90)
    return Image.fromarray(pixels, "RGB")


def _save(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _alpha(width: int, height: int) -> Image.Image:
    """An alpha channel with every level: opaque, clear and half-transparent bands."""
    ramp = np.linspace(0, 255, width, dtype=np.uint8)[None, :].repeat(height, axis=0)
    ramp[: height // 4] = 0
    ramp[-height // 4 :] = 255
    return Image.fromarray(ramp, "L")


def _kinds() -> dict[str, bytes]:
    width, height = KIND_SIZE
    rgb = scene(width, height, seed=1)
    rgba = rgb.copy()
    rgba.putalpha(_alpha(width, height))
    grey = rgb.convert("L")
    keyed = np.asarray(rgb).copy()
    keyed[height // 2 :, : width // 2] = (10, 20, 30)  # a quarter in the transparent colour key
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6  # stored turned: shown rotated 90 degrees clockwise
    turned = scene(height, width, seed=2)
    exif_upside_down = Image.Exif()
    exif_upside_down[EXIF_ORIENTATION] = 3
    wide16 = (np.asarray(grey).astype(np.uint16) * 257).astype(np.uint16)
    frames = [scene(width, height, seed=10 + i).convert("P", palette=Image.ADAPTIVE) for i in range(3)]
    return {
        "jpeg-baseline": _save(rgb, "JPEG", quality=90),
        "jpeg-progressive": _save(rgb, "JPEG", quality=85, progressive=True),
        "jpeg-greyscale": _save(grey, "JPEG", quality=90),
        "jpeg-cmyk": _save(rgb.convert("CMYK"), "JPEG", quality=90),
        "jpeg-exif-rotated": _save(turned, "JPEG", quality=90, exif=exif),
        "jpeg-exif-upside-down": _save(rgb, "JPEG", quality=90, exif=exif_upside_down),
        "png-rgb": _save(rgb, "PNG"),
        "png-rgba": _save(rgba, "PNG"),
        "png-palette": _save(rgb.convert("P", palette=Image.ADAPTIVE, colors=64), "PNG"),
        "png-palette-trns": _save(rgb.convert("P", palette=Image.ADAPTIVE, colors=64), "PNG", transparency=0),
        "png-rgb-trns": _save(Image.fromarray(keyed, "RGB"), "PNG", transparency=(10, 20, 30)),
        "png-l": _save(grey, "PNG"),
        "png-la": _save(rgba.convert("LA"), "PNG"),
        "png-16bit": _save(Image.fromarray(wide16), "PNG"),
        "png-1bit": _save(grey.convert("1"), "PNG"),
        "webp-lossy": _save(rgb, "WEBP", quality=80),
        "webp-alpha": _save(rgba, "WEBP", quality=80),
        "gif-animated": _save(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100),
        "bmp": _save(rgb, "BMP"),
        "tiff": _save(rgb, "TIFF"),
    }


@functools.cache
def image_set() -> dict[str, bytes]:
    """Every accepted image of the set by name: the off-grid sizes (PNG) and the file kinds."""
    sizes = {name: _save(scene(w, h, seed=i), "PNG") for i, (name, (w, h)) in enumerate(SIZES.items())}
    return {**sizes, **_kinds()}


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` pixels, with a one-row body: refused from its header."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IDAT", zlib.compress(b"\0" * 4))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + body + chunk(b"IEND", b"")


@functools.cache
def refused_images() -> dict[str, tuple[bytes, str]]:
    """Files vLLM refuses, by name, with a phrase of the InvalidItemError the encoder gives for each."""
    png = _save(scene(56, 56), "PNG")
    return {
        "eps": (_save(scene(64, 48), "EPS"), "not an image file of a format vLLM opens"),
        "not-an-image": (b"GIF89a? not really" * 4, "not an image file"),
        "truncated-png": (png[: len(png) // 2], "could not be decoded"),
        "aspect-over-200": (_save(scene(2010, 10), "PNG"), "aspect ratio"),
        # Last: vLLM 0.32 answers it with a 500 and drops the connection.
        "over-pixel-limit": (_png_header_only(20_000, 9_000), "over the limit of"),
    }
