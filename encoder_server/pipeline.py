"""The compute path of a call's items: admission, reading, the embedding cache, preprocessing on a thread
pool and the batcher's forwards. Each item's flow yields what the item is; the sender (sender.py) decides
what the stream budget is charged for it, and lets its forward through."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Executor
from dataclasses import replace

from encoder_common import tracing
from encoder_common.digests import DigestMemo
from encoder_common.errors import InvalidItemError, OverloadedError
from encoder_common.sources import SourceReader
from protos import encoder_pb2 as pb

from .batcher import Batcher, TimedEmbedding
from .cache import EmbeddingCache, cache_namespace, content_key
from .config import ServerConfig
from .models import PreparedImage, VisionEncoder
from .payload import ItemOut, ItemPayload
from .profiles import PROFILES, PreprocessProfile

# Items up to this size are read and hashed on the event loop (sha256 runs at 0.4-1.6 GB/s here: at
# most ~2 ms for 1 MiB, ~0.45 ms for a typical 465 KB JPEG, ~20 us when the digest memo knows the
# bytes): cheaper than the round trip to a preprocessing thread, which on a loaded host costs more
# than the hash itself and was half of a cache hit's per-call time.
INLINE_READ_BYTES = 1 << 20


class PendingForward:
    """An item preprocessed for this call, whose forward waits to be let through: what it will hold (its
    pixel values until the forward is over, then its payload) and the sender's answer, `let_through()`
    or `refuse(exc)` (the computation then fails with `exc`, for every call waiting for it)."""

    __slots__ = ("_asked", "_go", "index", "input_bytes", "output_bytes")

    def __init__(self, index: int):
        loop = asyncio.get_running_loop()
        self.index = index
        self.input_bytes = 0  # the preprocessed pixel values
        self.output_bytes = 0  # the output tensors, as the payload's bytes
        # True once the computation waits for the answer; False when the payload came without it asking.
        self._asked = loop.create_future()
        self._go = loop.create_future()

    def let_through(self) -> None:
        if not self._go.done():
            self._go.set_result(None)

    def refuse(self, exc: BaseException) -> None:
        if not self._go.done():
            self._go.set_exception(exc)

    async def ask(self, input_bytes: int, output_bytes: int) -> None:
        """The computation's side: says what the forward will hold, then waits for the answer."""
        self.input_bytes, self.output_bytes = input_bytes, output_bytes
        if not self._asked.done():
            self._asked.set_result(True)
        await self._go

    def _came(self, computing: asyncio.Future) -> None:
        if not self._asked.done():  # another call's computation, or a failure before the forward
            self._asked.set_result(False)


# One item's flow: a PendingForward first when this call computes the item's payload, then its ItemOut.
ItemFlow = AsyncIterator[PendingForward | ItemOut]


async def ready(out: ItemOut) -> ItemFlow:
    """The flow of an item whose payload is already there (a lease's)."""
    yield out


