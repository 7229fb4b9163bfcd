"""Never-reading clients against one encoder server with default flags: how much the server's memory grows,
whether reading clients are served throughout (one on a connection it keeps, and fresh ones each on a
new connection), and whether health stays SERVING.

Each stalled client asks for a distinct ~7 MiB item (the built-in model: Qwen2.5-VL's 2048-wide
embedding, 1792 tokens for a 1568x896 image), reads the header and nothing more, on a gRPC channel
whose HTTP/2 window stays at 64 KiB (so gRPC cannot take a payload off the server into the client
either). `--shape own-connections` (default) gives each its own channel and TCP connection;
`--shape one-connection` opens all of them as streams of one connection. They arrive in waves while
a reader encodes an image of its own every `--reader-interval-s` through `EncoderReceiver`, a fresh
client on a new connection asks for an image every `--fresh-interval-s` (retrying RESOURCE_EXHAUSTED
as a receiver would, for `--fresh-timeout-s` at most), and a health probe runs twice a second.
Loopback only; bounded in clients and time.

`--encoder tower` (default) serves the built-in model's real tower (`python -m encoder_server`, default
flags). `--encoder made-up` serves the same checkpoint and default settings with an encoder that
makes up a fresh 1792 x 2048 output per item at no compute (testkit's EncoderDouble): the server's
buffering is the same, and a run of a thousand clients does not wait on hundreds of CPU forwards.

    .venv/bin/python scripts/stalled_clients.py --clients 1000 --encoder made-up --shape one-connection

Prints one JSON line; exits 1 when a reader call or a fresh client failed, health left SERVING, or the
growth passed `--max-growth-gib`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import functools
import io
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from PIL import Image  # noqa: E402

from protos import encoder_pb2 as pb  # noqa: E402
from receiver import EncoderReceiver  # noqa: E402
from testkit.bare_grpc import NEVER_READS, OWN_CONNECTION  # noqa: E402
from testkit.bench_harness import MachineLoad, Stopwatch, add_record_flag, print_json, record_result  # noqa: E402
from testkit.launcher import LaunchedProcess, launch_server, start_process  # noqa: E402

# 56 x 32 merged patches of 28 pixels: 1792 tokens, x 2048 bf16 = 7 MiB.
IMAGE_SIZE = (1568, 896)
ITEM_BYTES = 1792 * 2048 * 2


def distinct_image(seed: int) -> bytes:
    """A plain PNG of a colour of its own: a distinct item (its own cache key) that costs little to send."""
    image = Image.new("RGB", IMAGE_SIZE, (seed % 256, (seed // 256) % 256, 77))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def memory_mib(pid: int) -> dict[str, float]:
    """The process's resident set now and at its peak (VmRSS, VmHWM), in MiB."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}


async def stall(channel: grpc.aio.Channel, seed: int, image: bytes, deadline_s: float) -> tuple[str, grpc.aio.Call]:
    """One never-reading client: its call and how it began (header, or the status it was refused with)."""
    item = pb.ImageItem(index=0, modality=pb.IMAGE, data=image)
    request = pb.EncodeRequest(request_id=f"stalled-{seed}", items=[item])
    call = channel.unary_stream(
        "/encoder.v1.EncoderService/Encode",
        request_serializer=pb.EncodeRequest.SerializeToString,
        response_deserializer=pb.EncodeResponse.FromString,
    )(request, timeout=deadline_s)
    try:
        began = "header" if (await call.read()).HasField("header") else "chunk"
    except grpc.aio.AioRpcError as exc:
        began = exc.code().name
    return began, call


async def served_afresh(port: int, seed: int, timeout_s: float) -> float:
    """One client on a new connection (one that has read nothing yet): asks for a distinct item and reads it
    whole, again after a short back-off while refused RESOURCE_EXHAUSTED; returns the seconds it took."""
    item = pb.ImageItem(index=0, modality=pb.IMAGE, data=await asyncio.to_thread(distinct_image, seed))
    request = pb.EncodeRequest(request_id=f"fresh-{seed}", items=[item])
    watch = Stopwatch()
    back_off = 0.1
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OWN_CONNECTION) as channel:
        encode = channel.unary_stream(
            "/encoder.v1.EncoderService/Encode", request_serializer=pb.EncodeRequest.SerializeToString
        )
        while True:
            left = timeout_s - watch.seconds()
            try:
                received = 0
                async for message in encode(request, timeout=max(left, 0.1)):
                    received += len(message)
                assert received > ITEM_BYTES, received
                return watch.seconds()
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or left < back_off:
                    raise
            await asyncio.sleep(back_off)
            back_off = min(2 * back_off, 1.0)


