"""Throughput benchmark of the encode path; every figure stands beside a baseline measured in the same run.

Sections: transport (the gRPC stream and same-host shared memory vs bare grpcio, pyzmq raw frames,
memcpy and, when installed, Mooncake's TCP transfer engine), serving overhead (a server vs the same
model in-process), batching (on vs off, 16 clients), scale-out (2 encoder processes vs 1), cache (hit
vs miss) and images/s by image size. Prints a table, writes JSON (--json). `--quick` is the short CI
run; `--device cuda` runs the real-size Qwen2.5-VL tower (random weights) on a GPU.

    python scripts/bench.py --json bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # this checkout's packages, not an installed copy

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from encoder_common.copies import copy_bytes  # noqa: E402
from encoder_common.malloc import tune_malloc  # noqa: E402
from protos import wire  # noqa: E402
from testkit.bare_grpc import receive_payload  # noqa: E402
from testkit.checkpoints import write_tower_checkpoint  # noqa: E402
from testkit.images import image_bytes  # noqa: E402
from testkit.launcher import LaunchedProcess, server_argv, start_process  # noqa: E402

MiB = 1 << 20
SECTIONS = ("transport", "serving", "batching", "scale_out", "cache", "image_sizes")


@dataclasses.dataclass(frozen=True)
class Profile:
    """How big each section runs: per device, and short for --quick."""

    device: str
    dtype: str
    torch_threads: int
    tower: dict  # Qwen2.5-VL vision_config of the compute-bound tower
    transport_sizes: tuple[int, ...]
    transport_bytes: int  # moved per transport measurement
    rounds: int  # measurements per figure, interleaved with its baseline; the median is reported
    serving_image: tuple[int, int]
    serving_images: int
    serving_clients: int
    batching_clients: int
    batching_requests: int  # per client
    batching_image: tuple[int, int]
    scale_requests: int
    scale_items: int  # images per request, sharded across the encoders
    cache_repeats: int
    image_sizes: tuple[tuple[int, int], ...]
    image_size_images: int
    preprocess_workers: int


def real_tower(depth: int) -> dict:
    """Qwen2.5-VL-7B's vision tower at its real width; `depth` 32 is the real model."""
    return dict(
        depth=depth,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=3584,
        fullatt_block_indexes=[i for i in (7, 15, 23, 31) if i < depth] or [depth - 1],
        window_size=112,
    )


TINY_TOWER = dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=2048,
                  fullatt_block_indexes=[1], window_size=112)  # fmt: skip


def profile_for(device: str, quick: bool) -> Profile:
    if device == "cuda":
        return Profile(
            device="cuda", dtype="bfloat16", torch_threads=4, tower=real_tower(32),
            transport_sizes=(7 * MiB, 32 * MiB), transport_bytes=(64 if quick else 512) * MiB, rounds=1 if quick else 3,
            serving_image=(448, 448), serving_images=32 if quick else 256, serving_clients=8,
            batching_clients=16, batching_requests=4 if quick else 32, batching_image=(56, 56),
            scale_requests=16 if quick else 64, scale_items=4, cache_repeats=3 if quick else 10,
            image_sizes=((448, 448), (896, 896)), image_size_images=32 if quick else 256, preprocess_workers=12,
        )  # fmt: skip
    return Profile(
        device="cpu", dtype="float32", torch_threads=1, tower=TINY_TOWER if quick else real_tower(1),
        transport_sizes=(7 * MiB, 32 * MiB), transport_bytes=(32 if quick else 256) * MiB, rounds=1 if quick else 7,
        serving_image=(112, 112), serving_images=4 if quick else 12, serving_clients=2,
        batching_clients=16, batching_requests=2 if quick else 12, batching_image=(56, 56),
        scale_requests=2 if quick else 8, scale_items=2, cache_repeats=2 if quick else 5,
        image_sizes=((112, 112), (224, 224)), image_size_images=4 if quick else 8, preprocess_workers=4,
    )  # fmt: skip


class Seeds:
    """Hands out image seeds no earlier request used."""

    def __init__(self):
        self._next = 1000

    def take(self, n: int) -> range:
        self._next += n
        return range(self._next - n, self._next)


# Child processes: the servers and the baselines' senders.


def role_zmq_push(args) -> None:
    """SGLang's data plane: PUSH two frames per item (metadata, raw tensor bytes) when told how many."""
    import zmq

    payloads = {size: np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes() for size in args.payload_bytes}
    context = zmq.Context()
    push, control = context.socket(zmq.PUSH), context.socket(zmq.REP)
    push_port = push.bind_to_random_port("tcp://127.0.0.1")
    control_port = control.bind_to_random_port("tcp://127.0.0.1")
    print(f"control on 127.0.0.1:{control_port}", flush=True)
    print(f"ready on 127.0.0.1:{push_port}", flush=True)
    while True:
        size, count = (int(x) for x in control.recv().split())
        control.send(b"go")
        meta = json.dumps({"shape": [size], "dtype": "uint8"}).encode()
        for _ in range(count):
            push.send_multipart([meta, payloads[size]], copy=False)


_CONTROL = re.compile(r"control on \S+:(\d+)")


