"""Per-image hand-off cost to vLLM, measured in one run: the connector (a Fetch of the leased item into a
/dev/shm file the engine worker maps, over the gRPC stream or shared memory) vs JSON embeddings (the
gateway receives the item, writes base64(torch.save) into the chat request, vLLM parses it back).

The item is 1,024 tokens x 3,584 bf16 (Qwen2.5-VL-7B's width, 7 MiB). The encoder is a real server
process whose tower is a stand-in returning that item (testkit.fixed_server), so the
figures are the hand-off alone. Both sides of the JSON path run here; the HTTP transfer of its
~9.3 MiB body to the engine is not counted (it would only add to the JSON side).

    python scripts/bench_connector.py [--rounds 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from encoder_common.vllm_inputs import GridEmbeds  # noqa: E402
from receiver import EncoderReceiver  # noqa: E402
from receiver.vllm.item_files import create_item_file, map_item_file, new_item_path, sweep_dead  # noqa: E402
from testkit.bench_harness import (  # noqa: E402
    MachineLoad,
    Stopwatch,
    add_record_flag,
    median,
    record_result,
    write_json,
)
from testkit.fixed_server import fixed_server  # noqa: E402
from testkit.images import image_bytes  # noqa: E402

TOKENS, HIDDEN = 1024, 3584
BENCH_PREFIX = "bench-connector"
ITEM_DIR = Path("/dev/shm")  # where the engine's worker maps an item from


async def connector_handoff(rx: EncoderReceiver, round_index: int) -> float:
    """Seconds from the engine's fetch to the tensor in the worker: Fetch into a file, map it."""
    encoded = await rx.encode(
        f"lease-{round_index}", [{"data": image_bytes(16, 16)}], lease_ms=60_000, withhold_payloads=True
    )
    key = encoded.items[0].lease.key
    path = new_item_path(ITEM_DIR, BENCH_PREFIX)
    try:
        watch = Stopwatch()
        item = await rx.fetch(
            f"fetch-{round_index}", key, allocate=lambda shape, dtype: create_item_file(path, shape, dtype)
        )
        tensor = map_item_file(path, (item.num_tokens, item.hidden_size), item.embedding.dtype)
        elapsed = watch.seconds()
        assert tensor.shape == (TOKENS, HIDDEN)
        return elapsed
    finally:
        path.unlink(missing_ok=True)


async def json_handoff(rx: EncoderReceiver, round_index: int) -> tuple[float, float, float, int]:
    """Seconds of the JSON path's three steps: the item to the gateway, the gateway writing the chat
    part, vLLM reading it back (json, base64, torch.load as its chat utilities do); and the part's size."""
    watch = Stopwatch()
    item = (await rx.encode(f"inline-{round_index}", [{"data": image_bytes(16, 16)}])).items[0]
    to_gateway_s = watch.lap()
    body = json.dumps({"messages": [{"role": "user", "content": [GridEmbeds().inline_part(item)]}]})
    write_s = watch.lap()
    part = json.loads(body)["messages"][0]["content"][0]["image_embeds"]
    tensor = torch.load(io.BytesIO(base64.b64decode(part["image_embeds"])), weights_only=True)
    read_s = watch.lap()
    assert tensor.shape == (TOKENS, HIDDEN)
    return to_gateway_s, write_s, read_s, len(body)


async def measure(url: str, rounds: int) -> dict:
    times: dict[str, list[float]] = {k: [] for k in ("grpc", "shm", "to_gateway", "json_write", "json_read")}
    size = 0
    async with (
        EncoderReceiver([url], transfer="grpc") as grpc_rx,
        EncoderReceiver([url], transfer="shm") as shm_rx,
    ):
        for i in range(2 + rounds):  # the paths take turns round by round, so a noisy machine slows all alike
            grpc_s = await connector_handoff(grpc_rx, i)
            shm_s = await connector_handoff(shm_rx, i)
            to_gateway, write, read, size = await json_handoff(grpc_rx, i)
            if i >= 2:  # after warm-up
                for name, value in zip(times, (grpc_s, shm_s, to_gateway, write, read)):
                    times[name].append(value)
    medians = {name: median(values) for name, values in times.items()}
    json_parts = zip(times["to_gateway"], times["json_write"], times["json_read"])
    medians["json"] = median(sum(parts) for parts in json_parts)
    return {
        "median_s": medians,
        "json_body_bytes": size,
        "payload_bytes": TOKENS * HIDDEN * 2,
        "rounds": rounds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    add_record_flag(parser)
    args = parser.parse_args()
    load = MachineLoad()
    # A run holds its instance's lock file until it exits, as the connector does; the files of runs
    # that are over are swept here, as the connector sweeps its own at start.
    sweep_dead(ITEM_DIR, BENCH_PREFIX)
    with fixed_server(TOKENS, HIDDEN) as url:
        figures = asyncio.run(measure(url, args.rounds))
    ms = {name: value * 1000 for name, value in figures["median_s"].items()}
    mib = figures["payload_bytes"] / (1 << 20)
    print(f"hand-off of one {TOKENS} x {HIDDEN} bf16 item ({mib:.1f} MiB), median of {args.rounds} rounds:")
    print(f"  connector, gRPC stream    {ms['grpc']:8.1f} ms   (Fetch into a /dev/shm file + worker map)")
    print(f"  connector, shared memory  {ms['shm']:8.1f} ms")
    print(
        f"  JSON embeddings           {ms['json']:8.1f} ms   (to gateway {ms['to_gateway']:.1f} + "
        f"base64(torch.save) into JSON {ms['json_write']:.1f} + vLLM parsing it {ms['json_read']:.1f}; "
        f"body {figures['json_body_bytes'] / (1 << 20):.1f} MiB)"
    )
    print(
        f"  JSON / connector-gRPC {ms['json'] / ms['grpc']:.1f}x   "
        f"JSON / connector-shm {ms['json'] / ms['shm']:.1f}x"
    )
    if args.json:
        write_json(args.json, figures)
    if args.record:
        print(f"wrote {record_result('connector_handoff', figures, args.record, load=load)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
