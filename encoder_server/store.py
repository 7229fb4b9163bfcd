"""The fleet-wide embedding store: a second tier behind each encoder's embedding cache, in Redis and shared
by every encoder of a fleet, entries checked on read, never on the answer's critical path for more than its
timeout (docs/fleet-store.md)."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Coroutine, Iterator
from dataclasses import dataclass, field

import torch
import xxhash
from google.protobuf.message import DecodeError
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from encoder_common.env_flags import flag
from encoder_common.histogram import PlainHistogram
from protos import encoder_pb2 as pb
from protos import wire

from .payload import ItemPayload

log = logging.getLogger(__name__)

# An entry: MAGIC, the key (32 bytes), the digest (16), the header's and the payload's lengths, the
# header (an ItemHeader without index or timing), the payload. The digest (xxh3-128) covers everything
# after it and the key: it catches a corrupted, truncated or misplaced entry. It is not a signature:
# whoever can write to the store can write a valid entry, so the store is as trusted as the encoders.
MAGIC = b"encoder-store-v1"
_LENGTHS = struct.Struct("<IQ")
_PREFIX_BYTES = len(MAGIC) + 32 + 16 + _LENGTHS.size
KEY_PREFIX = b"enc:"
# Failures in a row that open the breaker, and how long it then stays open before one call tries again.
BREAKER_FAILURES = 3
BREAKER_COOLDOWN_S = 1.0
# Puts (and drops of corrupt entries) under way at once; more puts are skipped: a slow store must not
# pile up copies of payloads.
MAX_BACKGROUND = 64
_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    url: str | None = field(
        default=None,
        metadata=flag(
            "Redis URL of the fleet-wide embedding store shared by the encoders (redis://host:6379/0; rediss:// "
            "for TLS); unset: none (docs/fleet-store.md)"
        ),
    )
    timeout_ms: float = field(
        default=100.0, metadata=flag("longest wait for one store lookup or put: a slower store costs a forward")
    )
    ttl_s: int = field(
        default=86400, metadata=flag("store entries expire this long after they are put (0: only by Redis's eviction)")
    )
    max_connections: int = field(default=32, metadata=flag("connections to the store at most"))

    def __post_init__(self) -> None:
        if self.url is not None:
            if not self.url.startswith(("redis://", "rediss://", "unix://")):
                raise ValueError(f"--store-url takes a redis://, rediss:// or unix:// URL, got {self.url!r}")
            if importlib.util.find_spec("redis") is None:  # an optional extra: only a server with a store needs it
                raise ValueError("--store-url needs the redis client: pip install 'encoder-service[server,store]'")
        if self.timeout_ms <= 0:
            raise ValueError(f"the store timeout must be positive, got {self.timeout_ms} ms")
        if self.ttl_s < 0:
            raise ValueError(f"the store TTL cannot be negative, got {self.ttl_s} s")
        if self.max_connections < 1:
            raise ValueError(f"the store needs at least one connection, got {self.max_connections}")


class CorruptEntry(ValueError):
    """An entry whose bytes do not check out against its key."""


def pack(key: bytes, payload: ItemPayload) -> bytes:
    """An item's payload as a store entry under `key`."""
    header = pb.ItemHeader()
    header.CopyFrom(payload.header)
    header.ClearField("timing")
    header.ClearField("index")
    header_bytes = header.SerializeToString()
    views = payload.payload_views()
    lengths = _LENGTHS.pack(len(header_bytes), sum(len(view) for view in views))
    body = b"".join([lengths, header_bytes, *views])
    return b"".join((MAGIC, key, _digest(key, body), body))


def unpack(key: bytes, entry: bytes) -> ItemPayload:
    """The payload of a store entry read under `key`; raises CorruptEntry unless every check passes."""
    if len(entry) < _PREFIX_BYTES or not entry.startswith(MAGIC):
        raise CorruptEntry("not an entry of this format")
    view = memoryview(entry)
    stored_key = view[len(MAGIC) : len(MAGIC) + 32]
    digest = view[len(MAGIC) + 32 : len(MAGIC) + 48]
    body = view[len(MAGIC) + 48 :]
    if stored_key != key:
        raise CorruptEntry("the entry was made for another key")
    header_len, payload_len = _LENGTHS.unpack_from(body)
    if len(body) != _LENGTHS.size + header_len + payload_len:
        raise CorruptEntry(f"{len(body)} bytes where its lengths say {_LENGTHS.size + header_len + payload_len}")
    if digest != _digest(key, body):
        raise CorruptEntry("its digest does not match its bytes")
    try:
        header = pb.ItemHeader.FromString(body[_LENGTHS.size : _LENGTHS.size + header_len])
    except DecodeError:
        raise CorruptEntry("its header does not parse") from None
    dtype = wire.TORCH_DTYPES.get(header.dtype)
    rows = header.num_tokens * header.hidden_size
    if dtype is None or header.payload_bytes != payload_len or payload_len != (1 + header.num_deepstack_layers) * rows * dtype.itemsize:
        raise CorruptEntry("its header does not describe its payload")
    header.cache_hit = True  # no work was done for it here
    payload = torch.frombuffer(bytearray(body[_LENGTHS.size + header_len :]), dtype=torch.uint8).view(dtype)
    parts = [payload[:rows].view(header.num_tokens, header.hidden_size)]
    if header.num_deepstack_layers:
        parts.append(payload[rows:].view(header.num_deepstack_layers, header.num_tokens, header.hidden_size))
    return ItemPayload(header, parts)


