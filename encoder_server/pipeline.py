"""An Encode call's items from their bytes to framed payloads: admission, reading, the embedding
cache, preprocessing on a thread pool and the batcher's forwards."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Executor

from protos import encoder_pb2 as pb
from encoder_common import tracing
from encoder_common.digests import DigestMemo
from encoder_common.errors import InvalidItemError, OverloadedError
from encoder_common.sources import SourceReader

from .batcher import Batcher, TimedEmbedding
from .cache import EmbeddingCache, cache_namespace, content_key
from .payload import ItemPayload
from .config import ServerConfig
from .models import PreparedImage, VisionEncoder
from .profiles import PROFILES, PreprocessProfile
from .sender import ItemOut
from .streams import StreamCharge

# Items up to this size are read and hashed on the event loop (sha256 runs at 0.4-1.6 GB/s here: at
# most ~2 ms for 1 MiB, ~0.45 ms for a typical 465 KB JPEG, ~20 us when the digest memo knows the
# bytes): cheaper than the round trip to a preprocessing thread, which on a loaded host costs more
# than the hash itself and was half of a cache hit's per-call time.
INLINE_READ_BYTES = 1 << 20


class ItemPipeline:
    """Turns items into payloads; used from the server's event loop."""

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
        # Held from an item's preprocessing until it is charged (it may wait for room in between).
        self._prepare_slots = asyncio.Semaphore(config.preprocess_workers)

    async def payloads(
        self,
        items: Sequence[pb.ImageItem],
        charge: StreamCharge,
        images: Sequence[memoryview | None] | None = None,
    ) -> AsyncIterator[ItemOut]:
        """Each item's ItemOut (its payload, whether that came from the cache, its content key), in the
        items' order (an item named by reference whose embedding the cache lacks has no payload); each
        payload charged to the call's stream budget (the caller releases it once sent).
        `images`: per item, its image bytes where the request was parsed without them (EncodeCall).

        Raises OverloadedError at once, before any decoding, when the items would not fit beside
        those queued and those still being read or preprocessed: under overload refusals stay fast.
        Close it (`contextlib.aclosing`) so that the items of a call that went away leave the queue.
        """
        if not items:
            return
        self.check_room(len(items))
        self._preprocessing += len(items)
        images = images or [None] * len(items)
        if len(items) == 1:  # a lone item needs no task of its own: one turn of the event loop less
            yield await self._item_out(items[0], charge, images[0])
            return
        # Each item goes its own way (cache hit, another call's computation, or the batcher) as soon
        # as its bytes are read, in tasks started in the items' order; they are still yielded in order.
        tasks = [
            asyncio.ensure_future(self._item_out(item, charge, image)) for item, image in zip(items, images)
        ]
        for task in tasks:
            task.add_done_callback(_retrieve_exception)  # items left behind when an earlier one failed
        try:
            for task in tasks:
                yield await task
        finally:
            for task in tasks:
                task.cancel()  # no-op for finished ones; a cancelled call's items leave the queue

    def check_room(self, num_items: int) -> None:
        """Raises OverloadedError when `num_items` more would not fit beside the items queued and
        those still being read or preprocessed."""
        self.batcher.check_room(num_items + self._preprocessing)

    async def _item_out(self, item: pb.ImageItem, charge: StreamCharge, image: memoryview | None) -> ItemOut:
        """An item's payload, charged to the stream budget (a computed one from before its forward).
        Errors name the item."""
        loop = asyncio.get_running_loop()
        admitted = _Admission(self)
        try:
            source = item.WhichOneof("source")
            if source == "data":
                data = item.data if image is None else image  # each access of `item.data` copies it
            elif source == "url":
                with tracing.span("encoder.fetch_image", attributes={"encoder.item.index": item.index}):
                    data = await self.sources.read(item.url)
            elif item.content_sha256:
                return await self._referenced(item, charge)
            else:
                raise InvalidItemError("item has no data, url or content_sha256")
            if len(data) <= INLINE_READ_BYTES:
                digest = self._digest(item, data)
            else:
                digest = await loop.run_in_executor(self.preprocess_pool, self._digest, item, data)
            key = None if self.namespace is None else content_key(self.namespace, digest)
            compute = functools.partial(self._compute, data, admitted, charge, item.index)
            if self.cache is None:
                return ItemOut(item.index, await compute(), cache_hit=False, key=key)
            payload, hit = await self.cache.get_or_compute(key, compute)
            if hit:  # from the cache, or another call's computation: this stream holds it too
                await charge.reserve(item.index, payload.nbytes)
            # While the cache keeps it, the caller may name this image by its sha256 alone (revision 3).
            held = digest if self.cache.holds(key) else None
            return ItemOut(item.index, payload, cache_hit=hit, key=key, content_sha256=held)
        except InvalidItemError as exc:
            raise InvalidItemError(f"item {item.index}: {exc}") from None
        finally:
            admitted.done()

    async def _referenced(self, item: pb.ImageItem, charge: StreamCharge) -> ItemOut:
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
        await charge.reserve(item.index, payload.nbytes)
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

    async def _compute(self, data: bytes, admitted: _Admission, charge: StreamCharge, index: int) -> ItemPayload:
        """Decode, preprocess, forward (batched with other calls' items) and frame one item.

        The payload is charged to the stream budget before the forward makes it (twice: the output
        tensors live until their last chunk is framed), and so are the preprocessed pixel values until
        the forward is done (for a large image they outweigh its embedding several times): a call
        refused for want of room costs no forward and holds no output, and what waits for the
        batcher stays within the budget. An item waiting for room keeps its preprocessing slot, so at
        most `preprocess_workers` prepared items are held outside the budget.
        """
        loop = asyncio.get_running_loop()
        async with self._prepare_slots:
            started = time.perf_counter()
            try:
                prepared = await loop.run_in_executor(self.preprocess_pool, tracing.in_context(self._prepare), data)
                preprocess_ms = (time.perf_counter() - started) * 1000
                spec = self.encoder.spec
                payload_bytes = (1 + spec.num_deepstack_layers) * prepared.num_tokens * spec.hidden_size * spec.dtype.itemsize
                input_bytes = prepared.pixel_values.numel() * prepared.pixel_values.element_size()
                await charge.reserve(index, 2 * payload_bytes + input_bytes)  # the output, its chunks, the input
            except (OverloadedError, asyncio.CancelledError) as exc:
                # The exception's traceback keeps this frame until the cyclic collector runs: without the
                # pixel values, which would otherwise stay resident, uncharged, for every call refused meanwhile.
                prepared = None
                if isinstance(exc, asyncio.CancelledError):  # its call went away before the item reached the queue
                    self.batcher.item_cancelled_before_queue()
                raise
        submitted_ns = tracing.now_ns()
        (future,) = self.batcher.submit([prepared])
        admitted.done()  # it counts in the batcher's queue now
        encoded = await future
        if tracing.enabled():
            _trace_batch(submitted_ns, encoded, index)
        payload = ItemPayload.build(prepared, encoded, preprocess_ms)
        charge.release(index, input_bytes)
        return payload

    def _prepare(self, data: bytes) -> PreparedImage:
        """Bytes to pixel values as the profile's engine makes them, on a preprocessing thread."""
        config = self.config
        with tracing.span("encoder.decode", attributes={"encoder.image_bytes": len(data)}):
            image = self.profile.decode(data, max_pixels=config.max_image_pixels, max_aspect_ratio=config.max_aspect_ratio)
        try:
            with tracing.span("encoder.preprocess"):
                return self.encoder.preprocess(image, self.profile)
        except ValueError as exc:  # the processor's own refusals (sizes, ratios) of a decodable image
            raise InvalidItemError(f"the image processor refused it: {exc}") from None


class _Admission:
    """One admitted item's place in the pipeline's count of items not yet queued; given back once."""

    __slots__ = ("pipeline", "pending")

    def __init__(self, pipeline: ItemPipeline):
        self.pipeline = pipeline
        self.pending = True

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


def _retrieve_exception(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()
