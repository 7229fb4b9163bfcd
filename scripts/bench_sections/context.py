"""A benchmark run's context: its profile, the child processes it starts (encoder servers and the
baselines' senders, all at once before the first section), the models they serve, and image seeds."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import Awaitable, Sequence
from pathlib import Path

from testkit.checkpoints import write_tower_checkpoint
from testkit.launcher import LaunchedProcess, server_argv, start_process

from .profile import MiB, Profile
from .transport_baselines import mooncake_available
from .transport_items import SMALL, TRANSPORT_HIDDEN, item_bytes, item_tokens, served_tower

BENCH_SCRIPT = Path(__file__).resolve().parent.parent / "bench.py"  # runs the baselines' roles


class Seeds:
    """Hands out image seeds no earlier request used."""

    def __init__(self):
        self._next = 1000

    def take(self, n: int) -> range:
        self._next += n
        return range(self._next - n, self._next)


class Children:
    """The benchmark's child processes, started side by side by testkit's launcher; all stopped at the end."""

    def __init__(self, log_dir: Path, timeout: float):
        self.log_dir = log_dir
        self.timeout = timeout
        self.started: list[LaunchedProcess] = []

    async def spawn(
        self, name: str, argv: Sequence[str], threads: int, env: dict[str, str] | None = None
    ) -> LaunchedProcess:
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **(env or {})}
        log_path = self.log_dir / f"{name}.log"
        child = await asyncio.to_thread(start_process, argv, log_path, env=env, timeout=self.timeout)
        self.started.append(child)
        return child

    async def encoder_server(
        self, name: str, model_dir: Path, profile: Profile, *flags: str
    ) -> LaunchedProcess:
        argv = server_argv(model_dir, "--device", profile.device, "--dtype", profile.dtype,
                           "--preprocess-workers", str(profile.preprocess_workers), *flags)  # fmt: skip
        return await self.spawn(name, argv, profile.torch_threads)

    async def role(self, name: str, role: str, threads: int, *flags: str) -> LaunchedProcess:
        return await self.spawn(name, [sys.executable, str(BENCH_SCRIPT), "--role", role, *flags], threads)

    def stop(self) -> None:
        for child in self.started:
            child.stop(grace_s=10)


@dataclasses.dataclass
class Context:
    profile: Profile
    children: Children
    workdir: Path
    seeds: Seeds = dataclasses.field(default_factory=Seeds)
    servers: dict[str, LaunchedProcess] = dataclasses.field(default_factory=dict)
    models: dict[str, Path] = dataclasses.field(default_factory=dict)
    mooncake_skipped: str | None = None  # why the Mooncake figures are absent
    tracing_env: dict[str, str] = dataclasses.field(default_factory=dict)  # the traced servers' OTEL_* settings


def transport_processes(ctx: Context) -> dict[str, Awaitable[LaunchedProcess]]:
    """The transport section's fixed-payload servers, one per item size, and its baselines' senders."""
    p, children = ctx.profile, ctx.children
    starts: dict[str, Awaitable[LaunchedProcess]] = {}
    ctx.mooncake_skipped = mooncake_available()
    # With the transfer engine too where it imports: the engine rows (transport_engine.py) use these servers.
    engine = ["--mooncake"] if ctx.mooncake_skipped is None else []
    for size in [*p.transport_sizes, SMALL]:
        name = f"fixed-{size}" if size else "fixed-small"
        argv = [
            sys.executable,
            "-m",
            "testkit.fixed_server",
            str(item_tokens(size)),
            str(TRANSPORT_HIDDEN),
            *engine,
        ]
        starts[name] = children.spawn(name, argv, 1)
    payloads = [str(item_bytes(size)) for size in p.transport_sizes]
    starts["bare-grpc"] = children.role("bare-grpc", "bare-grpc", 1, "--payload-bytes", *payloads,
                                        str(item_bytes(SMALL)))  # fmt: skip
    starts["zmq-push"] = children.role("zmq-push", "zmq-push", 1, "--payload-bytes", *payloads)
    starts["served"] = served_server(ctx)
    if ctx.mooncake_skipped is None:
        starts["mooncake"] = children.role("mooncake", "mooncake-target", 1, "--payload-bytes", *payloads)
        # Neither shared memory nor the engine: every offer declined.
        plain = ["-m", "testkit.fixed_server", str(item_tokens(7 * MiB)), str(TRANSPORT_HIDDEN), "--no-shm"]
        starts["plain"] = children.spawn("plain", [sys.executable, *plain], 1)
    else:
        print(f"transport: Mooncake section skipped ({ctx.mooncake_skipped})", file=sys.stderr)
    return starts


async def served_server(ctx: Context) -> LaunchedProcess:
    """The encoder server users run, beside the stand-ins: `python -m encoder_server` on a real checkpoint
    (transport_items.served_tower), bf16, shared memory on, one thread as the stand-ins have."""
    ctx.models["served"] = await asyncio.to_thread(
        write_tower_checkpoint, ctx.workdir / "served", served_tower(), "cpu"
    )
    argv = server_argv(ctx.models["served"], "--device", ctx.profile.device, "--dtype", "bfloat16", "--shm-transfer")
    return await ctx.children.spawn("served", argv, 1)


async def start_processes(ctx: Context, sections: Sequence[str]) -> None:
    """Writes the models and starts every server the chosen sections use, all at once."""
    from testkit.default_model import write_default_model

    from . import tracing

    p, children = ctx.profile, ctx.children
    starts = transport_processes(ctx) if "transport" in sections else {}
    if "tracing" in sections:
        starts.update(await tracing.processes(ctx))
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
                starts[name] = children.encoder_server(
                    name, ctx.models["tower"], p, "--max-batch-images", "1"
                )
    if "batching" in sections:
        ctx.models["default"] = await asyncio.to_thread(write_default_model, ctx.workdir / "default")
        starts["batching-on"] = children.encoder_server("batching-on", ctx.models["default"], p)
        starts["batching-off"] = children.encoder_server("batching-off", ctx.models["default"], p,
                                                         "--max-batch-images", "1")  # fmt: skip
    started = await asyncio.gather(*starts.values())
    ctx.servers.update(zip(starts, started))
