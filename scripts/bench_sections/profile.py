"""How big each section of the benchmark runs: per device, and short for --quick."""

from __future__ import annotations

import dataclasses

from testkit.checkpoints import qwen2_5_vl_7b_tower

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Profile:
    """How big each section runs: per device, and short for --quick."""

    device: str
    dtype: str
    torch_threads: int
    tower: dict  # Qwen2.5-VL vision_config of the compute-bound tower
    transport_sizes: tuple[int, ...]
    transport_bytes: int  # moved per transport measurement
    transport_rounds: int  # the transport section's rounds: its figures' noise is per (short) measure
    rounds: int  # measurements per figure, interleaved with its baseline; the median is reported
    serving_image: tuple[int, int]
    serving_images: int
    serving_clients: int
    batching_clients: int
    batching_requests: int  # per client
    batching_image: tuple[int, int]
    scale_requests: int
    scale_items: int  # images per request, sharded across the encoders
    cache_repeats: int
    image_sizes: tuple[tuple[int, int], ...]
    image_size_images: int
    preprocess_workers: int


TINY_TOWER = {
    "depth": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_heads": 4,
    "out_hidden_size": 2048,
    "fullatt_block_indexes": [1],
    "window_size": 112,
}


def profile_for(device: str, quick: bool) -> Profile:
    if device == "cuda":
        return Profile(
            device="cuda", dtype="bfloat16", torch_threads=4, tower=qwen2_5_vl_7b_tower(32),
            transport_sizes=(7 * MiB, 32 * MiB), transport_bytes=(64 if quick else 512) * MiB,
            transport_rounds=1 if quick else 3, rounds=1 if quick else 3,
            serving_image=(448, 448), serving_images=32 if quick else 256, serving_clients=8,
            batching_clients=16, batching_requests=4 if quick else 32, batching_image=(56, 56),
            scale_requests=16 if quick else 64, scale_items=4, cache_repeats=3 if quick else 10,
            image_sizes=((448, 448), (896, 896)), image_size_images=32 if quick else 256, preprocess_workers=12,
        )  # fmt: skip
    return Profile(
        device="cpu", dtype="float32", torch_threads=1, tower=TINY_TOWER if quick else qwen2_5_vl_7b_tower(1),
        transport_sizes=(7 * MiB, 32 * MiB), transport_bytes=(32 if quick else 256) * MiB,
        transport_rounds=1 if quick else 21, rounds=1 if quick else 7,
        serving_image=(112, 112), serving_images=4 if quick else 12, serving_clients=2,
        batching_clients=16, batching_requests=2 if quick else 12, batching_image=(56, 56),
        scale_requests=2 if quick else 8, scale_items=2, cache_repeats=2 if quick else 5,
        image_sizes=((112, 112), (224, 224)), image_size_images=4 if quick else 8, preprocess_workers=4,
    )  # fmt: skip