class Children:
    """The benchmark's child processes, started side by side by testkit's launcher; all stopped at the end."""

    def __init__(self, log_dir: Path, timeout: float):
        self.log_dir = log_dir
        self.timeout = timeout
        self.started: list[LaunchedProcess] = []

    async def spawn(self, name: str, argv: Sequence[str], threads: int) -> LaunchedProcess:
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        log_path = self.log_dir / f"{name}.log"
        child = await asyncio.to_thread(start_process, argv, log_path, env=env, timeout=self.timeout)
        self.started.append(child)
        return child

    async def encoder_server(self, name: str, model_dir: Path, profile: Profile, *flags: str) -> LaunchedProcess:
        argv = server_argv(model_dir, "--device", profile.device, "--dtype", profile.dtype,
                           "--preprocess-workers", str(profile.preprocess_workers), *flags)  # fmt: skip
        return await self.spawn(name, argv, profile.torch_threads)

    async def role(self, name: str, role: str, threads: int, *flags: str) -> LaunchedProcess:
        return await self.spawn(name, [sys.executable, __file__, "--role", role, *flags], threads)

    def stop(self) -> None:
        for child in self.started:
            child.stop(grace_s=10)


# Measuring.


class Progress:
    """One tqdm bar per section; `step` after each measurement."""

    def __init__(self, section: str, total: int):
        self.bar = tqdm(total=total, desc=f"{section:<12}", unit="step", file=sys.stderr, leave=True, dynamic_ncols=True)

    def step(self, note: str = "") -> None:
        self.bar.set_postfix_str(note, refresh=False)
        self.bar.update()

    def close(self) -> None:
        self.bar.close()


async def interleaved(section: str, rounds: int, measures: dict[str, Callable[[], Awaitable[float]]]) -> dict[str, list[float]]:
    """Runs every measure once per round, under a progress bar; returns each one's results.

    The order changes from round to round (seeded), so no measure always follows the same
    neighbour or always runs first after a change of payload size.
    """
    runs: dict[str, list[float]] = {name: [] for name in measures}
    progress = Progress(section, rounds * len(measures))
    try:
        for round_index in range(rounds):
            order = list(measures)
            random.Random(round_index).shuffle(order)
            for name in order:
                runs[name].append(await measures[name]())
                progress.step(name)
    finally:
        progress.close()
    return runs


async def timed(run: Callable[[], Awaitable[None]]) -> float:
    started = time.perf_counter()
    await run()
    return time.perf_counter() - started


Call = Callable[[], Awaitable[int]]  # one request; returns how many items it carried


async def closed_loop(clients: int, requests: Sequence[Call]) -> float:
    """Runs the requests with `clients` in flight at a time; returns items per second."""
    queue = list(reversed(requests))
    return await concurrent_clients([queue] * clients)


async def concurrent_clients(per_client: Sequence[list[Call]]) -> float:
    """Each client pops and runs requests from its list, one at a time, all clients at once.

    Lists may be shared. Returns the items of all requests per second of wall time.
    """
    done: list[int] = []

    async def client(requests: list[Call]) -> None:
        while requests:
            done.append(await requests.pop()())

    seconds = await timed(lambda: asyncio.gather(*(client(requests) for requests in per_client)))
    return sum(done) / seconds


