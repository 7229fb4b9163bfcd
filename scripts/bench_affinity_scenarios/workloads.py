"""The placement benchmark's workloads (requests as lists of image numbers) and the images they name."""

from __future__ import annotations

import random

from testkit.images import image_bytes


def zipf_workload(requests: int, images: int, exponent: float, seed: int) -> list[list[int]]:
    """Requests of 1-4 distinct images, each drawn with probability ~ 1 / rank^exponent."""
    rng = random.Random(seed)
    weights = [1 / rank**exponent for rank in range(1, images + 1)]
    workload = []
    for _ in range(requests):
        picks: list[int] = []
        size = rng.randint(1, 4)
        while len(picks) < size:
            (image,) = rng.choices(range(images), weights)
            if image not in picks:
                picks.append(image)
        workload.append(picks)
    return workload


def no_repeat_workload(requests: int, seed: int) -> list[list[int]]:
    """Requests of 1-4 images, no image twice in the whole workload."""
    rng = random.Random(seed)
    workload, next_image = [], 0
    for _ in range(requests):
        size = rng.randint(1, 4)
        workload.append(list(range(next_image, next_image + size)))
        next_image += size
    return workload


def hot_workload(requests: int, seed: int) -> list[list[int]]:
    """Requests of 1-4 images: image 0 (the hot one) in half of them, every other image new."""
    rng = random.Random(seed)
    workload, next_image = [], 1
    for _ in range(requests):
        size = rng.randint(1, 4)
        hot = rng.random() < 0.5
        fresh = size - hot
        workload.append([0] * hot + list(range(next_image, next_image + fresh)))
        next_image += fresh
    return workload


def make_images(count: int, seed: int) -> list[bytes]:
    """PNG images of a few sizes (112 to 224 pixels a side: 16 to 64 tokens)."""
    sides = (112, 168, 224)
    return [image_bytes(sides[i % 3], sides[(i // 3) % 3], seed=seed + i) for i in range(count)]


class Images:
    """Fresh image sets: every phase draws its own, so no phase meets another's cached embeddings."""

    def __init__(self) -> None:
        self.next_seed = 0

    def __call__(self, count: int) -> list[bytes]:
        self.next_seed += 1_000_000
        return make_images(count, self.next_seed)
