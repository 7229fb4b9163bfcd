"""Where a cached item's call spends its time: CPU per call in the server and in the client, and
event-loop turns, for bare grpcio, our server read by a bare client, and `EncoderReceiver` over the
stream, over shared memory and (when it imports) through the Mooncake transfer engine. Differences between neighbouring rows split our overhead into the
server's part and the receiver's part. A profile, not a benchmark: `scripts/bench.py` has the ratios.

    python scripts/profile_dataplane.py [--tokens 1024] [--in-flight 1] [--calls 60] [--rounds 5] [--small-first]

`--small-first` adds a second server process whose connections never count as reading (streams.py),
so that every item starts with the small chunks a never-reading client gets: their cost to a reader.

Each call carries the same request as `bench.py`'s transport section (a 465 KB JPEG, or a 224x224
one for items under 100 tokens); the server process is `testkit.fixed_server`, the bare one is
`bench.py --role bare-grpc`. CPU comes from /proc (server) and `time.process_time()` (client, all of
its threads), in clock ticks: use enough calls that a tick (10 ms) is small against the total.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import grpc  # noqa: E402
from bench_sections.transport_items import TRANSPORT_HIDDEN, request_jpeg  # noqa: E402

from encoder_common.malloc import tune_malloc  # noqa: E402
from encoder_common.mooncake_engine import unavailable  # noqa: E402
from protos import encoder_pb2 as pb  # noqa: E402
from receiver import EncoderReceiver  # noqa: E402
from testkit.bare_grpc import receive_payload  # noqa: E402
from testkit.bench_harness import (  # noqa: E402
    MachineLoad,
    Stopwatch,
    add_record_flag,
    median,
    process_cpu_seconds,
    record_result,
)
from testkit.launcher import start_process  # noqa: E402

ENCODE = "/encoder.v1.EncoderService/Encode"


class LoopTurns:
    """Counts the event loop's iterations (one `_run_once` each) while it is on."""

    def __init__(self) -> None:
        self.turns = 0
        loop = asyncio.get_running_loop()
        run_once = loop._run_once  # noqa: SLF001 - the only place a turn is visible

        def counted() -> None:
            self.turns += 1
            run_once()

        loop._run_once = counted  # noqa: SLF001


def raw_call(channel: grpc.aio.Channel, method: str, request: bytes, nbytes: int) -> Callable[[], Awaitable[None]]:
    """A bare client: the request's bytes as they are, the payload read as bench.py's baseline reads it."""
    stub = channel.unary_stream(method)

    async def call() -> None:
        await receive_payload(stub(request), nbytes)

    return call


def receiver_call(receiver: EncoderReceiver, image: bytes) -> Callable[[], Awaitable[None]]:
    async def call() -> None:
        (item,) = (await receiver.encode("profile", [{"data": image}])).items
        assert item.cache_hit

    return call


