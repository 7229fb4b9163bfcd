"""`encoder-client`: encodes image files on encoder servers through the receiver and prints each
item's shape, encoder and timings; optionally saves the embeddings to a safetensors file."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from pathlib import Path

from encoder_common import tracing
from encoder_common.env_flags import EnvDefaultsParser, add_config_flags, config_from_args
from encoder_common.malloc import tune_malloc

from .config import ReceiverConfig, add_credential_flags, credentials_from_args

ENV_PREFIX = "ENCODER_CLIENT_"


def build_parser() -> EnvDefaultsParser:
    """The images and what to do with them, then one flag per ReceiverConfig setting, the credential
    files and --otlp-traces-endpoint."""
    p = EnvDefaultsParser(
        prog="encoder-client",
        env_prefix=ENV_PREFIX,
        description="Encode image files on encoder servers and print what came back.",
    )
    p.add_argument("images", nargs="+", metavar="IMAGE", help="image files (PNG, JPEG, WebP, ...)")
    p.add_argument(
        "--url",
        default="grpc://localhost:50051",
        help="encoder URLs, comma-separated: grpc://host:port, or dns:///name:port for every address behind a name",
    )
    p.add_argument("--request-id", default=None, help="request id sent to the encoders (a random one if unset)")
    p.add_argument("--save", default=None, help="write the embeddings to this .safetensors file")
    p.add_argument("--info", action="store_true", help="print each encoder's GetModelInfo first")
    p.add_argument("--log-level", default="WARNING", help="logging level")
    add_config_flags(p, ReceiverConfig)
    add_credential_flags(p)
    tracing.add_flag(p)
    return p


async def run(args) -> int:
    from protos import encoder_pb2 as pb
    from receiver import EncoderError, EncoderReceiver

    urls = [url.strip() for url in args.url.split(",") if url.strip()]
    request_id = args.request_id or f"cli-{uuid.uuid4().hex[:12]}"
    paths = [Path(image) for image in args.images]
    items = [{"modality": "image", "url": path.resolve().as_uri()} for path in paths]
    config = config_from_args(ReceiverConfig, args, **credentials_from_args(args))
    async with EncoderReceiver(urls, config) as rx:
        try:
            if args.info:
                for url, info in (await rx.model_info()).items():
                    print(
                        f"encoder {url}: {info.family} ({info.model_type}), hidden {info.hidden_size}, "
                        f"{pb.DType.Name(info.dtype).lower()} on {info.device}, server {info.server_version}"
                        + (", RANDOM WEIGHTS" if info.random_weights else "")
                    )
            started = time.perf_counter()
            result = await rx.encode(request_id, items)
            elapsed_ms = (time.perf_counter() - started) * 1000
        except EncoderError as exc:
            print(f"encoder-client: {exc}", file=sys.stderr)
            return 1
    for path, item in zip(paths, result.items):
        print(
            f"item {item.index} {path.name}: {item.num_tokens} x {item.hidden_size} "
            f"{str(item.embedding.dtype).removeprefix('torch.')}, grid_thw {list(item.grid_thw)}"
            + (f", deepstack {item.deepstack.shape[0]} layers" if item.deepstack is not None else "")
            + f", encoder {item.encoder_url}, queue {item.queue_ms:.1f} ms, preprocess {item.preprocess_ms:.1f} ms, "
            f"forward {item.forward_ms:.1f} ms, received at {item.stream_ms:.1f} ms" + (", cache hit" if item.cache_hit else "")
        )
    encoders = len({item.encoder_url for item in result.items})
    print(f"request {request_id}: {len(result.items)} items, {result.num_tokens} tokens in {elapsed_ms:.1f} ms on {encoders} encoders")
    if args.save:
        save(args.save, request_id, paths, result)
        print(f"saved to {args.save}")
    return 0


def save(path: str, request_id: str, paths: list[Path], result) -> None:
    """One tensor per item (`item.<i>.embedding`, `item.<i>.deepstack`), item details in the metadata."""
    from safetensors.torch import save_file

    tensors = {}
    for item in result.items:
        tensors[f"item.{item.index}.embedding"] = item.embedding.clone()  # clone: a view of a shared buffer
        if item.deepstack is not None:
            tensors[f"item.{item.index}.deepstack"] = item.deepstack.clone()
    details = [
        {"index": item.index, "file": str(p), "grid_thw": list(item.grid_thw), "encoder": item.encoder_url}
        for p, item in zip(paths, result.items)
    ]
    save_file(tensors, path, metadata={"request_id": request_id, "items": json.dumps(details)})


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    tune_malloc()  # embeddings of a megabyte and more arrive here: see encoder_common.malloc
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tracing.configure_from_args(args, "encoder-client")
    try:
        sys.exit(asyncio.run(run(args)))
    except (ValueError, OSError) as exc:  # a bad URL or an unreadable file: no traceback
        print(f"encoder-client: {exc}", file=sys.stderr)
        sys.exit(2)
    finally:
        tracing.shutdown()  # the spans not exported yet


if __name__ == "__main__":
    main()