def _digest(key: bytes, body: bytes | memoryview) -> bytes:
    hasher = xxhash.xxh3_128(key)
    hasher.update(body)
    return hasher.digest()


class CircuitBreaker:
    """Closed while the store answers; open (every call skipped) for `cooldown_s` after `failures` failures
    in a row; then one call at a time tries it again, and a success closes it."""

    def __init__(self, failures: int = BREAKER_FAILURES, cooldown_s: float = BREAKER_COOLDOWN_S, clock=time.monotonic):
        self.failures = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._in_a_row = 0
        self._open_until: float | None = None
        self._trying = False

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    def allow(self) -> bool:
        """Whether a call may go to the store now; when it does, `outcome` must follow."""
        if self._open_until is None:
            return True
        if self._trying or self._clock() < self._open_until:
            return False
        self._trying = True
        return True

    def outcome(self, ok: bool | None) -> None:
        """A call that `allow` let through ended: it succeeded, failed, or (None) was given up by its caller."""
        trial, self._trying = self._trying, False
        if ok:
            self._in_a_row, self._open_until = 0, None
        elif ok is False:
            self._in_a_row += 1
            if trial or self._in_a_row >= self.failures:
                self._open_until = self._clock() + self.cooldown_s


@dataclass
class StoreStats:
    """Counts since start, read at each scrape."""

    lookups: Counter[str] = field(default_factory=Counter)  # hit, miss, corrupt, error, skipped
    puts: Counter[str] = field(default_factory=Counter)  # stored, error, skipped
    seconds: dict[str, PlainHistogram] = field(
        default_factory=lambda: {op: PlainHistogram(_SECONDS) for op in ("get", "put")}
    )