async def measure(call: Callable[[], Awaitable[None]], server_pid: int, calls: int, in_flight: int, turns: LoopTurns):
    """Wall ms, server CPU ms, client CPU ms and loop turns, per call."""
    for _ in range(3):
        await call()

    async def worker() -> None:
        for _ in range(calls // in_flight):
            await call()

    server0, client0, turns0, wall = process_cpu_seconds(server_pid), time.process_time(), turns.turns, Stopwatch()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    n = calls // in_flight * in_flight
    return (
        wall.seconds() / n * 1e3,
        (process_cpu_seconds(server_pid) - server0) / n * 1e3,
        (time.process_time() - client0) / n * 1e3,
        (turns.turns - turns0) / n,
    )


async def profile(args, ours, bare, small_first=None) -> dict:
    nbytes = args.tokens * TRANSPORT_HIDDEN * 2
    image = request_jpeg(seed=0) if args.tokens >= 100 else request_jpeg(seed=1, side=224)
    request = pb.EncodeRequest(request_id="bare", items=[pb.ImageItem(index=0, modality=pb.IMAGE, data=image)])
    raw = request.SerializeToString()
    turns = LoopTurns()
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p.port}") for p in (bare, ours)]
    engine = unavailable() is None
    receivers = [EncoderReceiver([ours.url], transfer=t) for t in ("grpc", "shm", *(["mooncake"] if engine else []))]
    await receivers[0].encode("first", [{"data": image}])  # computed once: every measured call is a hit
    if small_first is not None:
        receivers.append(EncoderReceiver([small_first.url], transfer="grpc"))
        await receivers[-1].encode("first", [{"data": image}])
    rows = {
        "bare grpcio": (raw_call(channels[0], f"/bench.Bare/Stream{nbytes}", raw, nbytes), bare.process.pid),
        "our server, bare client": (raw_call(channels[1], ENCODE, raw, nbytes), ours.process.pid),
        "EncoderReceiver, stream": (receiver_call(receivers[0], image), ours.process.pid),
        "EncoderReceiver, shm": (receiver_call(receivers[1], image), ours.process.pid),
    }
    if engine:
        rows["EncoderReceiver, engine"] = (receiver_call(receivers[2], image), ours.process.pid)
    if small_first is not None:
        rows["EncoderReceiver, small 1st"] = (receiver_call(receivers[-1], image), small_first.process.pid)
    runs: dict[str, list[tuple[float, ...]]] = {name: [] for name in rows}
    for _ in range(args.rounds):  # interleaved, so that a slow moment of the machine hits every row
        for name, (call, pid) in rows.items():
            runs[name].append(await measure(call, pid, args.calls, args.in_flight, turns))
    for receiver in receivers:
        await receiver.close()
    for channel in channels:
        await channel.close()
    print(f"{args.tokens} tokens x {TRANSPORT_HIDDEN} bf16 ({nbytes / 2**20:.2f} MiB), request {len(raw)} bytes, "
          f"{args.in_flight} call(s) in flight; medians of {args.rounds} rounds of {args.calls} calls")  # fmt: skip
    header = f"{'':26} {'wall ms':>8} {'server CPU ms':>14} {'client CPU ms':>14} {'loop turns':>11}"
    print(header)
    rows_out = {}
    for name, values in runs.items():
        med = [median(v[i] for v in values) for i in range(4)]
        print(f"{name:26} {med[0]:8.2f} {med[1]:14.2f} {med[2]:14.2f} {med[3]:11.1f}")
        rows_out[name] = dict(zip(("wall_ms", "server_cpu_ms", "client_cpu_ms", "loop_turns"), med))
    return {"tokens": args.tokens, "payload_bytes": nbytes, "request_bytes": len(raw), "in_flight": args.in_flight,
            "calls": args.calls, "rounds": args.rounds, "rows": rows_out}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024, help="rows of the item (64: bench.py's small item)")
    parser.add_argument("--in-flight", type=int, default=1, help="calls in flight (bench.py: 1 and 4)")
    parser.add_argument("--calls", type=int, default=60, help="calls per measurement")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--small-first", action="store_true", help="add a server that starts every item with small chunks")
    add_record_flag(parser)
    args = parser.parse_args()
    load = MachineLoad()
    tune_malloc()  # as bench.py: the receiver's process set up as docs/prefill-side.md recommends
    nbytes = args.tokens * TRANSPORT_HIDDEN * 2
    with tempfile.TemporaryDirectory(prefix="profile-dataplane-") as logs:
        engine = ["--mooncake"] if unavailable() is None else []
        ours = start_process(
            [sys.executable, "-m", "testkit.fixed_server", str(args.tokens), str(TRANSPORT_HIDDEN), *engine],
            Path(logs) / "fixed.log",
        )
        bare = start_process(
            [sys.executable, str(REPO_ROOT / "scripts" / "bench.py"), "--role", "bare-grpc", "--payload-bytes", str(nbytes)],
            Path(logs) / "bare.log",
        )
        small_first = None
        if args.small_first:  # the fixed server, with no connection ever remembered as reading
            code = "import runpy, sys; import encoder_server.streams as s; s.MAX_READERS = 0; sys.argv[0] = 'fixed_server'; runpy.run_module('testkit.fixed_server', run_name='__main__')"
            small_first = start_process([sys.executable, "-c", code, str(args.tokens), str(TRANSPORT_HIDDEN)], Path(logs) / "small.log")
        try:
            figures = asyncio.run(profile(args, ours, bare, small_first))
        finally:
            ours.stop(grace_s=10)
            bare.stop()
            if small_first is not None:
                small_first.stop(grace_s=10)
    if args.record:
        name = f"profile_dataplane_{args.tokens}_tokens_{args.in_flight}_in_flight"
        print(f"wrote {record_result(name, figures, args.record, load=load)}")


if __name__ == "__main__":
    main()
