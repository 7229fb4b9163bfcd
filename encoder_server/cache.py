"""The embedding cache: an LRU of framed item responses bounded in bytes, keyed by content, single-flight,
with the fleet-wide store (encoder_server/store.py) as an optional second tier behind it. A hit costs no
decode, preprocessing, forward or framing: its chunks are the bytes objects first sent."""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .metrics import CacheStats
from .models import ModelSpec
from .payload import ItemPayload
from .profiles import PreprocessProfile
from .store import EmbeddingStore

KEY_VERSION = b"encoder-cache-v3"  # v2: the preprocessing profile joined the namespace; v3: the backend


def cache_namespace(spec: ModelSpec, profile: PreprocessProfile) -> bytes:
    """A key is a sha256 over the image bytes' sha256 and this namespace, so equal keys mean equal embeddings.

    The part of every key that pins the model: its weights, preprocessing (the processor's settings,
    and the profile's loader and backend: two profiles never share an embedding), served dtype, and the
    backend running it with its release (transformers 5.24 and vLLM 0.32 may differ in the last bits)."""
    fields = (
        spec.model_type,
        spec.weights_fingerprint,
        spec.preprocess_fingerprint,
        f"{profile.name}/{profile.backend}",
        str(spec.dtype),
        f"{spec.backend} {spec.backend_version}",
    )
    return hashlib.sha256(b"\0".join([KEY_VERSION, *(f.encode() for f in fields)])).digest()


def content_key(namespace: bytes, content_sha256: bytes) -> bytes:
    """The key of an image whose bytes hash to `content_sha256`, under a model's `namespace`."""
    if len(content_sha256) != 32:
        raise ValueError(f"a sha256 digest has 32 bytes, got {len(content_sha256)}")
    return hashlib.sha256(namespace + content_sha256).digest()


@dataclass(eq=False)
class _Flight:
    task: asyncio.Task
    callers: int = 0


class EmbeddingCache:
    """LRU of ItemPayloads, at most `max_bytes` of chunks, with one computation per key in flight.

    Used from the server's event loop only (`key` is pure and may run anywhere). A caller that finds
    its key being computed by another call waits for that result instead of computing it again; the
    computation is cancelled only when every caller waiting for it has gone. With a `store`, a key the
    LRU lacks is looked up there before it is computed, and what is computed is put there.
    """

    def __init__(self, max_bytes: int, namespace: bytes, store: EmbeddingStore | None = None):
        if max_bytes < 1:
            raise ValueError(f"cache size must be positive, got {max_bytes} bytes")
        self.max_bytes = max_bytes
        self.namespace = namespace
        self.store = store
        self._entries: OrderedDict[bytes, ItemPayload] = OrderedDict()
        self._flights: dict[bytes, _Flight] = {}
        self.bytes = 0
        self.hits = 0  # served from the LRU, or from another call's computation
        self.misses = 0  # computations started
        self.evictions = 0
        self.not_held = 0  # references (`lookup`) it had no payload for

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> CacheStats:
        """What the metrics endpoint reports, read at each scrape."""
        return CacheStats(
            hits=self.hits, misses=self.misses, bytes_held=self.bytes, entries=len(self._entries),
            evictions=self.evictions, not_held=self.not_held,
        )  # fmt: skip

    def key(self, content_sha256: bytes) -> bytes:
        """The cache key of an image whose bytes hash to `content_sha256`."""
        return content_key(self.namespace, content_sha256)

    def get(self, key: bytes) -> ItemPayload | None:
        payload = self._entries.get(key)
        if payload is not None:
            self._entries.move_to_end(key)
        return payload

    def holds(self, key: bytes) -> bool:
        """Whether the LRU keeps `key`'s payload now (a lookup that is not counted nor refreshes it)."""
        return key in self._entries

    def hit(self, key: bytes) -> ItemPayload | None:
        """The payload held for `key`, counted as a hit, or None (not counted: a computation follows)."""
        payload = self.get(key)
        if payload is not None:
            self.hits += 1
        return payload

    def lookup(self, key: bytes) -> ItemPayload | None:
        """The payload of an item named by reference (its image's sha256), counted as a hit, or None."""
        payload = self.hit(key)
        if payload is None:
            self.not_held += 1
        return payload

    def put(self, key: bytes, payload: ItemPayload) -> None:
        """Stores a payload, evicting the least recently used; one larger than the whole cache is skipped."""
        if payload.nbytes > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        self._entries[key] = payload
        self.bytes += payload.nbytes
        while self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.nbytes
            self.evictions += 1

    async def get_or_compute(
        self, key: bytes, compute: Callable[[], Awaitable[ItemPayload]]
    ) -> tuple[ItemPayload, bool]:
        """The payload for `key` and whether it was a hit (here, in the store, or another call's
        computation); runs `compute` only if no one else is and the store does not have it.

        Errors of a computation reach every caller waiting for it and are not cached.
        """
        payload = self.hit(key)
        if payload is not None:
            return payload, True
        flight = self._flights.get(key)
        joined = flight is not None
        if flight is None:
            flight = _Flight(asyncio.ensure_future(self._fill(key, compute)))
            flight.task.add_done_callback(lambda task: self._landed(key, flight, task))
            self._flights[key] = flight
            self.misses += 1
        else:
            self.hits += 1
        flight.callers += 1
        try:
            payload, stored = await asyncio.shield(flight.task)
            return payload, joined or stored
        finally:
            flight.callers -= 1
            if flight.callers == 0 and not flight.task.done():
                # Nobody wants it any more: drop it (its item leaves the batcher's queue), and let the
                # next caller for this key start afresh rather than join a cancelled computation.
                flight.task.cancel()
                self._forget(key, flight)

    async def _fill(self, key: bytes, compute: Callable[[], Awaitable[ItemPayload]]) -> tuple[ItemPayload, bool]:
        """The payload for a key the LRU lacks, and whether the store had it."""
        if self.store is not None and (payload := await self.store.get(key)) is not None:
            return payload, True
        payload = await compute()
        if self.store is not None:
            self.store.put_soon(key, payload)
        return payload, False

    def _landed(self, key: bytes, flight: _Flight, task: asyncio.Task) -> None:
        self._forget(key, flight)
        if not task.cancelled() and task.exception() is None:
            self.put(key, task.result()[0])

    def _forget(self, key: bytes, flight: _Flight) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
