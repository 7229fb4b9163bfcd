"""Real encoded images of random pixels for the tests, the benchmarks and the demo's extra inputs."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def image_bytes(
    width: int, height: int, seed: int = 0, fmt: str = "PNG", mode: str = "RGB", **save_options
) -> bytes:
    """A real encoded image of random pixels: every seed gives different bytes, so none rides on a cache.

    `save_options` go to pillow's `save` (e.g. compress_level=1 for fast PNGs).
    """
    rng = np.random.RandomState(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.randint(0, 256, (height, width, channels), dtype=np.uint8)
    image = Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)
    buf = io.BytesIO()
    image.save(buf, fmt, **save_options)
    return buf.getvalue()


def drawn_image_bytes(width: int, height: int, hue: int, fmt: str = "PNG") -> bytes:
    """A simple drawn scene (a sun, a box), so the demo's images are real pictures of different sizes."""
    from PIL import ImageDraw

    image = Image.new("RGB", (width, height), (hue, 120, 255 - hue))
    draw = ImageDraw.Draw(image)
    draw.ellipse((width * 0.2, height * 0.2, width * 0.7, height * 0.8), fill=(250, 220, 40))
    draw.rectangle((width * 0.55, height * 0.5, width * 0.95, height * 0.95), fill=(30, 30, 30))
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()