class ItemPipeline:
    """Gives each item of a call its flow; used from the server's event loop."""

    def __init__(
        self,
        encoder: VisionEncoder,
        batcher: Batcher,
        preprocess_pool: Executor,
        config: ServerConfig,
        cache: EmbeddingCache | None = None,
        *,
        keys: bool = False,
        profile: PreprocessProfile | None = None,
    ):
        """`keys`: compute each item's content key even with the cache off (leases name items by it).
        `profile`: how bytes become pixel values; None: the config's `preprocess_profile`."""
        self.profile = profile or PROFILES[config.preprocess_profile]
        self.encoder = encoder
        self.batcher = batcher
        self.preprocess_pool = preprocess_pool
        self.config = config
        self.sources = SourceReader(config.sources, user_agent="encoder-server")
        self.cache = cache
        self.namespace = cache_namespace(encoder.spec, self.profile) if keys or cache is not None else None
        self.digests = DigestMemo()
        self._preprocessing = 0  # items of admitted calls not yet in the batcher's queue (nor done)
        # Held from an item's preprocessing until its forward is let through (it may wait for room).
        self._prepare_slots = asyncio.Semaphore(config.preprocess_workers)

    def admit(self, items: Sequence[pb.ImageItem], images: Sequence[memoryview | None] | None = None) -> Admitted:
        """Admits a call's items: `with pipeline.admit(items) as flows:` gives each one's flow, not started
        (ItemSender runs them). `images`: per item, its image bytes where the request was parsed without
        them (EncodeCall).

        Raises OverloadedError at once, before any decoding, when the items would not fit beside
        those queued and those still being read or preprocessed: under overload refusals stay fast.
        """
        self.check_room(len(items))
        admissions = [_Admission(self) for _ in items]
        images = images or [None] * len(items)
        return Admitted([self._flow(*each) for each in zip(items, images, admissions)], admissions)

    def check_room(self, num_items: int) -> None:
        """Raises OverloadedError when `num_items` more would not fit beside the items queued and
        those still being read or preprocessed."""
        self.batcher.check_room(num_items + self._preprocessing)

    async def _flow(self, item: pb.ImageItem, image: memoryview | None, admission: _Admission) -> ItemFlow:
        """One item's flow: its bytes read and hashed, then the cache's payload, or this call's computation
        (or another call's, when one is under way for the same image). Errors name the item."""
        try:
            source = item.WhichOneof("source")
            if source == "data":
                data = item.data if image is None else image  # each access of `item.data` copies it
            elif source == "url":
                with tracing.span("encoder.fetch_image", attributes={"encoder.item.index": item.index}):
                    data = await self.sources.read(item.url)
            elif item.content_sha256:
                yield self._referenced(item)
                return
            else:
                raise InvalidItemError("item has no data, url or content_sha256")
            if len(data) <= INLINE_READ_BYTES:
                digest = self._digest(item, data)
            else:
                loop = asyncio.get_running_loop()
                digest = await loop.run_in_executor(self.preprocess_pool, self._digest, item, data)
            key = None if self.namespace is None else content_key(self.namespace, digest)
            payload = None if self.cache is None else self.cache.hit(key)
            hit = payload is not None
            if not hit:
                forward = PendingForward(item.index)
                computing = asyncio.ensure_future(self._computation(key, data, admission, forward))
                computing.add_done_callback(forward._came)
                try:
                    if await forward._asked:
                        yield forward
                    payload, hit = await computing
                finally:
                    if not computing.done():
                        # Its computation is cancelled, unless another call waits for it: that one then
                        # has it go on, uncharged, since this call is gone.
                        computing.cancel()
                        computing.add_done_callback(lambda _: forward.let_through())
            # While the cache keeps it, the caller may name this image by its sha256 alone (revision 3).
            held = digest if self.cache is not None and self.cache.holds(key) else None
            yield ItemOut(item.index, payload, cache_hit=hit, key=key, content_sha256=held)
        except InvalidItemError as exc:
            raise InvalidItemError(f"item {item.index}: {exc}") from None
        finally:
            admission.done()

    def _referenced(self, item: pb.ImageItem) -> ItemOut:
        """An item named by its image's sha256 alone: the cache's payload, or an ItemOut without one
        (not held) when the cache has none (or there is no cache)."""
        digest = item.content_sha256
        if len(digest) != 32:
            raise InvalidItemError(f"content_sha256 is {len(digest)} bytes; a sha256 digest has 32")
        if self.cache is None:
            return ItemOut(item.index, None)
        key = self.cache.key(digest)
        payload = self.cache.lookup(key)
        if payload is None:
            return ItemOut(item.index, None)
        return ItemOut(item.index, payload, cache_hit=True, key=key, content_sha256=digest)

    def _digest(self, item: pb.ImageItem, data: bytes) -> bytes | None:
        """The sha256 of the item's bytes, where its content key or the content_sha256 it carries needs
        it (a mismatch refused); on a preprocessing thread unless small."""
        if self.namespace is None and not item.content_sha256:
            return None
        digest = self.digests.sha256(data)
        if item.content_sha256 and digest != item.content_sha256:
            raise InvalidItemError("content_sha256 does not match the item's bytes")
        return digest

    async def _computation(
        self, key: bytes | None, data: bytes, admission: _Admission, forward: PendingForward
    ) -> tuple[ItemPayload, bool]:
        """The item's payload and whether it was a hit: through the cache, which runs one computation
        per key however many calls want it, or computed for this call alone."""
        compute = functools.partial(self._compute, data, admission, forward)
        if self.cache is None:
            return await compute(), False
        return await self.cache.get_or_compute(key, compute)

    async def _compute(self, data: bytes, admission: _Admission, forward: PendingForward) -> ItemPayload:
        """Decode and preprocess one item, wait for `forward` to be let through, then forward it
        (batched with other calls' items) and frame its payload. An item waiting to be let through
        keeps its preprocessing slot, so at most `preprocess_workers` prepared items wait outside the
        stream budget."""
        loop = asyncio.get_running_loop()
        async with self._prepare_slots:
            started = time.perf_counter()
            try:
                prepared = await loop.run_in_executor(self.preprocess_pool, tracing.in_context(self._prepare), data)
                preprocess_ms = (time.perf_counter() - started) * 1000
                pixels, spec = prepared.pixel_values, self.encoder.spec
                output = (1 + spec.num_deepstack_layers) * prepared.num_tokens * spec.hidden_size
                await forward.ask(pixels.numel() * pixels.element_size(), output * spec.dtype.itemsize)
            except (OverloadedError, asyncio.CancelledError) as exc:
                # The exception's traceback keeps this frame until the cyclic collector runs: without the
                # pixel values, which would otherwise stay resident, uncharged, for every call refused meanwhile.
                prepared = None
                if isinstance(exc, asyncio.CancelledError):  # its call went away before the item reached the queue
                    self.batcher.item_cancelled_before_queue()
                raise
        submitted_ns = tracing.now_ns()
        (future,) = self.batcher.submit([prepared])
        admission.done()  # it counts in the batcher's queue now
        encoded = await future
        if tracing.enabled():
            _trace_batch(submitted_ns, encoded, forward.index)
        return ItemPayload.build(prepared, encoded, preprocess_ms)

    def _prepare(self, data: bytes) -> PreparedImage:
        """Bytes to pixel values as the profile's engine makes them, on a preprocessing thread."""
        config = self.config
        with tracing.span("encoder.decode", attributes={"encoder.image_bytes": len(data)}):
            image = self.profile.decode(data, max_pixels=config.max_image_pixels, max_aspect_ratio=config.max_aspect_ratio)
        try:
            with tracing.span("encoder.preprocess"):
                return replace(self.encoder.preprocess(image, self.profile), image_size=image.size)
        except ValueError as exc:  # the processor's own refusals (sizes, ratios) of a decodable image
            raise InvalidItemError(f"the image processor refused it: {exc}") from None