class EmbeddingStore:
    """The store's client in one encoder; used from the server's event loop.

    `get` answers a payload or None (not there, corrupt, or the store failed or took too long: all a
    miss to the caller); `put_soon` writes in the background. Neither ever raises.

    An entry is kept under the encoder cache's own key (the image's sha256 under the model's namespace:
    weights, preprocessing, dtype, backend) and carries that key, its header, its payload's size and a
    digest of all of them; an entry that fails any check on read is deleted and never served. The store is
    never on the answer's critical path for more than `timeout_ms`: a store that is down or slow costs a
    forward, and after BREAKER_FAILURES failures in a row it is left alone for BREAKER_COOLDOWN_S.
    """

    def __init__(self, config: StoreConfig):
        from redis.asyncio import BlockingConnectionPool, Redis  # the store extra, checked by StoreConfig
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.config = config
        self.timeout_s = config.timeout_ms / 1000
        pool = BlockingConnectionPool.from_url(
            config.url, max_connections=config.max_connections, timeout=self.timeout_s,
            socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s, retry=Retry(NoBackoff(), 0),
        )  # fmt: skip
        self._redis = Redis(connection_pool=pool)
        self.breaker = CircuitBreaker()
        self.stats = StoreStats()
        self._background: set[asyncio.Task] = set()

    async def check(self) -> None:
        """At start: says whether the store answers and whether it is bounded (a store without
        maxmemory and an evicting policy grows until Redis refuses writes). Never raises."""
        try:
            async with asyncio.timeout(max(1.0, self.timeout_s)):
                config = await self._redis.config_get("maxmemory*")
        except Exception as exc:  # a managed Redis may refuse CONFIG: only a warning either way
            log.warning("embedding store %s: cannot read its memory bound (%s)", self._where(), _why(exc))
            return
        config = {_text(name): _text(value) for name, value in config.items()}
        maxmemory, policy = int(config.get("maxmemory", 0)), config.get("maxmemory-policy", "")
        if not maxmemory or not policy.startswith("allkeys-"):
            log.warning(
                "embedding store %s: maxmemory %d, policy %s: it is not bounded; run Redis with --maxmemory and "
                "--maxmemory-policy allkeys-lru", self._where(), maxmemory, policy or "?",
            )  # fmt: skip
        else:
            log.info("embedding store %s: maxmemory %d bytes, %s", self._where(), maxmemory, policy)

    async def get(self, key: bytes) -> ItemPayload | None:
        if not self.breaker.allow():
            self.stats.lookups["skipped"] += 1
            return None
        ok, entry = await self._call("get", self._redis.get(KEY_PREFIX + key))
        if not ok:
            self.stats.lookups["error"] += 1
            return None
        if entry is None:
            self.stats.lookups["miss"] += 1
            return None
        try:
            payload = unpack(key, entry)
        except CorruptEntry as exc:
            self.stats.lookups["corrupt"] += 1
            log.warning("embedding store entry %s dropped: %s", key.hex()[:16], exc)
            self._spawn(self._drop(key, entry))
            return None
        self.stats.lookups["hit"] += 1
        return payload

    def put_soon(self, key: bytes, payload: ItemPayload) -> None:
        """Writes the payload under `key` in the background (skipped while the breaker is open or too
        many puts wait)."""
        if len(self._background) >= MAX_BACKGROUND or not self.breaker.allow():
            self.stats.puts["skipped"] += 1
            return
        self._spawn(self._put(key, pack(key, payload)))

    async def _put(self, key: bytes, entry: bytes) -> None:
        ok, _ = await self._call("put", self._redis.set(KEY_PREFIX + key, entry, ex=self.config.ttl_s or None))
        self.stats.puts["stored" if ok else "error"] += 1

    async def _call(self, op: str, command: Awaitable) -> tuple[bool, object]:
        """Runs one command the breaker let through, within the timeout: (True, its answer), or (False,
        None) when it failed or took too long. Timed, and told to the breaker."""
        started = time.perf_counter()
        ok: bool | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                answer = await command
            ok = True
            return True, answer
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            ok = False
            log.debug("embedding store %s failed: %s", op, _why(exc))
            return False, None
        finally:
            self.breaker.outcome(ok)
            self.stats.seconds[op].observe(time.perf_counter() - started)

    async def _drop(self, key: bytes, entry: bytes) -> None:
        """Deletes a corrupt entry, unless it was replaced meanwhile."""
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._redis.pipeline(transaction=True) as pipe:
                    await pipe.watch(KEY_PREFIX + key)
                    if await pipe.get(KEY_PREFIX + key) == entry:
                        pipe.multi()
                        pipe.delete(KEY_PREFIX + key)
                        await pipe.execute()
        except Exception as exc:  # a WatchError (replaced meanwhile) included: nothing to drop then
            log.debug("embedding store: corrupt entry not dropped: %s", _why(exc))

    def _spawn(self, work: Coroutine) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Waits up to the timeout for the puts under way, then closes the connections."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=self.timeout_s)
        for task in list(self._background):
            task.cancel()
        await self._redis.aclose()

    def _where(self) -> str:
        kwargs = self._redis.connection_pool.connection_kwargs
        return f"{kwargs.get('host', kwargs.get('path', '?'))}:{kwargs.get('port', '')}"

    def collector(self) -> Collector:
        return _StoreCollector(self)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class _StoreCollector(Collector):
    def __init__(self, store: EmbeddingStore):
        self.store = store

    def collect(self) -> Iterator:
        stats = self.store.stats
        lookups = CounterMetricFamily(
            "encoder_store_lookups",
            "Fleet-wide store lookups of items the embedding cache lacked, by outcome: hit, miss, corrupt (dropped), "
            "error (failed or timed out), skipped (breaker open)",
            labels=["outcome"],
        )
        for outcome in ("hit", "miss", "corrupt", "error", "skipped"):
            lookups.add_metric([outcome], stats.lookups[outcome])
        yield lookups
        puts = CounterMetricFamily(
            "encoder_store_puts", "Computed items written to the store, by outcome: stored, error, skipped", labels=["outcome"]
        )
        for outcome in ("stored", "error", "skipped"):
            puts.add_metric([outcome], stats.puts[outcome])
        yield puts
        yield CounterMetricFamily(
            "encoder_store_forwards_avoided", "Items served from the store instead of a forward", value=stats.lookups["hit"]
        )
        seconds = HistogramMetricFamily("encoder_store_seconds", "Duration of store operations", labels=["op"])
        for op, histogram in stats.seconds.items():
            seconds.add_metric([op], histogram.buckets(), sum_value=histogram.sum)
        yield seconds
        yield GaugeMetricFamily(
            "encoder_store_breaker_open", "1 while the store is left alone after failing", value=int(self.store.breaker.is_open)
        )
