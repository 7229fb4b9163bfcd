"""The demo: two encoder servers on the built-in default model, a few images through the receiver,
and a check that the result equals the same model run in-process. `--record` also writes what it
printed as a result file (benchmarks/results/demo.json), from which the README shows it."""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from transformers.utils import logging as transformers_logging

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from receiver import EncoderReceiver  # noqa: E402
from testkit.bench_harness import add_record_flag, record_result  # noqa: E402
from testkit.default_model import DEFAULT_MODEL_DIR, ensure_default_model  # noqa: E402
from testkit.images import drawn_image_bytes  # noqa: E402
from testkit.launcher import launch_server  # noqa: E402
from testkit.reference import reference_features  # noqa: E402


def build_items(workdir: Path) -> tuple[list[dict], list[bytes]]:
    """Five images, given the three ways a prefill node may hold them."""
    cat = workdir / "cat.png"
    cat.write_bytes(drawn_image_bytes(640, 480, 40, "PNG"))
    wide = drawn_image_bytes(1280, 320, 90, "JPEG")
    small = drawn_image_bytes(96, 96, 140, "PNG")
    tall = drawn_image_bytes(300, 900, 190, "JPEG")
    tiny = drawn_image_bytes(1, 1, 240, "PNG")
    items = [
        {"modality": "image", "url": cat.as_uri()},
        {"modality": "image", "url": "data:image/jpeg;base64," + base64.b64encode(wide).decode()},
        {"modality": "image", "data": small},
        {"modality": "image", "data": tall},
        {"modality": "image", "data": tiny},
    ]
    return items, [cat.read_bytes(), wide, small, tall, tiny]


async def encode(urls: list[str], items: list[dict]):
    async with EncoderReceiver(urls) as rx:
        started = time.perf_counter()
        result = await rx.encode("demo-1", items)
        return result, (time.perf_counter() - started) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=str(REPO_ROOT / DEFAULT_MODEL_DIR), help="checkpoint (default: built-in)")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    add_record_flag(parser)
    args = parser.parse_args()
    printed: list[str] = []

    def say(line: str = "") -> None:  # what the demo prints, kept for --record
        printed.extend(line.split("\n"))
        print(line, flush=True)

    transformers_logging.disable_progress_bar()  # writing and loading the checkpoint: the table is the output

    model_dir = ensure_default_model(args.model) if args.model == str(REPO_ROOT / DEFAULT_MODEL_DIR) else Path(args.model)
    shown = model_dir.relative_to(REPO_ROOT) if model_dir.is_relative_to(REPO_ROOT) else model_dir
    say(f"model: {shown} (built-in default: random weights, embeddings are not meaningful)")
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        servers = [
            stack.enter_context(launch_server(model_dir, "--dtype", args.dtype, log_dir=workdir))
            for i in range(2)
        ]
        urls = [s.url for s in servers]
        say(f"encoders: {', '.join(urls)}")
        items, images = build_items(workdir)
        result, total_ms = asyncio.run(encode(urls, items))

        say(f"\n{'item':>4}  {'source':<6} {'encoder':<24} {'grid_thw':<14} {'tokens':>6} {'hidden':>6}  {'dtype':<9} {'time ms':>8}")
        for item, spec in zip(result.items, items):
            source = "data" if "data" in spec else spec["url"].split(":", 1)[0]
            say(
                f"{item.index:>4}  {source:<6} {item.encoder_url:<24} {str(item.grid_thw):<14} {item.num_tokens:>6} "
                f"{item.hidden_size:>6}  {str(item.embedding.dtype).removeprefix('torch.'):<9} {item.stream_ms:>8.1f}"
            )
        say(f"request: {result.num_tokens} tokens x {result.embedding.shape[1]} in {total_ms:.0f} ms")

    dtype = result.embedding.dtype
    reference = [features.pooler_output[0] for features in reference_features(model_dir, images, dtype)]
    worst = max((item.embedding.float() - ref.float()).abs().max().item() for item, ref in zip(result.items, reference))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    ok = worst <= tolerance and all(i.embedding.shape == r.shape for i, r in zip(result.items, reference))
    say(f"\nin-process get_image_features check: max |diff| = {worst:.2e} (tolerance {tolerance:g}): {'OK' if ok else 'MISMATCH'}")
    if args.record:
        print(f"wrote {record_result('demo', {'output': printed}, args.record)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