@dataclasses.dataclass
class Tally:
    """What one kind of client met while the stalled ones held: calls served, their seconds, failures."""

    served: int = 0
    failed: list[str] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)

    async def attempt(self, call: Callable[[], Awaitable[float]]) -> None:
        """Runs one call, which returns the seconds it was served in."""
        try:
            self.seconds.append(await call())
            self.served += 1
        except Exception as exc:  # noqa: BLE001 - every failure is a finding
            self.failed.append(f"{type(exc).__name__}: {exc}"[:300])

    def report(self, name: str) -> dict:
        slowest = round(max(self.seconds, default=0.0), 2)
        return {f"{name}_served": self.served, f"{name}_failed": self.failed, f"{name}_slowest_s": slowest}


async def read_throughout(rx: EncoderReceiver, reader: Tally, interval_s: float, stop: asyncio.Event) -> None:
    """The reader on the connection it keeps: a distinct image of its own every `interval_s`."""
    seed = 200_000
    while not stop.is_set():
        seed += 1
        image = await asyncio.to_thread(distinct_image, seed)  # off the loop: the health probe runs on it

        async def call(seed: int = seed, image: bytes = image) -> float:
            watch = Stopwatch()
            result = await rx.encode(f"reader-{seed}", [{"data": image}], timeout=60)
            item = result.items[0].embedding
            assert item.numel() * item.element_size() == ITEM_BYTES, item.shape
            return watch.seconds()

        await reader.attempt(call)
        await asyncio.sleep(interval_s)


async def read_afresh(port: int, fresh: Tally, args: argparse.Namespace, stop: asyncio.Event) -> None:
    """A fresh client on a new connection every `--fresh-interval-s`."""
    seed = 300_000
    while not stop.is_set():
        seed += 1
        await fresh.attempt(functools.partial(served_afresh, port, seed, args.fresh_timeout_s))
        await asyncio.sleep(args.fresh_interval_s)


async def watch_health(probe: grpc.aio.Channel, health: Tally, timeout_s: float, stop: asyncio.Event) -> None:
    """Health asked twice a second; each answer but SERVING (a status name, or the call's code) is a failure."""
    stub = health_pb2_grpc.HealthStub(probe)
    while not stop.is_set():
        watch = Stopwatch()
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                health.failed.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
        except grpc.aio.AioRpcError as exc:
            health.failed.append(exc.code().name)
        health.seconds.append(watch.seconds())
        await asyncio.sleep(0.5)


class Stalled:
    """The never-reading clients: their channels (one each, or one for all) and calls, and how each began."""

    def __init__(self, args: argparse.Namespace, port: int):
        self.args = args
        connections = args.clients if args.shape == "own-connections" else 1
        self.opened = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=NEVER_READS) for _ in range(connections)]
        self.channels = [self.opened[i % connections] for i in range(args.clients)]
        self.began: collections.Counter[str] = collections.Counter()
        self.calls: list[grpc.aio.Call] = []

    async def arrive(self, images: list[bytes]) -> None:
        """The clients in waves, then all of them held stalled at once for `--hold-s`."""
        args = self.args
        for first in range(0, args.clients, args.wave):
            wave = range(first, min(first + args.wave, args.clients))
            results = await asyncio.gather(*(stall(self.channels[i], i, images[i], args.deadline_s) for i in wave))
            self.began.update(kind for kind, _ in results)
            self.calls += [call for _, call in results]
            await asyncio.sleep(args.wave_interval_s)
        await asyncio.sleep(args.hold_s)  # all of them stalled at once, the reader still going

    async def close(self) -> None:
        for call in self.calls:
            call.cancel()
        await asyncio.gather(*(channel.close() for channel in self.opened))


async def run(args: argparse.Namespace, port: int, pid: int) -> dict:
    reader, fresh, health = Tally(), Tally(), Tally()
    stop = asyncio.Event()
    async with (
        EncoderReceiver([f"grpc://127.0.0.1:{port}"]) as rx,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as probe,
    ):
        for seed in range(3):  # the steady state of serving readers: heap, gRPC buffers, threads
            await rx.encode(f"warm-{seed}", [{"data": distinct_image(100_000 + seed)}], timeout=120)
        before = memory_mib(pid)
        images = await asyncio.to_thread(lambda: [distinct_image(seed) for seed in range(args.clients)])
        background = [
            asyncio.ensure_future(read_throughout(rx, reader, args.reader_interval_s, stop)),
            asyncio.ensure_future(read_afresh(port, fresh, args, stop)),
            asyncio.ensure_future(watch_health(probe, health, args.health_timeout_s, stop)),
        ]
        stalled = Stalled(args, port)
        watch = Stopwatch()
        try:
            await stalled.arrive(images)
        finally:
            stop.set()
            await asyncio.gather(*background)
            after = memory_mib(pid)
            await stalled.close()
    return {
        "clients": args.clients,
        "shape": args.shape,
        "stalled_began": dict(stalled.began),
        "seconds": round(watch.seconds(), 1),
        "rss_before_mib": round(before["VmRSS"]),
        "rss_peak_mib": round(after["VmHWM"]),
        "rss_growth_mib": round(after["VmHWM"] - before["VmRSS"]),
        **reader.report("reader"),
        **fresh.report("fresh"),
        "health_not_serving": health.failed,
        "health_probes": len(health.seconds),
        "health_slowest_s": round(max(health.seconds, default=0.0), 2),
    }