def cpu_seconds(pids: Sequence[int]) -> float:
    """CPU time (user + system, all threads) the processes have used so far, from /proc."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def encode_call(receiver, request_id: str, images: Sequence[bytes]) -> Call:
    async def call() -> int:
        result = await receiver.encode(request_id, [{"modality": "image", "data": d} for d in images])
        return len(result.items)

    return call


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def summary(values: Sequence[float]) -> dict:
    return {"median": median(values), "min": min(values), "max": max(values), "runs": list(values)}


def rates(runs: dict[str, list[float]], ours: str, baseline: str) -> dict:
    """Images/s of both sides and their paired ratio, keyed `<side>_images_per_s` and `ratio`."""
    return {
        f"{ours}_images_per_s": summary(runs[ours]),
        f"{baseline}_images_per_s": summary(runs[baseline]),
        "ratio": paired_ratio(runs[ours], runs[baseline]),
    }


def paired_ratio(ours: Sequence[float], baseline: Sequence[float]) -> float:
    """Median over rounds of ours / baseline, the two of each pair measured in the same round.

    On a shared machine the load drifts from round to round; a ratio taken within a round cancels
    most of that, where a ratio of two medians would not.
    """
    return median([a / b for a, b in zip(ours, baseline)])


# The sections. Each takes the run's context and returns its JSON dict.


@dataclasses.dataclass
class Context:
    profile: Profile
    children: Children
    workdir: Path
    seeds: Seeds = dataclasses.field(default_factory=Seeds)
    servers: dict[str, LaunchedProcess] = dataclasses.field(default_factory=dict)
    models: dict[str, Path] = dataclasses.field(default_factory=dict)
    mooncake_skipped: str | None = None  # why the Mooncake figures are absent


def load_in_process(ctx: Context):
    from encoder_server.models import load_vision_encoder
    from protos.wire import DTYPE_NAMES

    return load_vision_encoder(ctx.models["tower"], ctx.profile.device, DTYPE_NAMES[ctx.profile.dtype])


async def section_serving(ctx: Context) -> dict:
    from encoder_server.images import decode_image
    from receiver import EncoderReceiver

    p = ctx.profile
    encoder = await asyncio.to_thread(load_in_process, ctx)
    width, height = p.serving_image

    def in_process(images: Sequence[bytes]) -> float:
        started = time.perf_counter()
        for data in images:
            (output,) = encoder.encode([encoder.preprocess(decode_image(data))])
        return len(images) / (time.perf_counter() - started)

    images: list[bytes] = []

    async def server() -> float:
        # Fresh images each round, the same ones on both sides: no run is helped by the cache.
        images[:] = [image_bytes(width, height, seed, compress_level=1) for seed in ctx.seeds.take(p.serving_images)]
        calls = [encode_call(receiver, f"serving-{i}", [data]) for i, data in enumerate(images)]
        return await closed_loop(p.serving_clients, calls)

    async with EncoderReceiver([ctx.servers["tower"].url]) as receiver:
        warm = [image_bytes(width, height, seed, compress_level=1) for seed in ctx.seeds.take(2)]
        await asyncio.to_thread(in_process, warm[:1])
        await encode_call(receiver, "warm", warm[1:])()
        runs = await interleaved(
            "serving", p.rounds, {"server": server, "in_process": lambda: asyncio.to_thread(in_process, images)}
        )
    return {
        "image": f"{width}x{height}",
        "tower": p.tower,
        "dtype": p.dtype,
        "torch_threads": p.torch_threads,
        "clients": p.serving_clients,
        **rates(runs, "server", "in_process"),
    }


async def section_batching(ctx: Context) -> dict:
    from receiver import EncoderReceiver

    p = ctx.profile
    width, height = p.batching_image
    modes = ("on", "off")
    receivers = {
        mode: [EncoderReceiver([ctx.servers[f"batching-{mode}"].url]) for _ in range(p.batching_clients)]
        for mode in modes
    }

    async def run(mode: str) -> float:
        def client_calls(receiver, client: int):
            images = [image_bytes(width, height, seed, compress_level=1) for seed in ctx.seeds.take(p.batching_requests)]
            return [encode_call(receiver, f"batching-{client}-{i}", [d]) for i, d in enumerate(images)]

        return await concurrent_clients([client_calls(rx, c) for c, rx in enumerate(receivers[mode])])

    try:
        for mode in modes:
            await run(mode)  # warm-up: channels connected, first forwards done
        runs = await interleaved("batching", p.rounds, {mode: functools.partial(run, mode) for mode in modes})
    finally:
        for group in receivers.values():
            await asyncio.gather(*(rx.close() for rx in group))
    return {
        "clients": p.batching_clients,
        "image": f"{width}x{height}",
        "model": "built-in default (tiny Qwen2.5-VL tower)",
        **rates(runs, "on", "off"),
    }


async def section_scale_out(ctx: Context) -> dict:
    from receiver import EncoderReceiver

    p = ctx.profile
    width, height = p.serving_image
    urls = {"one": [ctx.servers["scale-a"].url], "two": [ctx.servers["scale-a"].url, ctx.servers["scale-b"].url]}
    receivers = {k: EncoderReceiver(v, seed=0) for k, v in urls.items()}
    clients = 2
    pids = [ctx.servers[name].process.pid for name in ("scale-a", "scale-b")]
    cores: dict[str, list[float]] = {mode: [] for mode in urls}

    async def run(mode: str, requests: int) -> float:
        calls = []
        for r in range(requests):
            images = [image_bytes(width, height, seed, compress_level=1) for seed in ctx.seeds.take(p.scale_items)]
            calls.append(encode_call(receivers[mode], f"scale-{r}", images))
        cpu, wall = cpu_seconds(pids), time.perf_counter()
        rate = await closed_loop(clients, calls)
        # How many cores the encoder processes got: what bounds 2 single-thread processes on a busy host.
        cores[mode].append((cpu_seconds(pids) - cpu) / (time.perf_counter() - wall))
        return rate

    try:
        await run("two", 1)  # warm-up of the second encoder
        runs = await interleaved(
            "scale_out", p.rounds, {mode: functools.partial(run, mode, p.scale_requests) for mode in urls}
        )
    finally:
        for rx in receivers.values():
            await rx.close()
    return {
        "image": f"{width}x{height}",
        "items_per_request": p.scale_items,
        "requests_in_flight": clients,
        "torch_threads_per_process": p.torch_threads,
        "max_batch_images": 1,
        "encoder_cores_used": {mode: median(values) for mode, values in cores.items()},
        **rates(runs, "two", "one"),
    }


async def section_cache(ctx: Context) -> dict:
    from receiver import EncoderReceiver

    p = ctx.profile
    width, height = p.serving_image
    miss_ms, hit_ms = [], []
    progress = Progress("cache", p.cache_repeats)
    async with EncoderReceiver([ctx.servers["tower"].url]) as receiver:
        for seed in ctx.seeds.take(p.cache_repeats):
            items = [{"data": image_bytes(width, height, seed, compress_level=1)}]
            started = time.perf_counter()
            miss = (await receiver.encode(f"miss-{seed}", items)).items[0]
            miss_ms.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            hit = (await receiver.encode(f"hit-{seed}", items)).items[0]
            hit_ms.append((time.perf_counter() - started) * 1000)
            assert not miss.cache_hit and hit.cache_hit and torch.equal(hit.embedding, miss.embedding)
            progress.step()
    progress.close()
    return {
        "image": f"{width}x{height}",
        "miss_ms": summary(miss_ms),
        "hit_ms": summary(hit_ms),
        "speedup": paired_ratio(miss_ms, hit_ms),
    }


async def section_image_sizes(ctx: Context) -> dict:
    from receiver import EncoderReceiver

    p = ctx.profile
    out = {}
    progress = Progress("image_sizes", len(p.image_sizes))
    async with EncoderReceiver([ctx.servers["tower"].url]) as receiver:
        for width, height in p.image_sizes:
            warm = [image_bytes(width, height, seed, compress_level=1) for seed in ctx.seeds.take(1)]
            await encode_call(receiver, "warm", warm)()
            tokens = (await receiver.encode("tokens", [{"data": warm[0]}])).items[0].num_tokens
            images = [image_bytes(width, height, seed, compress_level=1) for seed in ctx.seeds.take(p.image_size_images)]
            calls = [encode_call(receiver, f"size-{i}", [d]) for i, d in enumerate(images)]
            rate = await closed_loop(p.serving_clients, calls)
            itemsize = torch.finfo(getattr(torch, p.dtype)).bits // 8
            out[f"{width}x{height}"] = {
                "images_per_s": rate,
                "tokens_per_image": tokens,
                "embedding_gbps": rate * tokens * p.tower["out_hidden_size"] * itemsize / 1e9,
            }
            progress.step(f"{width}x{height}")
    progress.close()
    return {"tower": p.tower, "dtype": p.dtype, "device": p.device, "sizes": out}



# The data plane: our stream and shared memory against bare grpcio, pyzmq, memcpy (and Mooncake).

TRANSPORT_HIDDEN = 3584  # Qwen2.5-VL-7B's embedding width: 1,024 bf16 tokens are 7 MiB
SMALL_TOKENS = 64
SMALL = 0  # the key of the small item among the nominal sizes


def item_tokens(size: int) -> int:
    """Rows of the item that stands for nominal size `size` (bytes): 1,024 for 7 MiB, 4,682 for 32 MiB."""
    return SMALL_TOKENS if size == SMALL else -(-size // (TRANSPORT_HIDDEN * 2))


def item_bytes(size: int) -> int:
    return item_tokens(size) * TRANSPORT_HIDDEN * 2
IN_FLIGHT = 4  # calls in flight in the pipelined modes: a prefill node has many requests at once
FLOORS = ("request_ack", "jpeg_decode")  # what `ceilings` is computed from (see floor_ms)


def request_jpeg(seed: int, side: int = 720) -> bytes:
    """A real JPEG of random pixels, ~470 KB at 720x720: what a 1,024-token image weighs on the wire."""
    return image_bytes(side, side, seed, fmt="JPEG", quality=90)


def role_bare_grpc(args) -> None:
    """The strongest plain grpcio server we could write: a generic handler that takes the request's
    bytes unparsed and yields pre-framed chunks (the same ~1 MiB chunk messages as ours) of a payload
    made once, one method per payload size; and `Ack`, which answers a request with two bytes."""
    handlers = {}
    for size in args.payload_bytes:
        data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        chunks = list(wire.chunk_messages(memoryview(data)))

        async def stream(request: bytes, context, chunks=chunks):
            for chunk in chunks:
                yield chunk

        handlers[f"Stream{size}"] = grpc.unary_stream_rpc_method_handler(stream)

    async def ack(request: bytes, context) -> bytes:
        return b"ok"

    # The request carried and a few bytes answered: the least a call controlled over gRPC costs.
    handlers["Ack"] = grpc.unary_unary_rpc_method_handler(ack)

    async def serve() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Bare", handlers)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(f"ready on 127.0.0.1:{port}", flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())


def role_mooncake_target(args) -> None:
    """A Mooncake transfer engine (TCP) with one registered buffer that the bench process writes into."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("mooncake: initialize failed")
    buffer = np.zeros(max(args.payload_bytes), dtype=np.uint8)
    if engine.register_memory(buffer.ctypes.data, buffer.nbytes) != 0:
        raise SystemExit("mooncake: register_memory failed")
    print(f"buffer {buffer.ctypes.data}", flush=True)
    print(f"ready on 127.0.0.1:{engine.get_rpc_port()}", flush=True)
    threading.Event().wait()  # until the bench terminates it


