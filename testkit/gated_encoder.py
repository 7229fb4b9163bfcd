"""A real vision encoder behind a gate: counts preprocessing and forwards, and can hold a forward open.

Tests use it to fill the batcher's queue deterministically (the worker blocks inside a forward) and
to prove what did or did not cost a forward. The embeddings are the real tower's.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from PIL import Image

from encoder_server.models import ImageEmbedding, PreparedImage, VisionEncoder

GATE_TIMEOUT_S = 30.0


class GatedEncoder(VisionEncoder):
    def __init__(self, inner: VisionEncoder):
        self.inner = inner
        self.spec = inner.spec
        self.preprocessed = 0
        self.batches: list[int] = []  # size of each forward's batch, in order
        self.in_forward = threading.Event()  # set while a forward waits at the gate or runs
        self._gate = threading.Event()
        self._gate.set()
        self._lock = threading.Lock()

    @property
    def items_forwarded(self) -> int:
        return sum(self.batches)

    def hold(self) -> None:
        """Forwards from now on wait at the gate until `release`."""
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def reset(self) -> None:
        with self._lock:
            self.preprocessed = 0
            self.batches.clear()

    def preprocess(self, image: Image.Image) -> PreparedImage:
        with self._lock:
            self.preprocessed += 1
        return self.inner.preprocess(image)

    def encode(self, batch: Sequence[PreparedImage]) -> list[ImageEmbedding]:
        self.in_forward.set()
        try:
            if not self._gate.wait(GATE_TIMEOUT_S):
                raise TimeoutError("the test never released the gate")
            with self._lock:
                self.batches.append(len(batch))
            return self.inner.encode(batch)
        finally:
            self.in_forward.clear()
