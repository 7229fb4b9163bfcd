"""Latency of one chat request with an image through encoder-gateway -> vLLM, against vLLM alone running its
own vision tower, as ratios from one run; split into encode, hand-off to the engine and the engine's time;
plus what the gateway adds per image to serialize an embedding (base64 of torch.save).

Starts vLLM from .venv-engines (python -m vllm.entrypoints.openai.api_server) on the built-in default model.
"""

from __future__ import annotations

import asyncio
import base64
import io
import sys
import tempfile
from pathlib import Path

import aiohttp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tooling

from encoder_common.env_flags import EnvDefaultsParser
from encoder_common.vllm_inputs import GridEmbeds, serialize_tensor
from gateway.app import start
from gateway.config import GatewayConfig
from receiver import EncoderReceiver
from testkit.bench_harness import MachineLoad, Stopwatch, add_record_flag, median_ms, record_result
from testkit.chat import chat_request, image_part
from testkit.default_model import write_default_model
from testkit.images import image_bytes
from testkit.servers import running_server
from testkit.vllm_server import launch_vllm


def build_parser() -> EnvDefaultsParser:
    p = EnvDefaultsParser(
        prog="bench_gateway.py", env_prefix="BENCH_GATEWAY_", description=__doc__.splitlines()[0]
    )
    p.add_argument("--size", type=int, default=448, help="image width and height in pixels")
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="requests per path (each with a new image: no engine cache hit)",
    )
    p.add_argument(
        "--serialize-tokens", type=int, default=1024, help="rows of the serialization figure's item"
    )
    p.add_argument(
        "--serialize-hidden", type=int, default=3584, help="width of the serialization figure's item"
    )
    add_record_flag(p)
    return p


async def timed_post(session: aiohttp.ClientSession, url: str, body: dict) -> float:
    watch = Stopwatch()
    async with session.post(f"{url}/v1/chat/completions", json=body) as reply:
        await reply.read()
        if reply.status != 200:
            raise RuntimeError(f"{url}: {reply.status} {await reply.text()}")
    return watch.seconds()


def serialization(tokens: int, hidden: int, repeats: int = 5) -> tuple[int, float, float]:
    """Bytes of one bf16 item as vLLM's chat API takes it, ms to serialize it and ms for vLLM to load it."""
    tensor = torch.randn(tokens, hidden).to(torch.bfloat16)
    encode, decode = [], []
    for _ in range(repeats):
        watch = Stopwatch()
        text = serialize_tensor(tensor)
        encode.append(watch.lap())
        torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)  # what vLLM does with it
        decode.append(watch.lap())
    return len(text), median_ms(encode), median_ms(decode)


async def bench(args) -> dict:
    model_dir = write_default_model(Path(tempfile.mkdtemp(prefix="bench-gateway-")) / "model")
    log_path = model_dir.parent / "vllm.log"
    with launch_vllm(model_dir, log_path=log_path) as vllm:
        async with running_server(model_dir) as encoder, aiohttp.ClientSession() as session:
            runner, port = await start(
                GatewayConfig(engine_url=vllm.url, encoders=(encoder.url,), host="127.0.0.1", port=0)
            )
            try:
                samples, tokens = await measure(
                    args, session, str(model_dir), vllm.url, f"http://127.0.0.1:{port}", encoder.url
                )
            finally:
                await runner.cleanup()
    return print_figures(args, samples, tokens)


async def measure(args, session, model: str, engine_url: str, gateway: str, encoder_url: str):
    """Seconds of every request of each path (and of the gateway's stages, by hand), and the image's tokens."""
    seeds = iter(range(10_000))

    def request(parts):
        return chat_request(model, parts, max_tokens=1)

    def new_image():
        return image_bytes(args.size, args.size, seed=next(seeds))

    # Warm both paths (first requests compile and fill caches), each with images of its own.
    for _ in range(2):
        await timed_post(session, engine_url, request([image_part(new_image())]))
        await timed_post(session, gateway, request([image_part(new_image())]))
    samples = {name: [] for name in ("direct", "through", "encode", "handoff", "engine")}
    async with EncoderReceiver([encoder_url]) as receiver:
        for _ in range(args.repeats):
            samples["direct"].append(
                await timed_post(session, engine_url, request([image_part(new_image())]))
            )
            samples["through"].append(await timed_post(session, gateway, request([image_part(new_image())])))
            # The same stages by hand, on another new image: encode, hand-off, engine on embeddings.
            png = new_image()
            watch = Stopwatch()
            result = await receiver.encode("bench", [{"data": png}])
            samples["encode"].append(watch.lap())
            part = GridEmbeds().inline_part(result.items[0])
            samples["handoff"].append(watch.lap())
            samples["engine"].append(await timed_post(session, engine_url, request([part])))
    return samples, result.items[0].num_tokens


def print_figures(args, samples: dict[str, list[float]], tokens: int) -> dict:
    size, serialize_ms, load_ms = serialization(args.serialize_tokens, args.serialize_hidden)
    ms = {name: median_ms(values) for name, values in samples.items()}
    base = ms["direct"]
    print(
        f"one request, 1 image {args.size}x{args.size} ({tokens} tokens), max_tokens 1, median of {args.repeats}:"
    )
    print(f"  vLLM alone (its own tower)   {base:8.1f} ms  1.00x")
    print(f"  gateway -> vLLM              {ms['through']:8.1f} ms  {ms['through'] / base:.2f}x")
    print(f"    encode (receiver)          {ms['encode']:8.1f} ms  {ms['encode'] / base:.2f}x")
    print(f"    hand-off (serialize part)  {ms['handoff']:8.1f} ms  {ms['handoff'] / base:.2f}x")
    print(f"    vLLM on embeddings         {ms['engine']:8.1f} ms  {ms['engine'] / base:.2f}x")
    raw = args.serialize_tokens * args.serialize_hidden * 2
    print(
        f"serialization of one {args.serialize_tokens} x {args.serialize_hidden} bf16 item: {raw} tensor bytes -> "
        f"{size} bytes of base64(torch.save) ({size / raw:.2f}x), {serialize_ms:.1f} ms to serialize, "
        f"{load_ms:.1f} ms for vLLM to load"
    )
    return {
        "image": f"{args.size}x{args.size}",
        "tokens": tokens,
        "repeats": args.repeats,
        "median_ms": ms,
        "samples_s": samples,
        "serialization": {"tokens": args.serialize_tokens, "hidden": args.serialize_hidden, "tensor_bytes": raw,
                          "base64_bytes": size, "serialize_ms": serialize_ms, "load_ms": load_ms},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    load = MachineLoad()
    figures = asyncio.run(bench(args))
    if args.record:
        print(f"wrote {record_result('gateway_latency', figures, args.record, load=load)}")


if __name__ == "__main__":
    main()