def mooncake_available() -> str | None:
    """None when the Mooncake transfer engine imports, else why not."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as exc:  # ImportError, or the OSError of a missing libibverbs
        return f"{exc.__class__.__name__}: {exc}"
    return None


async def section_dataplane(ctx: Context) -> dict:
    import zmq

    from encoder_server.images import decode_image
    from protos import encoder_pb2 as pb
    from receiver import EncoderReceiver
    from receiver.buffers import POOL

    p = ctx.profile
    sizes = p.transport_sizes
    servers = ctx.servers
    fixed = {size: servers[f"fixed-{size}"].url for size in sizes}
    fixed[SMALL] = servers["fixed-small"].url
    stream_rx = {size: EncoderReceiver([url], transfer="grpc") for size, url in fixed.items()}
    shm_rx = {size: EncoderReceiver([fixed[size]], transfer="shm") for size in sizes}
    bare_channel = grpc.aio.insecure_channel(f"127.0.0.1:{servers['bare-grpc'].port}")
    cached_image = request_jpeg(seed=0)
    small_image = request_jpeg(seed=1, side=224)
    n_calls = {size: max(IN_FLIGHT, p.transport_bytes // size // IN_FLIGHT * IN_FLIGHT) for size in sizes}
    # Computed items need an image no call sent before: one per call of both computed modes, every round.
    fresh = {size: iter([request_jpeg(seed) for seed in ctx.seeds.take(2 * n_calls[size] * p.rounds)]) for size in sizes}
    zctx = zmq.Context()
    pull, control = zctx.socket(zmq.PULL), zctx.socket(zmq.REQ)
    pull.connect(f"tcp://127.0.0.1:{servers['zmq-push'].port}")
    control.connect(f"tcp://127.0.0.1:{_CONTROL.search(servers['zmq-push'].log()).group(1)}")

    def bare_request(image: bytes) -> bytes:
        # The very bytes our receiver sends: the bare server receives the image too.
        return pb.EncodeRequest(request_id="bare", items=[pb.ImageItem(index=0, modality=pb.IMAGE, data=image)]).SerializeToString()

    bare_calls = {size: bare_channel.unary_stream(f"/bench.Bare/Stream{item_bytes(size)}") for size in [*sizes, SMALL]}

    async def in_flight(calls: Sequence[Callable[[], Awaitable[None]]], width: int) -> float:
        """Runs the calls `width` at a time (one after another when 1); returns the seconds taken."""
        queue = list(reversed(calls))

        async def worker() -> None:
            while queue:
                await queue.pop()()

        return await timed(lambda: asyncio.gather(*(worker() for _ in range(width))))

    def ours_call(receiver, image: bytes, size: int, cached: bool):
        async def call() -> None:
            (item,) = (await receiver.encode("bench", [{"data": image}])).items
            assert item.cache_hit == cached and item.embedding.numel() * 2 == item_bytes(size)

        return call

    def bare_call(size: int, request: bytes):
        async def call() -> None:
            await receive_payload(bare_calls[size](request), item_bytes(size))

        return call

    async def measure(size: int, kind: str) -> float:
        """Bytes per second (GB/s) of one figure; `kind` is what moves and how."""
        n, nbytes = n_calls[size], item_bytes(size)
        width = IN_FLIGHT if kind.endswith("_x4") else 1
        if kind.startswith("bare"):
            calls = [bare_call(size, bare_request(cached_image))] * n
        elif kind.startswith("stream_computed"):
            calls = [ours_call(stream_rx[size], next(fresh[size]), size, False) for _ in range(n)]
        elif kind.startswith("stream"):
            calls = [ours_call(stream_rx[size], cached_image, size, True)] * n
        elif kind.startswith("shm"):
            calls = [ours_call(shm_rx[size], cached_image, size, True)] * n
        elif kind == "zmq":
            return n * nbytes / await asyncio.to_thread(zmq_pull, nbytes, n) / 1e9
        else:  # memcpy: one thread, or split across threads as the server writes a segment
            return n * nbytes / memcpy(size, n, np.copyto if kind == "memcpy" else copy_bytes) / 1e9
        return n * nbytes / await in_flight(calls, width) / 1e9

    def zmq_pull(nbytes: int, n: int) -> float:
        started = time.perf_counter()
        control.send(f"{nbytes} {n}".encode())
        control.recv()
        for _ in range(n):
            _meta, frame = pull.recv_multipart(copy=False)
            tensor = POOL.empty((nbytes,), torch.uint8)
            tensor.numpy()[:] = np.frombuffer(frame.buffer, np.uint8)
        return time.perf_counter() - started

    copies = {size: np.random.default_rng(size).integers(0, 256, (2, item_bytes(size)), dtype=np.uint8) for size in sizes}

    def memcpy(size: int, n: int, copy: Callable[[np.ndarray, np.ndarray], None]) -> float:
        """One host copy into a buffer whose pages are already mapped: the physical limit."""
        src, dst = copies[size]
        started = time.perf_counter()
        for _ in range(n):
            copy(dst, src)
        return time.perf_counter() - started

    async def small_latency(kind: str) -> float:
        """Milliseconds per one-item call of a cached 64-token item (448 KiB), one call at a time."""
        n = 10 * p.rounds
        if kind == "bare":
            calls = [bare_call(SMALL, bare_request(small_image))] * n
        else:
            calls = [ours_call(stream_rx[SMALL], small_image, SMALL, True)] * n
        return await in_flight(calls, 1) / n * 1000

    ack = bare_channel.unary_unary("/bench.Bare/Ack")

    async def floor_ms(kind: str) -> float:
        """Milliseconds of what bounds the goals out of reach, one at a time: "request_ack", a bare
        grpcio call carrying the 465 KB request and answering two bytes; "jpeg_decode", the request's
        JPEG decoded as the server decodes it."""
        n = 10 * p.rounds
        request = bare_request(cached_image)
        started = time.perf_counter()
        for _ in range(n):
            if kind == "request_ack":
                await ack(request)
            else:
                decode_image(cached_image)
        return (time.perf_counter() - started) / n * 1000

    kinds = ["bare_seq", "bare_x4", "stream_cached_seq", "stream_cached_x4", "stream_computed_seq",
             "stream_computed_x4", "shm", "shm_x4", "zmq", "memcpy", "memcpy_threads"]  # fmt: skip
    try:
        for size in [*sizes, SMALL]:  # the cached item computed once
            await ours_call(stream_rx[size], small_image if size == SMALL else cached_image, size, False)()
        for size in sizes:  # warm-up: connections, shared-memory pools grown
            for kind in kinds:
                if kind.startswith("stream_computed"):
                    continue
                await measure(size, kind)
        await small_latency("bare")
        await small_latency("ours")
        await floor_ms("request_ack")
        measures = {f"{size // MiB} MiB {kind}": functools.partial(measure, size, kind) for size in sizes for kind in kinds}
        measures.update({f"small {kind}": functools.partial(small_latency, kind) for kind in ("bare", "ours")})
        measures.update({f"floor {kind}": functools.partial(floor_ms, kind) for kind in FLOORS})
        runs = await interleaved("dataplane", p.rounds, measures)
        mooncake = await dataplane_mooncake(ctx, sizes)
    finally:
        for receiver in [*stream_rx.values(), *shm_rx.values()]:
            await receiver.close()
        await bare_channel.close()
        zctx.destroy(linger=0)
    out: dict = {"hidden_size": TRANSPORT_HIDDEN, "request_jpeg_bytes": len(cached_image), "calls_in_flight": IN_FLIGHT}
    floors = out["floor_ms"] = {kind: median(runs[f"floor {kind}"]) for kind in FLOORS}
    for size in sizes:
        by = {kind: runs[f"{size // MiB} MiB {kind}"] for kind in kinds}
        best_bare = [max(a, b) for a, b in zip(by["bare_seq"], by["bare_x4"])]
        ratio = lambda a, b: paired_ratio(by[a] if isinstance(a, str) else a, by[b] if isinstance(b, str) else b)  # noqa: E731
        row = {
            "payload_bytes": item_bytes(size),
            "gbps": {kind: median(values) for kind, values in by.items()},
            "runs_gbps": by,
            "stream_vs_best_bare": {kind: ratio(kind, best_bare) for kind in kinds if kind.startswith("stream")},
            # Against bare grpcio run the same way (one call at a time, or 4 in flight).
            "stream_vs_bare_same_mode": {
                kind: ratio(kind, "bare_x4" if kind.endswith("_x4") else "bare_seq") for kind in kinds if kind.startswith("stream")
            },
            # One call at a time, and 4 in flight (pyzmq's PUSH sends its frames back to back).
            "shm_vs_zmq": ratio("shm", "zmq"),
            "shm_vs_memcpy": ratio("shm", "memcpy"),
            "shm_x4_vs_zmq": ratio("shm_x4", "zmq"),
            "shm_x4_vs_memcpy": ratio("shm_x4", "memcpy"),
            # One-item latency, shared memory over the stream (one call at a time, cached item).
            "shm_latency_vs_stream": ratio("stream_cached_seq", "shm"),
            "shm_latency_ms": 1e3 * item_bytes(size) / 1e9 / median(by["shm"]),
            "stream_latency_ms": 1e3 * item_bytes(size) / 1e9 / median(by["stream_cached_seq"]),
        }
        row["ceilings"] = ceilings(item_bytes(size), row["gbps"], floors)
        if size in mooncake:
            row["mooncake_gbps"] = mooncake[size]
            row["stream_vs_mooncake"] = median(by["stream_cached_seq"]) / mooncake[size]
        out[f"{size // MiB}MiB"] = row
    out["small"] = {
        "tokens": SMALL_TOKENS,
        "payload_bytes": item_bytes(SMALL),
        "ours_ms": summary(runs["small ours"]),
        "bare_ms": summary(runs["small bare"]),
        "ours_vs_bare_latency": paired_ratio(runs["small ours"], runs["small bare"]),
    }
    out["mooncake"] = "measured" if mooncake else ctx.mooncake_skipped
    return out


def ceilings(nbytes: int, gbps: dict[str, float], floors: dict[str, float]) -> dict[str, float]:
    """The most a goal's ratio could reach in this run, set by what no server of ours can skip:

    - stream_cached_seq: one call at a time is bare grpcio's own sequential rate against the best bare.
    - stream_computed_seq: a new image is decoded before its payload exists, then streamed at best as
      bare grpcio streams one call at a time.
    - stream_computed_x4: bare grpcio with 4 in flight keeps both cores busy on this VM (see
      docs/performance-dataplane.md), so the decoding's CPU adds to it, spread over every core.
    - shm_seq_vs_zmq: an item placed over gRPC costs at least a call that carries its request, even if
      its payload moved for free.
    """
    ms = {kind: nbytes / 1e6 / gbps[kind] for kind in ("bare_seq", "bare_x4", "zmq")}  # per item
    best = min(ms["bare_seq"], ms["bare_x4"])
    return {
        "stream_cached_seq": best / ms["bare_seq"],
        "stream_computed_seq": best / (ms["bare_seq"] + floors["jpeg_decode"]),
        "stream_computed_x4": best / (ms["bare_x4"] + floors["jpeg_decode"] / (os.cpu_count() or 1)),
        "shm_seq_vs_zmq": ms["zmq"] / floors["request_ack"],
    }


async def dataplane_mooncake(ctx: Context, sizes: Sequence[int]) -> dict[int, float]:
    """GB/s of Mooncake's TCP transport writing each size into another process's registered buffer."""
    if "mooncake" not in ctx.servers:
        return {}
    from mooncake.engine import TransferEngine

    target = ctx.servers["mooncake"]
    remote = int(re.search(r"buffer (\d+)", target.log()).group(1))
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake: initialize failed")
    source = np.random.default_rng(0).integers(0, 256, max(map(item_bytes, sizes)), dtype=np.uint8)
    if engine.register_memory(source.ctypes.data, source.nbytes) != 0:
        raise RuntimeError("mooncake: register_memory failed")
    session = f"127.0.0.1:{target.port}"
    out = {}
    for size in sizes:
        nbytes = item_bytes(size)
        n = max(4, ctx.profile.transport_bytes // nbytes)

        def run() -> float:
            engine.transfer_sync_write(session, source.ctypes.data, remote, nbytes)  # warm-up
            started = time.perf_counter()
            for _ in range(n):
                if engine.transfer_sync_write(session, source.ctypes.data, remote, nbytes) != 0:
                    raise RuntimeError("mooncake: transfer_sync_write failed")
            return time.perf_counter() - started

        out[size] = n * nbytes / await asyncio.to_thread(run) / 1e9
    return out


ROLES = {"bare-grpc": role_bare_grpc, "zmq-push": role_zmq_push,
         "mooncake-target": role_mooncake_target}


RUNNERS = {
    "transport": section_dataplane,
    "serving": section_serving,
    "batching": section_batching,
    "scale_out": section_scale_out,
    "cache": section_cache,
    "image_sizes": section_image_sizes,
}


async def start_processes(ctx: Context, sections: Sequence[str]) -> None:
    """Writes the models and starts every server the chosen sections use, all at once."""
    from testkit.default_model import write_default_model

    p, children = ctx.profile, ctx.children
    starts: dict[str, Awaitable[LaunchedProcess]] = {}
    if "transport" in sections:
        for size in [*p.transport_sizes, SMALL]:
            name = f"fixed-{size}" if size else "fixed-small"
            argv = [sys.executable, "-m", "testkit.fixed_server", str(item_tokens(size)), str(TRANSPORT_HIDDEN)]
            starts[name] = children.spawn(name, argv, 1)
        payloads = [str(item_bytes(size)) for size in p.transport_sizes]
        starts["bare-grpc"] = children.role("bare-grpc", "bare-grpc", 1, "--payload-bytes", *payloads,
                                            str(item_bytes(SMALL)))  # fmt: skip
        starts["zmq-push"] = children.role("zmq-push", "zmq-push", 1, "--payload-bytes", *payloads)
        ctx.mooncake_skipped = mooncake_available()
        if ctx.mooncake_skipped is None:
            starts["mooncake"] = children.role("mooncake", "mooncake-target", 1, "--payload-bytes", *payloads)
        else:
            print(f"transport: Mooncake section skipped ({ctx.mooncake_skipped})", file=sys.stderr)
    if {"serving", "scale_out", "cache", "image_sizes"} & set(sections):
        ctx.models["tower"] = await asyncio.to_thread(
            write_tower_checkpoint, ctx.workdir / "tower", p.tower, p.device
        )
        if {"serving", "cache", "image_sizes"} & set(sections):
            starts["tower"] = children.encoder_server("tower", ctx.models["tower"], p)
        if "scale_out" in sections:
            # One image per forward: the figure is about processes, and on a CPU a bigger batch alone
            # makes a lone server's forwards cheaper per image (the batching section measures that).
            for name in ("scale-a", "scale-b"):
                starts[name] = children.encoder_server(name, ctx.models["tower"], p, "--max-batch-images", "1")
    if "batching" in sections:
        ctx.models["default"] = await asyncio.to_thread(write_default_model, ctx.workdir / "default")
        starts["batching-on"] = children.encoder_server("batching-on", ctx.models["default"], p)
        starts["batching-off"] = children.encoder_server("batching-off", ctx.models["default"], p,
                                                         "--max-batch-images", "1")  # fmt: skip
    started = await asyncio.gather(*starts.values())
    ctx.servers.update(zip(starts, started))


# Goals, table, JSON.

TRANSPORT_GOALS = [  # per item size: (name, path in the size's results, target, at least (True) or at most,
    # the key of its ceiling in this run, when `ceilings` knows one)
    *[(f"stream {mode.replace('_', ' ')} / best bare grpcio", ("stream_vs_best_bare", f"stream_{mode}"), 0.9, True,
       None if mode == "cached_x4" else f"stream_{mode}") for mode in ("cached_seq", "cached_x4", "computed_seq", "computed_x4")],
    ("shared memory seq / zmq", ("shm_vs_zmq",), 2.0, True, "shm_seq_vs_zmq"),
    ("shared memory seq / memcpy", ("shm_vs_memcpy",), 0.3, True, None),
    (f"shared memory x{IN_FLIGHT} / zmq", ("shm_x4_vs_zmq",), 2.0, True, None),
    (f"shared memory x{IN_FLIGHT} / memcpy", ("shm_x4_vs_memcpy",), 0.3, True, None),
    ("shared memory / stream one-item latency", ("shm_latency_vs_stream",), 0.5, False, None),
]  # fmt: skip
GOALS = [
    # (name, section, path to the ratio, target, at least (True) or at most (False), path to its ceiling)
    *[(f"transport {size // MiB} MiB: {name}", "transport", (f"{size // MiB}MiB", *path), target, at_least,
       (f"{size // MiB}MiB", "ceilings", ceiling) if ceiling else None)
      for size in (7 * MiB, 32 * MiB) for name, path, target, at_least, ceiling in TRANSPORT_GOALS],
    ("transport 64 tokens: one-item latency / bare grpcio", "transport", ("small", "ours_vs_bare_latency"), 1.3, False,
     None),
    ("serving: server / in-process", "serving", ("ratio",), 0.9, True, None),
    ("batching: on / off", "batching", ("ratio",), 1.5, True, None),
    ("scale-out: 2 processes / 1", "scale_out", ("ratio",), 1.7, True, None),
    ("cache: miss / hit latency", "cache", ("speedup",), 20.0, True, None),
]  # fmt: skip


def _lookup(results: dict, section: str, path: Sequence[str]):
    value = results.get(section)
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def goals(results: dict) -> list[dict]:
    """Each goal's measured ratio, whether it is met, and, where one is known, the most any server
    could reach in this run (`ceilings`): a goal whose target lies past its ceiling is out of reach here."""
    out = []
    for name, section, path, target, at_least, ceiling_path in GOALS:
        value = _lookup(results, section, path)
        if value is None:
            continue
        met = value >= target if at_least else value <= target
        goal = {"goal": name, "target": target, "at_least": at_least, "measured": value, "met": met}
        if ceiling_path is not None:
            goal["ceiling"] = _lookup(results, section, ceiling_path)
            goal["reachable"] = goal["ceiling"] >= target
        out.append(goal)
    return out


RATE_ROWS = [  # section, figure, (key, label) of ours, (key, label) of the baseline
    ("serving", "serving {image}", ("server", "server"), ("in_process", "in-process")),
    ("batching", "batching {clients} clients {image}", ("on", "on"), ("off", "off")),
    ("scale_out", "scale-out {image} (encoder cores used: {encoder_cores_used[two]:.2f} vs {encoder_cores_used[one]:.2f})",
     ("two", "2 processes"), ("one", "1 process")),
]


def table(results: dict) -> str:
    rows: list[tuple[str, str, str, str]] = []
    if "transport" in results:
        t = results["transport"]
        for size in (k for k in t if k.endswith("MiB")):
            r, g = t[size], t[size]["gbps"]
            best_bare = f"bare grpcio {max(g['bare_seq'], g['bare_x4']):.2f} GB/s (seq {g['bare_seq']:.2f}, x{IN_FLIGHT} {g['bare_x4']:.2f})"
            for mode in ("cached_seq", "cached_x4", "computed_seq", "computed_x4"):
                same = r["stream_vs_bare_same_mode"][f"stream_{mode}"]
                rows.append((f"stream {size} {mode.replace('_', ' ')}", f"ours {g[f'stream_{mode}']:.2f} GB/s", best_bare,
                             f"{r['stream_vs_best_bare'][f'stream_{mode}']:.2f}x ({same:.2f}x of bare {mode.split('_')[1]})"))
            baselines = f"zmq {g['zmq']:.2f} / memcpy {g['memcpy']:.1f} (threads {g['memcpy_threads']:.1f}) GB/s"
            rows.append((f"shared memory {size} seq", f"ours {g['shm']:.2f} GB/s", baselines,
                         f"{r['shm_vs_zmq']:.2f}x / {r['shm_vs_memcpy']:.2f}x"))
            rows.append((f"shared memory {size} x{IN_FLIGHT}", f"ours {g['shm_x4']:.2f} GB/s", baselines,
                         f"{r['shm_x4_vs_zmq']:.2f}x / {r['shm_x4_vs_memcpy']:.2f}x"))
            rows.append((f"  one item {size}", f"shared memory {r['shm_latency_ms']:.2f} ms",
                         f"stream {r['stream_latency_ms']:.2f} ms", f"{r['shm_latency_vs_stream']:.2f}x"))
            c = r["ceilings"]
            rows.append((f"  ceilings {size}", f"stream seq {c['stream_cached_seq']:.2f}x, computed seq / x{IN_FLIGHT} "
                         f"{c['stream_computed_seq']:.2f}x / {c['stream_computed_x4']:.2f}x",
                         f"shm seq {c['shm_seq_vs_zmq']:.2f}x zmq", ""))
            if "mooncake_gbps" in r:
                rows.append((f"  mooncake tcp {size}", f"stream {g['stream_cached_seq']:.2f} GB/s",
                             f"mooncake {r['mooncake_gbps']:.2f} GB/s", f"{r['stream_vs_mooncake']:.2f}x"))
        floor = t["floor_ms"]
        rows.append(("  floors (ceilings' inputs)", f"decode the JPEG {floor['jpeg_decode']:.2f} ms",
                     f"bare call with the request {floor['request_ack']:.2f} ms", ""))
        small = t["small"]
        rows.append((f"small item ({small['tokens']} tokens, cached)", f"ours {small['ours_ms']['median']:.2f} ms",
                     f"bare grpcio {small['bare_ms']['median']:.2f} ms", f"{small['ours_vs_bare_latency']:.2f}x"))  # fmt: skip
    for section, figure, (ours, ours_label), (base, base_label) in RATE_ROWS:
        if section in results:
            r = results[section]
            rows.append((figure.format(**r), f"{ours_label} {r[f'{ours}_images_per_s']['median']:.2f} img/s",
                         f"{base_label} {r[f'{base}_images_per_s']['median']:.2f} img/s", f"{r['ratio']:.2f}x"))  # fmt: skip
    if "cache" in results:
        r = results["cache"]
        rows.append((f"cache {r['image']}", f"hit {r['hit_ms']['median']:.2f} ms",
                     f"miss {r['miss_ms']['median']:.1f} ms", f"{r['speedup']:.0f}x faster"))  # fmt: skip
    if "image_sizes" in results:
        for size, r in results["image_sizes"]["sizes"].items():
            rows.append((f"images {size}", f"{r['images_per_s']:.2f} img/s",
                         f"{r['tokens_per_image']} tokens, {r['embedding_gbps']:.3f} GB/s of embeddings", ""))  # fmt: skip
    header = ("figure", "ours", "baseline (same run)", "ratio")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    load = results["machine"]
    lines.append(f"ratios: median over {results['profile']['rounds']} rounds of pairs measured in the same round; load average "
                 f"{load['load_average_before'][0]:.1f} before, {load['load_average_after'][0]:.1f} after")  # fmt: skip
    for g in results.get("goals", []):
        sign = ">=" if g["at_least"] else "<="
        ceiling = "" if "ceiling" not in g else (
            f" (ceiling {g['ceiling']:.2f}{'' if g['reachable'] else ': out of reach in this run'})")
        lines.append(f"goal {g['goal']} {sign} {g['target']}: {g['measured']:.2f} {'met' if g['met'] else 'NOT met'}{ceiling}")
    return "\n".join(lines)


async def run_benchmark(args, profile: Profile, workdir: Path) -> dict:
    sections = [s for s in SECTIONS if s in args.sections]
    children = Children(workdir, timeout=600 if profile.device == "cuda" else 300)
    ctx = Context(profile, children, workdir)
    if profile.device == "cpu":
        torch.set_num_threads(profile.torch_threads)
    results: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "quick": args.quick,
        "profile": dataclasses.asdict(profile),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "grpcio": grpc.__version__,
            "chunk_bytes": wire.CHUNK_BYTES,
            "gpu": torch.cuda.get_device_name() if profile.device == "cuda" else None,
            "load_average_before": os.getloadavg(),
        },
    }
    started = time.perf_counter()
    try:
        await start_processes(ctx, sections)
        for section in sections:
            results[section] = await RUNNERS[section](ctx)
    finally:
        children.stop()
    results["machine"]["load_average_after"] = os.getloadavg()
    results["goals"] = goals(results)
    results["seconds"] = time.perf_counter() - started
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short run with small models (CI)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--sections", type=lambda s: s.split(","), default=list(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")  # fmt: skip
    parser.add_argument("--workdir", type=Path, help="keep models and logs here (default: a temp dir)")
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--payload-bytes", type=int, nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # Every process of the benchmark (ours and the baselines alike) runs with the malloc settings the
    # encoder server sets for itself and docs/prefill-side.md recommends for a receiver's process.
    tune_malloc()
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's glog: errors only, in every process of the run
    if args.role:
        ROLES[args.role](args)
        return
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible to torch")
    profile = profile_for(args.device, args.quick)
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="encoder-bench-")))
        workdir.mkdir(parents=True, exist_ok=True)
        results = asyncio.run(run_benchmark(args, profile, workdir))
    print(table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