class Admitted:
    """A call's admitted items: their flows, and their places in the pipeline's count, given back on exit
    for those whose flow never ran or was cut short."""

    __slots__ = ("_admissions", "flows")

    def __init__(self, flows: list[ItemFlow], admissions: list[_Admission]):
        self.flows = flows
        self._admissions = admissions

    def __enter__(self) -> list[ItemFlow]:
        return self.flows

    def __exit__(self, *exc_info: object) -> None:
        for admission in self._admissions:
            if admission.pending:
                admission.done()


class _Admission:
    """One admitted item's place in the pipeline's count of items not yet queued; given back once."""

    __slots__ = ("pipeline", "pending")

    def __init__(self, pipeline: ItemPipeline):
        self.pipeline = pipeline
        self.pending = True
        pipeline._preprocessing += 1

    def done(self) -> None:
        if self.pending:
            self.pending = False
            self.pipeline._preprocessing -= 1


def _trace_batch(submitted_ns: int, encoded: TimedEmbedding, index: int) -> None:
    """An item's wait in the batcher's queue and its batch's forward, as spans timed by the batcher."""
    forward_ns = submitted_ns + int(encoded.queue_ms * 1e6)
    tracing.interval("encoder.queue", submitted_ns, forward_ns, {"encoder.item.index": index})
    attributes = {
        "encoder.item.index": index,
        "encoder.batch.size": encoded.batch_size,
        "encoder.batch.tokens": encoded.batch_tokens,
    }
    tracing.interval("encoder.forward", forward_ns, forward_ns + int(encoded.forward_ms * 1e6), attributes)
