"""Dynamic batching: concurrent calls feed one bounded queue, one worker thread runs the forwards, and
the load it measures (`BatcherLoad`) is what receivers place by and the autoscaler reads."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from encoder_common.env_flags import flag
from encoder_common.errors import OverloadedError, TokenCountMismatchError, UnavailableError
from encoder_common.load_report import LoadReport

from .work_meter import BatcherLoad, WorkMeter

if TYPE_CHECKING:  # the model stack is not imported for BatchingConfig (the CLI's --help builds on it)
    from .models import ImageEmbedding, PreparedImage, VisionEncoder

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class BatchingConfig:
    max_batch_images: int = field(default=32, metadata=flag("images per forward at most"))
    # The forward's activations grow with its patches: 16384 (two 1792-token images, sixteen 448x448 ones)
    # keeps the built-in model's tiny tower under ~150 MiB; docs/reliability-security.md has the figures.
    max_batch_patches: int = field(default=16384, metadata=flag("patches per forward at most"))
    max_wait_ms: float = field(
        default=0.0, metadata=flag("wait this long for more work before a forward", name="--batch-wait-ms")
    )
    max_queue_items: int = field(
        default=256, metadata=flag("queued items beyond which calls get RESOURCE_EXHAUSTED")
    )
    max_queue_patches: int = field(
        default=1 << 20, metadata=flag("queued patches beyond which calls get RESOURCE_EXHAUSTED")
    )
    saturation_window_s: float = field(
        default=30.0, metadata=flag("seconds of demand the saturation gauge averages over")
    )

    def __post_init__(self) -> None:
        for name in ("max_batch_images", "max_batch_patches", "max_queue_items", "max_queue_patches"):
            if getattr(self, name) < 1:
                raise ValueError(f"BatchingConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.max_wait_ms < 0:
            raise ValueError(f"BatchingConfig.max_wait_ms must not be negative, got {self.max_wait_ms}")
        if self.saturation_window_s <= 0:
            raise ValueError(f"BatchingConfig.saturation_window_s must be positive, got {self.saturation_window_s}")


@dataclass(frozen=True)
class TimedEmbedding:
    """An image's embedding with the timings of the batch whose forward produced it."""

    output: ImageEmbedding
    queue_ms: float
    forward_ms: float
    batch_size: int
    batch_tokens: int  # the embedding rows of the whole batch


@dataclass(eq=False)  # compared by identity: the queue removes exactly this entry
class _Pending:
    prepared: PreparedImage
    future: asyncio.Future
    enqueued: float


