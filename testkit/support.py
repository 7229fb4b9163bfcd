"""Shared test helpers: real images, tiny real checkpoints, and encoder servers on loopback."""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from encoder_server.batcher import BatchingConfig
from encoder_server.config import ServerConfig
from testkit.launcher import LaunchedServer, launch_server
from testkit.reference import reference_features  # noqa: F401  (tests import it from here)
from encoder_server.models import ImageEmbedding, ModelSpec, PreparedImage, VisionEncoder
from encoder_server.server import EncoderServer

REPO_ROOT = Path(__file__).resolve().parent.parent


def image_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    """A real encoded image of random pixels."""
    rng = np.random.RandomState(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.randint(0, 256, (height, width, channels), dtype=np.uint8)
    image = Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


def server_config(model_dir: Path, **overrides) -> ServerConfig:
    """A loopback config on an OS-chosen port, fp32 unless told otherwise."""
    batching = overrides.pop("batching", BatchingConfig())
    defaults = dict(model=str(model_dir), host="127.0.0.1", port=0, device="cpu", dtype=torch.float32, grace_seconds=2.0)
    defaults.update(overrides)
    return ServerConfig(batching=batching, **defaults)


@contextlib.asynccontextmanager
async def running_server(model_dir: Path, encoder=None, **overrides) -> AsyncIterator[EncoderServer]:
    """An in-process encoder server on 127.0.0.1; `server.url` is its grpc:// URL."""
    server = EncoderServer(server_config(model_dir, **overrides), encoder=encoder)
    await server.start()
    server.url = f"grpc://127.0.0.1:{server.port}"  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        await server.stop(grace=0.5)


@contextlib.contextmanager
def server_process(model_dir: Path, *flags: str, log_dir: Path, **kwargs) -> Iterator[LaunchedServer]:
    """`python -m encoder_server` in a child process on 127.0.0.1, its log under log_dir."""
    log_path = log_dir / f"server-{time.monotonic_ns()}.log"
    with launch_server(model_dir, *flags, log_path=log_path, **kwargs) as server:
        yield server


class FixedSizeEncoder(VisionEncoder):
    """A stand-in for the vision tower (not the transport): every image encodes to `num_tokens` rows
    at once, with values seeded by the image's width so that items stay distinguishable.

    Outputs are made once per width and reused, like cache hits, so a benchmark through the real
    server path measures the transport. `forward_s` makes each forward take that long.
    """

    def __init__(
        self,
        num_tokens: int,
        hidden_size: int = 2048,
        dtype: torch.dtype = torch.bfloat16,
        num_deepstack_layers: int = 0,
        forward_s: float = 0.0,
    ):
        self.num_tokens = num_tokens
        self.forward_s = forward_s
        self.spec = ModelSpec(
            family="fixed",
            model_type="fixed",
            hidden_size=hidden_size,
            dtype=dtype,
            device=torch.device("cpu"),
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_deepstack_layers=num_deepstack_layers,
            weights_fingerprint="fixed",
            preprocess_fingerprint="fixed",
        )
        self._outputs: dict[int, ImageEmbedding] = {}

    @property
    def payload_bytes(self) -> int:
        spec = self.spec
        return (1 + spec.num_deepstack_layers) * self.num_tokens * spec.hidden_size * spec.dtype.itemsize

    def preprocess(self, image: Image.Image) -> PreparedImage:
        n = self.num_tokens  # grid (1, 2, 2n) merges 2x2 into n tokens
        return PreparedImage(torch.tensor([image.width]), (1, 2, 2 * n), num_tokens=n, num_patches=4 * n)

    def encode(self, batch):
        if self.forward_s:
            time.sleep(self.forward_s)
        return [self.output(int(prepared.pixel_values[0])) for prepared in batch]

    def output(self, width: int) -> ImageEmbedding:
        if width not in self._outputs:
            spec = self.spec
            generator = torch.Generator().manual_seed(width)
            shape = (1 + spec.num_deepstack_layers, self.num_tokens, spec.hidden_size)
            rows = torch.randn(shape, generator=generator).to(spec.dtype)
            self._outputs[width] = ImageEmbedding(rows[0], rows[1:] if spec.num_deepstack_layers else None)
        return self._outputs[width]
