"""The tracing section: the encode path with tracing on, every request sampled, against tracing off, in
the same run: one receiver `encode` of a cached item (7 MiB, and the small one) into a fixed-payload
server, traced on both sides and exported to a collector process over OTLP/HTTP (the default protocol),
or untraced on both. OTLP/gRPC is not measured beside them: its exporter's first call would start gRPC's
own I/O threads in this process for good, under the untraced calls too (encoder_common/tracing.py)."""

from __future__ import annotations

import asyncio
import os
import sys
import time

from encoder_common import tracing
from testkit.bench_harness import interleaved, median, paired_ratio, process_cpu_seconds

from .context import Context
from .profile import MiB
from .transport_items import SMALL, TRANSPORT_HIDDEN, item_tokens, request_jpeg

SIZES = {"7MiB": 7 * MiB, "small": SMALL}
MODES = ("off", "on")
SMALL_CALLS_PER_LARGE = 4  # the small item's calls take a fraction of the 7 MiB one's
# How often spans are exported, on both sides: often enough that a measured block of calls pays for the
# export of its own spans (the SDK's default, 5 s, would leave the receiver's to the flush after it).
EXPORT_DELAY_MS = "100"
WARM_CALLS = 3  # untimed, before each block: what a block's first calls pay once is not its cost


def server_name(size: str, mode: str) -> str:
    return f"tracing-{mode}-{size}"


async def processes(ctx: Context) -> dict:
    """Starts the collector, then returns the starts of an untraced and a traced fixed-payload server per
    item size (the traced ones export to the collector, every request sampled)."""
    children = ctx.children
    collector = await children.spawn("otlp-collector", [sys.executable, "-m", "testkit.otlp_collector"], 1)
    ctx.tracing_env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{collector.port}/v1/traces",
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_SERVICE_NAME": "bench-encoder",
        "OTEL_BSP_SCHEDULE_DELAY": EXPORT_DELAY_MS,
    }
    starts = {}
    for size, nbytes in SIZES.items():
        argv = [sys.executable, "-m", "testkit.fixed_server", str(item_tokens(nbytes)), str(TRANSPORT_HIDDEN)]
        for mode in MODES:
            name = server_name(size, mode)
            starts[name] = children.spawn(name, argv, 1, env=ctx.tracing_env if mode == "on" else None)
    return starts


async def run(ctx: Context) -> dict:
    from receiver import EncoderReceiver

    p = ctx.profile
    image = request_jpeg(seed=0)
    receivers = {
        (size, mode): EncoderReceiver([ctx.servers[server_name(size, mode)].url], transfer="grpc")
        for size in SIZES
        for mode in MODES
    }
    calls = {"7MiB": max(4, p.transport_bytes // (7 * MiB))}
    calls["small"] = SMALL_CALLS_PER_LARGE * calls["7MiB"]
    # CPU time of the receiver's process and the server's over the timed blocks: what tracing adds to the
    # work, which a loaded machine's latencies blur.
    cpu_seconds = {(size, mode): 0.0 for size in SIZES for mode in MODES}

    def measure(size: str, mode: str):
        async def one_round() -> float:
            """The mean seconds of one call over a block of calls, tracing as `mode` says. Tracing is
            configured before the block, and a few calls and an export precede the timing (the exporter
            connects on its first export); inside the block the exports run as they would in a long-lived
            process, every EXPORT_DELAY_MS; what is left is flushed after it."""
            receiver = receivers[size, mode]
            pids = (os.getpid(), ctx.servers[server_name(size, mode)].process.pid)
            if mode == "on":
                tracing.configure("bench-receiver", ctx.tracing_env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"])
            try:
                for _ in range(WARM_CALLS):
                    await receiver.encode("bench-tracing-warm", [{"data": image}])
                await asyncio.sleep(2 * int(EXPORT_DELAY_MS) / 1000)
                cpu, started = process_cpu_seconds(*pids), time.perf_counter()
                for _ in range(calls[size]):
                    (item,) = (await receiver.encode("bench-tracing", [{"data": image}])).items
                    assert item.cache_hit
                seconds = time.perf_counter() - started
                cpu_seconds[size, mode] += process_cpu_seconds(*pids) - cpu
            finally:
                tracing.shutdown()
            return seconds / calls[size]

        return one_round

    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = EXPORT_DELAY_MS  # read as the receiver's tracing is configured
    try:
        for receiver in receivers.values():  # the first call of each computes the item; the rest are hits
            await receiver.encode("bench-tracing-warm", [{"data": image}])
        measures = {f"{size}_{mode}": measure(size, mode) for size in SIZES for mode in MODES}
        runs = await interleaved("tracing", p.transport_rounds, measures)
    finally:
        os.environ.pop("OTEL_BSP_SCHEDULE_DELAY")
        for receiver in receivers.values():
            await receiver.close()
    # The receiver's sampler is the SDK's default (parentbased_always_on): every request it starts is sampled.
    result: dict = {"sampler": ctx.tracing_env["OTEL_TRACES_SAMPLER"], "calls_per_round": calls}
    for size in SIZES:
        on, off = runs[f"{size}_on"], runs[f"{size}_off"]
        result[size] = {
            "on_ms": median(on) * 1000,  # a block's mean, the median over rounds
            "off_ms": median(off) * 1000,
            "on_vs_off": paired_ratio(on, off),
            "cpu_us_per_call": {
                mode: cpu_seconds[size, mode] / (calls[size] * p.transport_rounds) * 1e6 for mode in MODES
            },
        }
    return result
