"""Measures what precomputed items save: one request's latency all raw, half and all precomputed, as ratios
to all raw in the same run, plus the cost of a chunked-prefill window and of assembling a prefill batch."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tooling

from protos.wire import DTYPE_NAMES
from receiver import EncoderReceiver, batch_embedding, window_rows
from testkit.bench_harness import (
    MachineLoad,
    Stopwatch,
    add_record_flag,
    median_ms,
    record_result,
    repeat_async,
)
from testkit.default_model import ensure_default_model
from testkit.images import image_bytes
from testkit.servers import running_server


async def bench(args: argparse.Namespace) -> dict:
    model_dir = ensure_default_model(args.model_dir or tempfile.mkdtemp(prefix="bench-model-"))
    images = [image_bytes(args.size, args.size, seed=i) for i in range(args.items)]
    async with running_server(model_dir, dtype=DTYPE_NAMES[args.dtype]) as server:
        async with EncoderReceiver([server.url]) as rx:
            raw_items = [{"data": d} for d in images]
            reference = await rx.encode("warmup", raw_items)
            precomputed = [{"precomputed_embedding": item.embedding} for item in reference.items]
            half = [precomputed[i] if i % 2 else raw_items[i] for i in range(len(images))]
            await rx.encode("warmup-half", half)
            figures = {}
            for name, items in (
                ("all raw", raw_items),
                ("half precomputed", half),
                ("all precomputed", precomputed),
            ):
                figures[name] = median_ms(
                    await repeat_async(lambda name=name, items=items: rx.encode(name, items), args.repeats)
                )
    base = figures["all raw"]
    tokens = reference.num_tokens
    print(
        f"request of {args.items} images {args.size}x{args.size}, {tokens} tokens, {args.dtype}, "
        "1 server on loopback"
    )
    for name, ms in figures.items():
        print(f"  {name:17s} {ms:9.2f} ms  {ms / base:6.3f}x of all raw")

    offsets = [
        (10 + i * (tokens // args.items + 3), 10 + i * (tokens // args.items + 3) + item.num_tokens - 1)
        for i, item in enumerate(reference.items)
    ]
    embedding = reference.embedding
    watch = Stopwatch()
    for step in range(10000):
        window_rows(embedding, step % tokens, 256, offsets)
    window_us = watch.seconds() / 10000 * 1e6
    print(f"window_rows, {args.items} items: {window_us:.1f} us per window")

    results = [reference] * 3
    nbytes = 3 * embedding.numel() * embedding.element_size()
    copy_ms = median_ms(
        await repeat_async(lambda: asyncio.to_thread(batch_embedding, results, "cpu"), args.repeats)
    )
    cat_ms = median_ms(
        await repeat_async(lambda: asyncio.to_thread(torch.cat, [embedding] * 3), args.repeats)
    )
    print(
        f"batch_embedding of 3 requests ({nbytes / 2**20:.0f} MiB) to cpu: {copy_ms:.2f} ms, "
        f"{copy_ms / cat_ms:.2f}x of one torch.cat of the same rows"
    )
    return {
        "items": args.items,
        "image": f"{args.size}x{args.size}",
        "tokens": tokens,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "request_ms": figures,
        "window_rows_us": window_us,
        "batch_embedding": {"mib": nbytes / 2**20, "ms": copy_ms, "torch_cat_ms": cat_ms},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--items", type=int, default=8)
    p.add_argument("--size", type=int, default=448)
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="float32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model-dir", help="where the default model is (written there if missing)")
    add_record_flag(p)
    args = p.parse_args()
    load = MachineLoad()
    figures = asyncio.run(bench(args))
    if args.record:
        print(f"wrote {record_result('precomputed', figures, args.record, load=load)}")


if __name__ == "__main__":
    main()
