"""The transport section's transfer-engine rows: our Mooncake transport (TCP on loopback) against our
stream from the same server (the section's fixed-payload servers run the engine too), bare grpcio and
memcpy in the same rounds, one call at a time and 4 in flight, with the CPU seconds each side spends
per GB; the engine alone (its writes as our server makes them, into the mooncake-target process), which
with a bare call's cost sets the most the engine path could reach against the stream in the run; and
the default receiver (transfer="auto") against a server with neither shared memory nor an engine,
against transfer="grpc": what a declined offer costs. docs/mooncake-transport.md describes them."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable

from testkit.bench_harness import interleaved, median, paired_ratio, process_cpu_seconds

from .context import Context
from .profile import MiB
from .transport import TransportRun, in_flight
from .transport_items import IN_FLIGHT, item_bytes

# Ours through the engine, and the engine alone; the stream's (a cached item, as here), bare grpcio's
# and memcpy's figures are TransportRun's own, measured again in these rounds for their CPU.
OURS = ("engine_seq", "engine_x4")
RAW = ("raw_seq", "raw_x4")
BASELINES = ("stream_cached_seq", "stream_cached_x4", "bare_seq", "bare_x4", "memcpy")
KINDS = (*OURS, *RAW, *BASELINES)
DECLINED = ("auto_declined_seq", "grpc_declined_seq")  # against the plain server, 7 MiB
WRITE_TIMEOUT_S = 30.0


class EngineRun:
    """The engine rows' receivers and raw engine, and each figure with the CPU both sides spent on it."""

    def __init__(self, ctx: Context, base: TransportRun):
        from encoder_common.mooncake_engine import Engine, EngineSettings
        from receiver import EncoderReceiver
        from receiver.config import MooncakeReceiverConfig

        self.base, self.servers, sizes = base, ctx.servers, ctx.profile.transport_sizes
        # A pool sized for this section's calls (the default's 8 x 48 MiB is mapped up front).
        self.engine_rx = {
            size: EncoderReceiver(
                [ctx.servers[f"fixed-{size}"].url],
                transfer="mooncake",
                mooncake=MooncakeReceiverConfig(slots=2 * IN_FLIGHT, slot_bytes=item_bytes(size)),
            )
            for size in sizes
        }
        plain = ctx.servers["plain"].url
        self.declined_rx = {
            "auto": EncoderReceiver([plain]),
            "grpc": EncoderReceiver([plain], transfer="grpc"),
        }
        target = ctx.servers["mooncake"]
        self.raw_engine = Engine(EngineSettings(), "127.0.0.1")
        self.raw_target = f"127.0.0.1:{target.port}", int(re.search(r"buffer (\d+)", target.log()).group(1))
        self.cpu: dict[str, list[tuple[float, float]]] = {}  # figure -> (receiver, server) s/GB per round

    async def close(self) -> None:
        for receiver in [*self.engine_rx.values(), *self.declined_rx.values()]:
            await receiver.close()
        self.raw_engine.close()

    def server_pid(self, size: int, kind: str) -> int | None:
        name = {"bare": "bare-grpc", "raw": "mooncake", "auto": "plain", "grpc": "plain"}.get(
            kind.split("_")[0]
        )
        return None if kind == "memcpy" else self.servers[name or f"fixed-{size}"].process.pid

    async def measure(self, size: int, kind: str) -> float:
        """GB/s of one figure; records both sides' CPU seconds per GB beside it."""
        pid = self.server_pid(size, kind)
        before = time.process_time(), process_cpu_seconds(pid) if pid else 0.0
        if kind in BASELINES:
            gbps = await self.base.measure(size, kind)
        elif kind in RAW:
            gbps = await self.raw(size, IN_FLIGHT if kind.endswith("_x4") else 1)
        else:
            gbps = await self.ours(size, kind)
        nbytes = self.base.n_calls[size] * item_bytes(size)
        after = time.process_time(), process_cpu_seconds(pid) if pid else 0.0
        per_gb = [(b - a) / (nbytes / 1e9) for a, b in zip(before, after)]
        self.cpu.setdefault(f"{size} {kind}", []).append((per_gb[0], per_gb[1]))
        return gbps

    async def ours(self, size: int, kind: str) -> float:
        receiver = (
            self.declined_rx[kind.split("_")[0]] if kind.endswith("declined_seq") else self.engine_rx[size]
        )
        call: Callable[[], Awaitable[None]] = self.base.ours_call(
            receiver, self.base.cached_image, size, True
        )
        await receiver.encode("bench", [{"data": self.base.cached_image}])  # untimed: cached from here on
        n = self.base.n_calls[size]
        return (
            n * item_bytes(size) / await in_flight([call] * n, IN_FLIGHT if kind.endswith("_x4") else 1) / 1e9
        )

    async def raw(self, size: int, width: int) -> float:
        """The engine alone: `n_calls` writes of the item's bytes from this process into the target's
        buffer, as our server's write threads make them, `width` at a time."""
        (session, remote), nbytes, n = self.raw_target, item_bytes(size), self.base.n_calls[size]
        source = self.base.copies[size][0][0]

        def writes(count: int) -> None:
            for _ in range(count):
                if not self.raw_engine.write(
                    session, [(source.ctypes.data, nbytes)], remote, WRITE_TIMEOUT_S
                ):
                    raise RuntimeError("mooncake: a write into the target failed")

        started = time.perf_counter()
        await asyncio.gather(*(asyncio.to_thread(writes, n // width) for _ in range(width)))
        return n // width * width * nbytes / (time.perf_counter() - started) / 1e9

    def measures(self) -> dict[str, Callable[[], Awaitable[float]]]:
        figures = {f"{size} {kind}": (size, kind) for size in self.base.p.transport_sizes for kind in KINDS}
        figures.update({f"{7 * MiB} {kind}": (7 * MiB, kind) for kind in DECLINED})
        measures = {
            name: (lambda size=size, kind=kind: self.measure(size, kind))
            for name, (size, kind) in figures.items()
        }
        measures["floor request_ack"] = lambda: self.base.floor_ms("request_ack")
        return measures

    async def warm_up(self) -> None:
        """Each receiver's engine started and its connections made; the items cached."""
        for measure in self.measures().values():
            await measure()
        self.cpu.clear()


def size_row(size: int, runs: dict[str, list[float]], cpu: dict[str, list[tuple[float, float]]]) -> dict:
    """One item size's engine figures: GB/s, ratios to the stream and bare grpcio of the same mode, the
    CPU seconds per GB of each side (the median over rounds), and the ceilings the run sets."""
    by = {kind: runs[f"{size} {kind}"] for kind in KINDS}
    row = {
        "payload_bytes": item_bytes(size),
        "gbps": {kind: median(values) for kind, values in by.items()},
        "runs_gbps": by,
        "cpu_s_per_gb": {
            kind: {
                "receiver": median(r for r, _ in cpu[f"{size} {kind}"]),
                "server": median(s for _, s in cpu[f"{size} {kind}"]),
            }
            for kind in by
        },
    }
    cpu_of = row["cpu_s_per_gb"]
    for mode in ("seq", "x4"):
        row[f"engine_vs_stream_{mode}"] = paired_ratio(by[f"engine_{mode}"], by[f"stream_cached_{mode}"])
        row[f"engine_vs_bare_{mode}"] = paired_ratio(by[f"engine_{mode}"], by[f"bare_{mode}"])
        row[f"engine_vs_memcpy_{mode}"] = paired_ratio(by[f"engine_{mode}"], by["memcpy"])
        row[f"engine_vs_raw_{mode}"] = paired_ratio(by[f"engine_{mode}"], by[f"raw_{mode}"])
        row[f"receiver_cpu_engine_vs_stream_{mode}"] = (
            cpu_of[f"engine_{mode}"]["receiver"] / cpu_of[f"stream_cached_{mode}"]["receiver"]
        )
    return row


def ceilings(row: dict, request_ack_ms: float) -> dict[str, float]:
    """The most `engine_vs_stream` could reach in this run: the stream's time per item against the
    engine's own write of the item plus, one call at a time, a bare call carrying the request (4 in
    flight overlap their calls)."""
    ms = {kind: row["payload_bytes"] / 1e6 / gbps for kind, gbps in row["gbps"].items()}
    return {
        "engine_vs_stream_seq": ms["stream_cached_seq"] / (ms["raw_seq"] + request_ack_ms),
        "engine_vs_stream_x4": ms["stream_cached_x4"] / ms["raw_x4"],
    }


async def run(ctx: Context, base: TransportRun) -> dict:
    engine = EngineRun(ctx, base)
    try:
        await engine.warm_up()
        runs = await interleaved("transfer engine", ctx.profile.transport_rounds, engine.measures())
    finally:
        await engine.close()
    ack_ms = median(runs["floor request_ack"])
    out: dict = {"request_ack_ms": ack_ms}
    for size in ctx.profile.transport_sizes:
        row = out[f"{size // MiB}MiB"] = size_row(size, runs, engine.cpu)
        row["ceilings"] = ceilings(row, ack_ms)
    auto, grpc = runs[f"{7 * MiB} auto_declined_seq"], runs[f"{7 * MiB} grpc_declined_seq"]
    out["declined_offer"] = {
        "auto_gbps": median(auto),
        "grpc_gbps": median(grpc),
        "auto_vs_grpc": paired_ratio(auto, grpc),
    }
    return out
