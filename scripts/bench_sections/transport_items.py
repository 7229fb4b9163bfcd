"""What the transport section moves: items of Qwen2.5-VL-7B's width at the nominal sizes, the small
item, the real JPEG each call carries (scripts/profile_dataplane.py sends the same ones), and the
checkpoint and image of the server users run, whose cached item is the nominal 7 MiB one."""

from __future__ import annotations

from testkit.images import image_bytes

TRANSPORT_HIDDEN = 3584  # Qwen2.5-VL-7B's embedding width: 1,024 bf16 tokens are 7 MiB
SMALL_TOKENS = 64
SMALL = 0  # the key of the small item among the nominal sizes
IN_FLIGHT = 4  # calls in flight in the pipelined modes: a prefill node has many requests at once
# The server users run, measured beside the stand-in at this size: the encoder-server CLI on a real
# checkpoint, the default model's tower (testkit.default_model) at Qwen2.5-VL-7B's embedding width, bf16;
# a 896x896 image is 64x64 patches, merged 2x2 into 1,024 tokens: 7 MiB.
SERVED_SIZE = 7 << 20
SERVED_SIDE = 896


def item_tokens(size: int) -> int:
    """Rows of the item that stands for nominal size `size` (bytes): 1,024 for 7 MiB, 4,682 for 32 MiB."""
    return SMALL_TOKENS if size == SMALL else -(-size // (TRANSPORT_HIDDEN * 2))


def item_bytes(size: int) -> int:
    return item_tokens(size) * TRANSPORT_HIDDEN * 2


def served_tower() -> dict:
    """The vision_config of the served checkpoint: the default model's tower, embeddings 3,584 wide."""
    from testkit.default_model import TINY_TOWER

    return TINY_TOWER | {"out_hidden_size": TRANSPORT_HIDDEN}


def request_jpeg(seed: int, side: int = 720) -> bytes:
    """A real JPEG of random pixels, ~470 KB at 720x720: what a 1,024-token image weighs on the wire."""
    return image_bytes(side, side, seed, fmt="JPEG", quality=90)
