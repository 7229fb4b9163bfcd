"""The transport section: the data plane, our gRPC stream and same-host shared memory against bare
grpcio, pyzmq raw frames, memcpy and (when installed) Mooncake's TCP transfer engine, with the ceiling
each goal's baselines set in the same run. docs/performance-dataplane.md describes every figure."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import grpc
import numpy as np
import torch

from encoder_common.copies import copy_bytes
from protos import encoder_pb2 as pb
from testkit.bare_grpc import receive_payload
from testkit.bench_harness import Stopwatch, interleaved, median, paired_ratio, summary, timed

from .context import Context
from .profile import MiB
from .transport_baselines import CONTROL, mooncake_gbps
from .transport_items import (
    IN_FLIGHT,
    SERVED_SIDE,
    SERVED_SIZE,
    SMALL,
    SMALL_TOKENS,
    TRANSPORT_HIDDEN,
    item_bytes,
    request_jpeg,
)

# memcpy_cold: between two turns of one pair of buffers, the others copy this many times the size of
# the last-level cache, so that no copy finds its bytes there.
COLD_CACHES = 2
FLOORS = ("request_ack", "jpeg_decode")  # what `ceilings` is computed from (see TransportRun.floor_ms)
KINDS = ("bare_seq", "bare_x4", "bare_named_seq", "bare_named_x4", "stream_cached_seq", "stream_cached_x4",
         "stream_computed_seq", "stream_computed_x4", "shm", "shm_x4", "zmq", "memcpy", "memcpy_threads",
         "memcpy_cold")  # fmt: skip
# The server users run (SERVED_SIZE only): its cached item over the stream and through shared memory, each
# beside the same kind on the stand-in ("stream_cached_seq", ...), whose payload has the same bytes.
SERVED_KINDS = {"served_cached_seq": "stream_cached_seq", "served_cached_x4": "stream_cached_x4",
                "served_shm": "shm", "served_shm_x4": "shm_x4"}  # fmt: skip


def cache_bytes() -> int:
    """The size in bytes of the highest-level cache (Linux's sysfs), 32 MiB where it does not say."""
    levels = {}
    for cache in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        with contextlib.suppress(OSError, ValueError):
            size = (cache / "size").read_text().strip()
            if size.endswith("K"):
                levels[int((cache / "level").read_text())] = int(size[:-1]) << 10
    return levels[max(levels)] if levels else 32 * MiB


def cold_pairs(nbytes: int, cache: int) -> int:
    """How many pairs of `nbytes` buffers memcpy_cold cycles through, past a cache of `cache` bytes."""
    return -(-COLD_CACHES * cache // (2 * nbytes)) + 1


async def in_flight(calls: Sequence[Callable[[], Awaitable[None]]], width: int) -> float:
    """Runs the calls `width` at a time (one after another when 1); returns the seconds taken."""
    queue = list(reversed(calls))

    async def worker() -> None:
        while queue:
            await queue.pop()()

    return await timed(lambda: asyncio.gather(*(worker() for _ in range(width))))


class TransportRun:
    """The section's clients (receivers per item size, a bare channel, zmq sockets), its items, and
    each of its measures."""

    def __init__(self, ctx: Context):
        import zmq

        from receiver import EncoderReceiver

        self.p, servers, sizes = ctx.profile, ctx.servers, ctx.profile.transport_sizes
        fixed = {size: servers[f"fixed-{size}"].url for size in sizes}
        fixed[SMALL] = servers["fixed-small"].url
        self.stream_rx = {size: EncoderReceiver([url], transfer="grpc") for size, url in fixed.items()}
        self.shm_rx = {size: EncoderReceiver([fixed[size]], transfer="shm") for size in sizes}
        served = servers["served"].url
        self.served_rx = {"stream": EncoderReceiver([served], transfer="grpc"), "shm": EncoderReceiver([served], transfer="shm")}
        self.served_image = request_jpeg(seed=2, side=SERVED_SIDE)
        self.bare_channel = grpc.aio.insecure_channel(f"127.0.0.1:{servers['bare-grpc'].port}")
        self.cached_image = request_jpeg(seed=0)
        self.small_image = request_jpeg(seed=1, side=224)
        self.n_calls = {
            size: max(IN_FLIGHT, self.p.transport_bytes // size // IN_FLIGHT * IN_FLIGHT) for size in sizes
        }
        # Computed items need an image no call sent before: one per call of both computed modes, every round.
        rounds = self.p.transport_rounds
        self.fresh = {
            size: iter([request_jpeg(seed) for seed in ctx.seeds.take(2 * self.n_calls[size] * rounds)])
            for size in sizes
        }
        self.zctx = zmq.Context()
        self.pull, self.control = self.zctx.socket(zmq.PULL), self.zctx.socket(zmq.REQ)
        self.pull.connect(f"tcp://127.0.0.1:{servers['zmq-push'].port}")
        self.control.connect(f"tcp://127.0.0.1:{CONTROL.search(servers['zmq-push'].log()).group(1)}")
        self.bare_calls = {
            size: self.bare_channel.unary_stream(f"/bench.Bare/Stream{item_bytes(size)}")
            for size in [*sizes, SMALL]
        }
        self.ack = self.bare_channel.unary_unary("/bench.Bare/Ack")
        self.copies = {
            size: [np.random.default_rng(size).integers(0, 256, (2, item_bytes(size)), dtype=np.uint8)]
            for size in sizes
        }
        cache = cache_bytes()
        self.cold_copies = {
            size: [np.ones((2, nbytes), np.uint8) for _ in range(cold_pairs(nbytes, cache))]
            for size, nbytes in zip(sizes, map(item_bytes, sizes))
        }

    async def close(self) -> None:
        for receiver in [*self.stream_rx.values(), *self.shm_rx.values(), *self.served_rx.values()]:
            await receiver.close()
        await self.bare_channel.close()
        self.zctx.destroy(linger=0)

    @staticmethod
    def bare_request(image: bytes, *, named: bool = False) -> bytes:
        """The very bytes our receiver sends: the image, or (`named`) its sha256 alone, as our receiver
        names an image the encoder said it keeps (docs/wire-protocol.md#image-references-revision-3)."""
        if named:
            item = pb.ImageItem(index=0, modality=pb.IMAGE, content_sha256=hashlib.sha256(image).digest())
        else:
            item = pb.ImageItem(index=0, modality=pb.IMAGE, data=image)
        return pb.EncodeRequest(request_id="bare", items=[item]).SerializeToString()

    @staticmethod
    def ours_call(receiver, image: bytes, size: int, cached: bool):
        async def call() -> None:
            (item,) = (await receiver.encode("bench", [{"data": image}])).items
            assert item.cache_hit == cached and item.embedding.numel() * 2 == item_bytes(size)

        return call

    def bare_call(self, size: int, request: bytes):
        async def call() -> None:
            await receive_payload(self.bare_calls[size](request), item_bytes(size))

        return call

    async def measure(self, size: int, kind: str) -> float:
        """Bytes per second (GB/s) of one figure; `kind` is what moves and how."""
        n, nbytes = self.n_calls[size], item_bytes(size)
        width = IN_FLIGHT if kind.endswith("_x4") else 1
        if kind.startswith("bare"):
            request = self.bare_request(self.cached_image, named=kind.startswith("bare_named"))
            calls = [self.bare_call(size, request)] * n
        elif kind.startswith("stream_computed"):
            calls = [
                self.ours_call(self.stream_rx[size], next(self.fresh[size]), size, False) for _ in range(n)
            ]
        elif kind.startswith("served"):
            receiver = self.served_rx["shm" if "shm" in kind else "stream"]
            await receiver.encode("bench", [{"data": self.served_image}])  # untimed, as for the stand-in below
            calls = [self.ours_call(receiver, self.served_image, size, True)] * n
        elif kind.startswith(("stream", "shm")):
            receiver = (self.stream_rx if kind.startswith("stream") else self.shm_rx)[size]
            # Untimed: the computed measures' items can have pushed the cached one out of the server's cache.
            await receiver.encode("bench", [{"data": self.cached_image}])
            calls = [self.ours_call(receiver, self.cached_image, size, True)] * n
        elif kind == "zmq":
            return n * nbytes / await asyncio.to_thread(self.zmq_pull, nbytes, n) / 1e9
        else:  # memcpy: one thread, split across threads as the server writes a segment, or from memory
            pairs = (self.cold_copies if kind == "memcpy_cold" else self.copies)[size]
            copy = copy_bytes if kind == "memcpy_threads" else np.copyto
            return n * nbytes / self.memcpy(pairs, n, copy) / 1e9
        return n * nbytes / await in_flight(calls, width) / 1e9

    def zmq_pull(self, nbytes: int, n: int) -> float:
        from receiver.buffers import POOL

        watch = Stopwatch()
        self.control.send(f"{nbytes} {n}".encode())
        self.control.recv()
        for _ in range(n):
            _meta, frame = self.pull.recv_multipart(copy=False)
            tensor = POOL.empty((nbytes,), torch.uint8)
            tensor.numpy()[:] = np.frombuffer(frame.buffer, np.uint8)
        return watch.seconds()

    @staticmethod
    def memcpy(pairs: Sequence[np.ndarray], n: int, copy: Callable[[np.ndarray, np.ndarray], None]) -> float:
        """Host copies into buffers whose pages are already mapped, each pair of `pairs` in turn: the
        physical limit (one pair: the copy's bytes stay in the cache from one copy to the next)."""
        watch = Stopwatch()
        for i in range(n):
            src, dst = pairs[i % len(pairs)]
            copy(dst, src)
        return watch.seconds()

    async def small_latency(self, kind: str) -> float:
        """Milliseconds per one-item call of a cached 64-token item (448 KiB), one call at a time."""
        n = 10 * self.p.transport_rounds
        if kind == "bare":
            calls = [self.bare_call(SMALL, self.bare_request(self.small_image))] * n
        else:
            calls = [self.ours_call(self.stream_rx[SMALL], self.small_image, SMALL, True)] * n
        return await in_flight(calls, 1) / n * 1000

    async def floor_ms(self, kind: str) -> float:
        """Milliseconds of what bounds the goals out of reach, one at a time: "request_ack", a bare
        grpcio call carrying the request of a cached item (the image named by its sha256) and answering
        two bytes; "jpeg_decode", the request's JPEG decoded as the server decodes it."""
        from encoder_server.images import decode_image

        n = 10 * self.p.transport_rounds
        request = self.bare_request(self.cached_image, named=True)
        watch = Stopwatch()
        for _ in range(n):
            if kind == "request_ack":
                await self.ack(request)
            else:
                decode_image(self.cached_image)
        return watch.seconds() / n * 1000

    async def warm_up(self) -> None:
        """The cached items computed once; connections made and shared-memory pools grown."""
        for size in [*self.p.transport_sizes, SMALL]:
            image = self.small_image if size == SMALL else self.cached_image
            await self.ours_call(self.stream_rx[size], image, size, False)()
        await self.ours_call(self.served_rx["stream"], self.served_image, SERVED_SIZE, False)()  # a real forward
        for size in self.p.transport_sizes:
            for kind in kinds_at(size):
                if not kind.startswith("stream_computed"):
                    await self.measure(size, kind)
        await self.small_latency("bare")
        await self.small_latency("ours")
        await self.floor_ms("request_ack")

    def measures(self) -> dict[str, Callable[[], Awaitable[float]]]:
        sizes = self.p.transport_sizes
        measures = {
            f"{size // MiB} MiB {kind}": functools.partial(self.measure, size, kind)
            for size in sizes
            for kind in kinds_at(size)
        }
        measures.update(
            {f"small {kind}": functools.partial(self.small_latency, kind) for kind in ("bare", "ours")}
        )
        measures.update({f"floor {kind}": functools.partial(self.floor_ms, kind) for kind in FLOORS})
        return measures


def kinds_at(size: int) -> tuple[str, ...]:
    """What is measured at an item size: every kind, and the server users run's at its size."""
    return KINDS + tuple(SERVED_KINDS) if size == SERVED_SIZE else KINDS


async def run(ctx: Context) -> dict:
    transport = TransportRun(ctx)
    try:
        await transport.warm_up()
        runs = await interleaved("dataplane", ctx.profile.transport_rounds, transport.measures())
        mooncake, engine = {}, None
        if "mooncake" in ctx.servers:
            mooncake = await mooncake_gbps(
                ctx.servers["mooncake"], ctx.profile.transport_bytes, ctx.profile.transport_sizes
            )
            from .transport_engine import run as engine_rows  # it builds on this module

            engine = await engine_rows(ctx, transport)
    finally:
        await transport.close()
    out: dict = {
        "hidden_size": TRANSPORT_HIDDEN,
        "request_jpeg_bytes": len(transport.cached_image),
        "calls_in_flight": IN_FLIGHT,
    }
    floors = out["floor_ms"] = {kind: median(runs[f"floor {kind}"]) for kind in FLOORS}
    for size in ctx.profile.transport_sizes:
        out[f"{size // MiB}MiB"] = size_row(
            size, {kind: runs[f"{size // MiB} MiB {kind}"] for kind in kinds_at(size)}, floors, mooncake
        )
    out["small"] = {
        "tokens": SMALL_TOKENS,
        "payload_bytes": item_bytes(SMALL),
        "ours_ms": summary(runs["small ours"]),
        "bare_ms": summary(runs["small bare"]),
        "ours_vs_bare_latency": paired_ratio(runs["small ours"], runs["small bare"]),
    }
    out["mooncake"] = "measured" if mooncake else ctx.mooncake_skipped
    if engine is not None:
        out["engine"] = engine
    return out


def size_row(
    size: int, by: dict[str, list[float]], floors: dict[str, float], mooncake: dict[int, float]
) -> dict:
    """One item size's figures: GB/s of every kind, with each goal's ratio and its ceiling."""
    best_bare = [max(a, b) for a, b in zip(by["bare_seq"], by["bare_x4"])]

    def ratio(a, b) -> float:
        return paired_ratio(by[a] if isinstance(a, str) else a, by[b] if isinstance(b, str) else b)

    streams = [kind for kind in KINDS if kind.startswith("stream")]
    row = {
        "payload_bytes": item_bytes(size),
        "gbps": {kind: median(values) for kind, values in by.items()},
        "runs_gbps": by,
        "stream_vs_best_bare": {kind: ratio(kind, best_bare) for kind in streams},
        # Against bare grpcio run the same way (one call at a time, or 4 in flight).
        "stream_vs_bare_same_mode": {
            kind: ratio(kind, "bare_x4" if kind.endswith("_x4") else "bare_seq") for kind in streams
        },
        # A cached item against bare grpcio carrying the very request our receiver sent for it (the
        # image named by its sha256): the transport alone, the request's size set aside.
        "stream_vs_bare_same_request": {
            f"stream_cached_{mode}": ratio(f"stream_cached_{mode}", f"bare_named_{mode}") for mode in ("seq", "x4")
        },
        # One call at a time, and 4 in flight (pyzmq's PUSH sends its frames back to back).
        "shm_vs_zmq": ratio("shm", "zmq"),
        "shm_vs_memcpy": ratio("shm", "memcpy"),
        "shm_x4_vs_zmq": ratio("shm_x4", "zmq"),
        "shm_x4_vs_memcpy": ratio("shm_x4", "memcpy"),
        # Against a copy whose bytes come from memory, as a server's copy between calls does.
        "shm_vs_memcpy_cold": ratio("shm", "memcpy_cold"),
        "shm_x4_vs_memcpy_cold": ratio("shm_x4", "memcpy_cold"),
        # One-item latency, shared memory over the stream (one call at a time, cached item).
        "shm_latency_vs_stream": ratio("stream_cached_seq", "shm"),
        "shm_latency_ms": 1e3 * item_bytes(size) / 1e9 / median(by["shm"]),
        "stream_latency_ms": 1e3 * item_bytes(size) / 1e9 / median(by["stream_cached_seq"]),
    }
    row["ceilings"] = ceilings(item_bytes(size), row["gbps"], floors)
    if "served_cached_seq" in by:
        # The server users run against its stand-in, each pair in the same round; and against the baselines
        # of the goals the stand-in is held to.
        row["served"] = {
            "vs_standin": {kind: ratio(kind, standin) for kind, standin in SERVED_KINDS.items()},
            "vs_bare_same_mode": {f"served_cached_{m}": ratio(f"served_cached_{m}", f"bare_{m}") for m in ("seq", "x4")},
            "shm_vs_zmq": ratio("served_shm", "zmq"),
            "shm_x4_vs_zmq": ratio("served_shm_x4", "zmq"),
        }
    if size in mooncake:
        row["mooncake_gbps"] = mooncake[size]
        row["stream_vs_mooncake"] = median(by["stream_cached_seq"]) / mooncake[size]
    return row


def ceilings(nbytes: int, gbps: dict[str, float], floors: dict[str, float]) -> dict[str, float]:
    """The most a goal's ratio could reach in this run, set by what no server of ours can skip:

    - stream_cached_seq: one call at a time is bare grpcio's own sequential rate against the best bare.
    - stream_computed_seq: a new image is decoded before its payload exists, then streamed at best as
      bare grpcio streams one call at a time.
    - stream_computed_x4: bare grpcio with 4 in flight keeps both cores busy on this VM (see
      docs/performance-dataplane.md), so the decoding's CPU adds to it, spread over every core.
    - shm_seq_vs_zmq: an item placed over gRPC costs at least a call that carries its request (a cached
      item's: the image named by its sha256), even if its payload moved for free.
    """
    ms = {kind: nbytes / 1e6 / gbps[kind] for kind in ("bare_seq", "bare_x4", "zmq")}  # per item
    best = min(ms["bare_seq"], ms["bare_x4"])
    return {
        "stream_cached_seq": best / ms["bare_seq"],
        "stream_computed_seq": best / (ms["bare_seq"] + floors["jpeg_decode"]),
        "stream_computed_x4": best / (ms["bare_x4"] + floors["jpeg_decode"] / (os.cpu_count() or 1)),
        "shm_seq_vs_zmq": ms["zmq"] / floors["request_ack"],
    }
