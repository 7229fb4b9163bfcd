"""`encoder-server`: parses flags (each also read from an ENCODER_* environment variable), sets up
logging and malloc, then loads the model and serves."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import logging
import os
import sys

ENV_PREFIX = "ENCODER_"


class _EnvDefaults(argparse.ArgumentParser):
    """An ArgumentParser whose options default to $ENCODER_<OPTION> when that is set."""

    def add_argument(self, *names, **kwargs):
        long_name = next((n for n in names if n.startswith("--")), None)
        if long_name and kwargs.get("action") not in ("help", "version"):
            env = ENV_PREFIX + long_name[2:].upper().replace("-", "_")
            if env in os.environ:
                raw = os.environ[env]
                kwargs["default"] = (raw.lower() in ("1", "true", "yes")) if kwargs.get("action") == "store_true" else raw
            kwargs["help"] = f"{kwargs.get('help', '')} [env {env}; default: %(default)s]"
        return super().add_argument(*names, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = _EnvDefaults(prog="encoder-server", description="Serve a VLM's vision tower over gRPC.")
    p.add_argument("--model", required="ENCODER_MODEL" not in os.environ, help="checkpoint directory (Hugging Face layout)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on ('::' for all IPv6)")
    p.add_argument("--port", type=int, default=50051, help="port to listen on (0: any free port)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="cuda when present, else cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="served dtype")
    p.add_argument("--max-batch-images", type=int, default=32, help="images per forward at most")
    p.add_argument("--max-batch-patches", type=int, default=65536, help="patches per forward at most")
    p.add_argument("--batch-wait-ms", type=float, default=0.0, help="wait this long for more work before a forward")
    p.add_argument("--max-queue-items", type=int, default=256, help="queued items beyond which calls get RESOURCE_EXHAUSTED")
    p.add_argument("--max-queue-patches", type=int, default=1 << 20, help="queued patches beyond which calls get RESOURCE_EXHAUSTED")
    p.add_argument("--preprocess-workers", type=int, default=4, help="threads decoding and preprocessing images")
    p.add_argument("--max-items-per-request", type=int, default=64, help="items one Encode call may carry")
    p.add_argument("--max-request-bytes", type=int, default=256 << 20, help="largest Encode request accepted")
    p.add_argument("--max-image-pixels", type=int, default=16384 * 16384, help="refuse larger images before decoding")
    p.add_argument("--cache-bytes", type=int, default=1 << 30, help="embedding cache size in bytes (0: no cache)")
    p.add_argument("--grace-seconds", type=float, default=30.0, help="drain time for running calls on SIGTERM")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up forward before SERVING")
    p.add_argument("--log-level", default="INFO", help="logging level")
    return p


def tune_malloc() -> None:
    """Keeps glibc from mmapping (and page-faulting) every fresh buffer of 32 MiB or more.

    FACTS.md: this gave 1.3-3x on large gRPC payloads. mallopt applies in-process, so no
    environment variable has to be set before the interpreter starts.
    """
    libc_name = ctypes.util.find_library("c")
    if not libc_name or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL(libc_name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 1 << 30)
        libc.mallopt(m_trim_threshold, 2 << 30)
    except (OSError, AttributeError):  # not glibc
        pass


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    tune_malloc()

    import asyncio

    import torch

    from protos.wire import DTYPE_NAMES

    from .batcher import BatchingConfig
    from .config import ServerConfig
    from .server import serve

    config = ServerConfig(
        model=args.model,
        host=args.host,
        port=int(args.port),
        device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
        dtype=DTYPE_NAMES[args.dtype],
        batching=BatchingConfig(
            max_batch_images=int(args.max_batch_images),
            max_batch_patches=int(args.max_batch_patches),
            max_wait_ms=float(args.batch_wait_ms),
            max_queue_items=int(args.max_queue_items),
            max_queue_patches=int(args.max_queue_patches),
        ),
        preprocess_workers=int(args.preprocess_workers),
        max_items_per_request=int(args.max_items_per_request),
        max_request_bytes=int(args.max_request_bytes),
        max_image_pixels=int(args.max_image_pixels),
        cache_bytes=int(args.cache_bytes),
        grace_seconds=float(args.grace_seconds),
        warmup=not args.no_warmup,
    )
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