def serve_made_up(model: str) -> None:
    """The server of `--encoder made-up`: default settings, outputs made up afresh for every item."""
    import torch

    from encoder_common.malloc import tune_server_malloc
    from encoder_server.models import ImageEmbedding
    from encoder_server.server import EncoderServer
    from testkit.encoders import EncoderDouble
    from testkit.servers import server_config

    class FreshEncoder(EncoderDouble):
        # A new tensor per item, as a real forward makes: nothing is shared between calls.
        def encode(self, batch):
            return [ImageEmbedding(out.embedding.clone()) for out in super().encode(batch)]

    tune_server_malloc()  # as the encoder-server CLI does

    async def serve() -> None:
        server = EncoderServer(server_config(model, dtype=torch.bfloat16), encoder=FreshEncoder(tokens=1792))
        await server.start()
        print(f"ready on 127.0.0.1:{server.port}", flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())


@contextlib.contextmanager
def launched(args: argparse.Namespace, model: Path, workdir: Path) -> Iterator[LaunchedProcess]:
    if args.encoder == "tower":
        with launch_server(model, *args.server_flags, log_dir=workdir) as server:
            yield server
        return
    server = start_process([sys.executable, __file__, "--serve-made-up", str(model)], workdir / "server.log")
    try:
        yield server
    finally:
        server.stop()


def main() -> None:
    if sys.argv[1:2] == ["--serve-made-up"]:
        serve_made_up(sys.argv[2])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--wave", type=int, default=50, help="stalled clients arriving at once")
    p.add_argument("--wave-interval-s", type=float, default=0.5)
    p.add_argument("--hold-s", type=float, default=10.0, help="time all of them stay stalled at the end")
    p.add_argument("--deadline-s", type=float, default=300.0, help="the stalled calls' own deadline")
    p.add_argument("--shape", choices=("own-connections", "one-connection"), default="own-connections",
                   help="a TCP connection per stalled client, or all of them streams of one connection")  # fmt: skip
    p.add_argument("--reader-interval-s", type=float, default=0.25)
    p.add_argument("--fresh-interval-s", type=float, default=1.0, help="pause between fresh clients")
    p.add_argument("--fresh-timeout-s", type=float, default=10.0, help="a fresh client not served by then failed")
    p.add_argument("--health-timeout-s", type=float, default=5.0)
    p.add_argument("--max-growth-gib", type=float, default=2.0)
    p.add_argument("--encoder", choices=("tower", "made-up"), default="tower")
    p.add_argument("--model", type=Path, help="checkpoint directory (default: the built-in model, written afresh)")
    add_record_flag(p)
    p.add_argument(
        "server_flags", nargs="*", help="server flags after --, e.g. -- --stream-buffer-bytes 67108864"
    )
    args = p.parse_args()
    load = MachineLoad()
    if not 1 <= args.clients <= 5000:
        p.error("--clients must be between 1 and 5000")
    with tempfile.TemporaryDirectory(prefix="stalled-clients-") as workdir:
        model = args.model
        if model is None:
            from testkit.default_model import write_default_model

            model = write_default_model(Path(workdir) / "model")
        if args.server_flags and args.encoder != "tower":
            p.error("server flags go with --encoder tower only (made-up runs the defaults)")
        with launched(args, model, Path(workdir)) as server:
            summary = asyncio.run(run(args, server.port, server.process.pid))
        summary.update(encoder=args.encoder, server_flags=args.server_flags)
    print_json(summary)
    if args.record:
        name = f"stalled_clients_{args.encoder}_{args.shape}".replace("-", "_")
        figures = {"args": vars(args) | {"record": None}, **summary}
        print(f"wrote {record_result(name, figures, args.record, load=load)}")
    ok = not summary["reader_failed"] and summary["reader_served"] > 0 and not summary["health_not_serving"]
    ok = ok and not summary["fresh_failed"] and summary["fresh_served"] > 0
    sys.exit(0 if ok and summary["rss_growth_mib"] <= args.max_growth_gib * 1024 else 1)


if __name__ == "__main__":
    main()