class Batcher:
    """Owns the forward thread; `submit` is called from the event loop.

    The worker takes whatever is waiting (up to a number of images and of patches per batch, after an
    optional short wait for more), runs one forward for all of it and resolves each item's future on its
    caller's event loop. An item whose future is cancelled leaves the queue at once: no forward for it.
    """

    def __init__(self, encoder: VisionEncoder, config: BatchingConfig = BatchingConfig()):
        self.encoder = encoder
        self.config = config
        self._queue: deque[_Pending] = deque()
        self._queued_patches = 0
        self._running_patches = 0  # of the forward running now
        self._meter = WorkMeter(config.saturation_window_s)
        # Items whose call was cancelled (or whose deadline passed) before their forward, by where they
        # were: "queue" (they left it) or "preprocess" (they never reached it; the pipeline tells).
        self.cancelled_items: Counter[str] = Counter()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="encoder-forward", daemon=True)
        self.alive = False

    def start(self) -> None:
        self.alive = True
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def join(self, timeout: float | None = None) -> None:
        """Waits for the forward thread to end (it ends on `stop()`, or when it dies)."""
        self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def queued_patches(self) -> int:
        return self._queued_patches

    @property
    def demanded_s(self) -> float:
        """Forward-seconds asked of this worker since start (items queued, and refused at the mean cost)."""
        with self._cond:
            return self._meter.demanded_s

    def load(self) -> BatcherLoad:
        with self._cond:
            meter = self._meter
            queued_s = (self._queued_patches + self._running_patches) * meter.seconds_per_patch
            return BatcherLoad(queued_s, meter.item_s, meter.saturation())

    def load_report(self) -> LoadReport:
        """What the receivers are told with every answer: the queued work and one item's cost (cheap:
        no walk over the saturation window)."""
        with self._cond:
            queued_s = (self._queued_patches + self._running_patches) * self._meter.seconds_per_patch
            return LoadReport(queued_s, self._meter.item_s)

    def item_cancelled_before_queue(self) -> None:
        """Counts an item whose call went away while it was read or preprocessed."""
        with self._cond:
            self.cancelled_items["preprocess"] += 1

    def check_room(self, num_items: int) -> None:
        """Refuses a call at once when its items cannot fit the queue, before any of them is decoded."""
        with self._cond:
            self._check_open()
            if len(self._queue) + num_items > self.config.max_queue_items:
                self._meter.demanded(num_items * self._meter.item_s)
                raise self._overloaded()

    def submit(self, items: Sequence[PreparedImage]) -> list[asyncio.Future]:
        """Queues a call's items together, or refuses them all with OverloadedError.

        Cancelling a returned future takes its item out of the queue.
        """
        loop = asyncio.get_running_loop()
        patches = sum(item.num_patches for item in items)
        now = time.perf_counter()
        with self._cond:
            self._check_open()
            cfg = self.config
            # An empty queue takes any call, so a single item over the patch limit is still served.
            if len(self._queue) + len(items) > cfg.max_queue_items or (
                self._queue and self._queued_patches + patches > cfg.max_queue_patches
            ):
                self._meter.demanded(len(items) * self._meter.item_s)
                raise self._overloaded()
            self._meter.demanded(patches * self._meter.seconds_per_patch)
            pending = [_Pending(item, loop.create_future(), now) for item in items]
            self._queue.extend(pending)
            self._queued_patches += patches
            self._cond.notify()
        for p in pending:
            p.future.add_done_callback(functools.partial(self._withdraw_if_cancelled, p))
        return [p.future for p in pending]

    def _check_open(self) -> None:
        if not self.alive or self._stopping:
            raise UnavailableError("the encoder's forward worker is not running")

    def _overloaded(self) -> OverloadedError:
        cfg = self.config
        return OverloadedError(
            f"encoder queue is full ({len(self._queue)} items, {self._queued_patches} patches waiting; "
            f"limits {cfg.max_queue_items} items, {cfg.max_queue_patches} patches): retry later or elsewhere"
        )

    def _withdraw_if_cancelled(self, pending: _Pending, future: asyncio.Future) -> None:
        if not future.cancelled():
            return
        with self._cond:
            try:
                self._queue.remove(pending)
            except ValueError:  # already taken by the worker
                return
            self._queued_patches -= pending.prepared.num_patches
            self.cancelled_items["queue"] += 1

    def _take_batch(self) -> list[_Pending]:
        cfg = self.config
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return []
            deadline = time.perf_counter() + cfg.max_wait_ms / 1000
            batch: list[_Pending] = []
            patches = 0
            while True:
                while self._queue and len(batch) < cfg.max_batch_images:
                    head = self._queue[0]
                    if batch and patches + head.prepared.num_patches > cfg.max_batch_patches:
                        break
                    self._queue.popleft()
                    self._queued_patches -= head.prepared.num_patches
                    if head.future.done():  # cancelled after its withdrawal was scheduled
                        self.cancelled_items["queue"] += 1
                        continue
                    batch.append(head)
                    patches += head.prepared.num_patches
                full = len(batch) >= cfg.max_batch_images or (
                    self._queue and patches + self._queue[0].prepared.num_patches > cfg.max_batch_patches
                )
                remaining = deadline - time.perf_counter()
                if full or remaining <= 0 or self._stopping:
                    self._running_patches = patches
                    return batch
                self._cond.wait(remaining)

    def _run(self) -> None:
        try:
            while True:
                batch = self._take_batch()
                if not batch:
                    if self._stopping:
                        return
                    continue
                self._forward(batch)
        except BaseException:
            log.exception("forward worker died")
            raise
        finally:
            self._fail_queued()

    def _forward(self, batch: list[_Pending]) -> None:
        start = time.perf_counter()
        try:
            outputs = self._encode(batch)
        except Exception as exc:  # delivered to every caller in the batch
            for p in batch:
                _resolve(p.future, exception=exc)
            return
        except BaseException:  # the worker dies: its batch must not wait forever
            for p in batch:
                _resolve(p.future, exception=UnavailableError("the encoder's forward worker died"))
            raise
        finally:
            seconds = time.perf_counter() - start
            with self._cond:
                self._meter.forward(seconds, len(batch), self._running_patches)
                self._running_patches = 0
        forward_ms = seconds * 1000
        tokens = sum(p.prepared.num_tokens for p in batch)
        for p, output in zip(batch, outputs):
            queue_ms = (start - p.enqueued) * 1000
            _resolve(p.future, result=TimedEmbedding(output, queue_ms, forward_ms, len(batch), tokens))

    def _encode(self, batch: list[_Pending]) -> list[ImageEmbedding]:
        try:
            return self.encoder.encode([p.prepared for p in batch])
        except TokenCountMismatchError:
            if len(batch) == 1:
                raise
        # Find the culprit: run each alone, so only the item at fault fails.
        outputs: list[ImageEmbedding] = []
        for p in batch:
            try:
                outputs.extend(self.encoder.encode([p.prepared]))
            except TokenCountMismatchError as exc:
                _resolve(p.future, exception=exc)
                outputs.append(None)  # type: ignore[arg-type]  # its future is already done
        return outputs

    def _fail_queued(self) -> None:
        with self._cond:
            self.alive = False  # under the lock: no submit can slip in after the queue is emptied
            pending, self._queue = list(self._queue), deque()
            self._queued_patches = 0
        for p in pending:
            _resolve(p.future, exception=UnavailableError("the encoder is shutting down"))


def _resolve(future: asyncio.Future, *, result=None, exception: BaseException | None = None) -> None:
    def apply() -> None:
        if future.done():
            return
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)

    try:
        future.get_loop().call_soon_threadsafe(apply)
    except RuntimeError:  # the caller's loop is closed: nobody is left to tell
        pass
