"""The transport section's transfer-engine rows: our Mooncake transport (TCP on loopback) against our
stream from the same server (the section's fixed-payload servers run the engine too), bare grpcio and
memcpy in the same rounds, one call at a time and 4 in flight, with the CPU seconds each side spends
per GB moved; and the default receiver (transfer="auto")
against a server with neither shared memory nor an engine, against transfer="grpc": what a declined
offer costs. docs/mooncake-transport.md describes the figures."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from testkit.bench_harness import interleaved, median, paired_ratio, process_cpu_seconds

from .context import Context
from .profile import MiB
from .transport import TransportRun, in_flight
from .transport_items import IN_FLIGHT, item_bytes

# Ours through the engine; the stream's (a cached item, as here), bare grpcio's and memcpy's figures are
# TransportRun's own, measured again in these rounds for their CPU.
OURS = ("engine_seq", "engine_x4")
BASELINES = ("stream_cached_seq", "stream_cached_x4", "bare_seq", "bare_x4", "memcpy")
DECLINED = ("auto_declined_seq", "grpc_declined_seq")  # against the plain server, 7 MiB


class EngineRun:
    """The engine rows' receivers, and each figure with the CPU both sides spent on it."""

    def __init__(self, ctx: Context, base: TransportRun):
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
        self.cpu: dict[str, list[tuple[float, float]]] = {}  # figure -> (receiver, server) s/GB per round

    async def close(self) -> None:
        for receiver in [*self.engine_rx.values(), *self.declined_rx.values()]:
            await receiver.close()

    def server_pid(self, size: int, kind: str) -> int | None:
        if kind.startswith("bare"):
            return self.servers["bare-grpc"].process.pid
        if kind.endswith("declined_seq"):
            return self.servers["plain"].process.pid
        return None if kind == "memcpy" else self.servers[f"fixed-{size}"].process.pid

    async def measure(self, size: int, kind: str) -> float:
        """GB/s of one figure; records both sides' CPU seconds per GB beside it."""
        pid = self.server_pid(size, kind)
        before = time.process_time(), process_cpu_seconds(pid) if pid else 0.0
        if kind in BASELINES:
            gbps = await self.base.measure(size, kind)
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

    def measures(self) -> dict[str, Callable[[], Awaitable[float]]]:
        figures = {
            f"{size} {kind}": (size, kind)
            for size in self.base.p.transport_sizes
            for kind in (*OURS, *BASELINES)
        }
        figures.update({f"{7 * MiB} {kind}": (7 * MiB, kind) for kind in DECLINED})
        return {
            name: (lambda size=size, kind=kind: self.measure(size, kind))
            for name, (size, kind) in figures.items()
        }

    async def warm_up(self) -> None:
        """Each receiver's engine started and its connections made; the items cached."""
        for measure in self.measures().values():
            await measure()
        self.cpu.clear()


def size_row(size: int, runs: dict[str, list[float]], cpu: dict[str, list[tuple[float, float]]]) -> dict:
    """One item size's engine figures: GB/s, ratios to the stream and bare grpcio of the same mode, and
    the CPU seconds per GB of each side (the median over rounds)."""
    by = {kind: runs[f"{size} {kind}"] for kind in (*OURS, *BASELINES)}
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
    for mode in ("seq", "x4"):
        row[f"engine_vs_stream_{mode}"] = paired_ratio(by[f"engine_{mode}"], by[f"stream_cached_{mode}"])
        row[f"engine_vs_bare_{mode}"] = paired_ratio(by[f"engine_{mode}"], by[f"bare_{mode}"])
        row[f"engine_vs_memcpy_{mode}"] = paired_ratio(by[f"engine_{mode}"], by["memcpy"])
        cpu_rx = row["cpu_s_per_gb"]
        row[f"receiver_cpu_engine_vs_stream_{mode}"] = (
            cpu_rx[f"engine_{mode}"]["receiver"] / cpu_rx[f"stream_cached_{mode}"]["receiver"]
        )
    return row


async def run(ctx: Context, base: TransportRun) -> dict:
    engine = EngineRun(ctx, base)
    try:
        await engine.warm_up()
        runs = await interleaved("transfer engine", ctx.profile.transport_rounds, engine.measures())
    finally:
        await engine.close()
    out: dict = {
        f"{size // MiB}MiB": size_row(size, runs, engine.cpu) for size in ctx.profile.transport_sizes
    }
    auto, grpc = runs[f"{7 * MiB} auto_declined_seq"], runs[f"{7 * MiB} grpc_declined_seq"]
    out["declined_offer"] = {
        "auto_gbps": median(auto),
        "grpc_gbps": median(grpc),
        "auto_vs_grpc": paired_ratio(auto, grpc),
    }
    return out
