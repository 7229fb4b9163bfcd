"""The encoder double of the tests and benchmarks: the real tower or made-up embeddings, with switches
to hold forwards at a gate, slow them down, fail them, miscount tokens, and count what was done."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections.abc import Sequence

import torch
from PIL import Image

from encoder_server.models import ImageEmbedding, ModelSpec, PreparedImage, VisionEncoder
from encoder_server.profiles import DEFAULT_PROFILE, PROFILES, PreprocessProfile

GATE_TIMEOUT_S = 30.0


class EncoderDouble(VisionEncoder):
    """A VisionEncoder for tests and benchmarks.

    Outputs come from `inner` (a real tower) when given. Otherwise they are made up, with no compute,
    so that what a benchmark times is the server, the wire and the receiver:
    `tokens=n`: every image gives n rows, seeded by the image's width (items stay distinguishable),
    made once per width and reused like cache hits.

    Switches: `hold()` / `release()` a gate that forwards wait at (`release(forwards=n)` lets n more
    through, whichever they are: a call's items reach the forward worker in the order their preprocessing
    ends, so tests count the forwards they let through rather than naming them); `in_forward` is set while one waits
    or runs, `running` counts them), `forward_s` makes each forward take that long, `fail_with` is raised by every forward,
    `miscount_width` makes preprocessing announce one token too many for images of that width.
    Counts: `preprocessed`, `batches` (each forward's batch size), `items_forwarded`.
    """

    def __init__(
        self,
        inner: VisionEncoder | None = None,
        *,
        tokens: int | None = None,
        hidden_size: int = 2048,
        dtype: torch.dtype = torch.bfloat16,
        num_deepstack_layers: int = 0,
        forward_s: float = 0.0,
        miscount_width: int | None = None,
    ):
        if (inner is None) == (tokens is None):
            raise ValueError("an EncoderDouble wraps a real tower or makes up `tokens` rows, one of the two")
        self.inner = inner
        self.tokens = tokens
        self.forward_s = forward_s
        self.miscount_width = miscount_width
        self.fail_with: BaseException | None = None
        self.preprocessed = 0
        self.batches: list[int] = []  # size of each forward's batch, in order
        self.in_forward = threading.Event()
        self._gate = threading.Condition()
        self._passes: int | None = None  # forwards the gate lets through; None: open
        self.running = 0  # forwards waiting at the gate or computing
        self._lock = threading.Lock()
        self._outputs: dict[int, ImageEmbedding] = {}
        if inner is not None:
            self.spec = inner.spec
            return
        name = f"double-{tokens}"
        self.spec = ModelSpec(
            family="double", model_type=name, hidden_size=hidden_size, dtype=dtype, device=torch.device("cpu"),
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, num_deepstack_layers=num_deepstack_layers,
            weights_fingerprint=hashlib.sha256(name.encode()).hexdigest(), preprocess_fingerprint=name,
        )  # fmt: skip

    @property
    def items_forwarded(self) -> int:
        return sum(self.batches)

    @property
    def payload_bytes(self) -> int:
        """Bytes of one item's payload, for a fixed `tokens`."""
        spec = self.spec
        return (1 + spec.num_deepstack_layers) * int(self.tokens) * spec.hidden_size * spec.dtype.itemsize

    def hold(self) -> None:
        """Forwards from now on wait at the gate until `release`."""
        with self._gate:
            self._passes = 0

    def release(self, forwards: int | None = None) -> None:
        """Opens the gate; or, given `forwards`, lets that many more forwards through it."""
        with self._gate:
            self._passes = None if forwards is None else (self._passes or 0) + forwards
            self._gate.notify_all()

    def reset(self) -> None:
        with self._lock:
            self.preprocessed = 0
            self.batches.clear()

    def preprocess(self, image: Image.Image, profile: PreprocessProfile = PROFILES[DEFAULT_PROFILE]) -> PreparedImage:
        with self._lock:
            self.preprocessed += 1
        prepared = self.inner.preprocess(image, profile) if self.inner is not None else self._made_up_preprocess(image)
        if image.width == self.miscount_width:
            return dataclasses.replace(prepared, num_tokens=prepared.num_tokens + 1)
        return prepared

    def encode(self, batch: Sequence[PreparedImage]) -> list[ImageEmbedding]:
        self.in_forward.set()
        with self._gate:
            self.running += 1
        try:
            if self.fail_with is not None:
                raise self.fail_with
            with self._gate:
                if not self._gate.wait_for(lambda: self._passes is None or self._passes > 0, GATE_TIMEOUT_S):
                    raise TimeoutError("the test never released the gate")
                if self._passes is not None:
                    self._passes -= 1
            if self.forward_s:
                time.sleep(self.forward_s)
            with self._lock:
                self.batches.append(len(batch))
            if self.inner is not None:
                return self.inner.encode(batch)
            return [self.output(int(prepared.pixel_values[0])) for prepared in batch]
        finally:
            self.in_forward.clear()
            with self._gate:
                self.running -= 1

    def output(self, width: int) -> ImageEmbedding:
        """The made-up output of every image `width` pixels wide, for a fixed `tokens`."""
        if width not in self._outputs:
            spec = self.spec
            generator = torch.Generator().manual_seed(width)
            shape = (1 + spec.num_deepstack_layers, int(self.tokens), spec.hidden_size)
            rows = torch.randn(shape, generator=generator).to(spec.dtype)
            self._outputs[width] = ImageEmbedding(rows[0], rows[1:] if spec.num_deepstack_layers else None)
        return self._outputs[width]

    def _made_up_preprocess(self, image: Image.Image) -> PreparedImage:
        n = int(self.tokens)  # grid (1, 2, 2n) merges 2x2 into n tokens
        return PreparedImage(torch.tensor([image.width]), (1, 2, 2 * n), num_tokens=n, num_patches=4 * n)
