"""`encoder-precompute`'s command: flags, the backend chosen, the run, its summary and exit code."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import replace

from encoder_common.env_flags import EnvDefaultsParser, add_config_flags, config_from_args
from encoder_common.errors import EncoderError
from protos import wire
from receiver.config import ReceiverConfig, add_credential_flags, credentials_from_args

from .backends import InProcessBackend, ServerBackend
from .run import PrecomputeSettings, Summary, collect_images, precompute


def build_parser() -> argparse.ArgumentParser:
    p = EnvDefaultsParser(
        prog="encoder-precompute",
        env_prefix="ENCODER_PRECOMPUTE_",
        description="Encode images offline into <sha256>.safetensors files that EncoderReceiver accepts "
        "as precomputed items.",
        fromfile_prefix_chars="@",
    )
    p.add_argument(
        "paths", nargs="+", help="image files and folders (searched recursively); @FILE reads paths from FILE"
    )
    add_config_flags(p, PrecomputeSettings)
    add_credential_flags(p)
    return p


def settings_from_args(args: argparse.Namespace) -> PrecomputeSettings:
    """The PrecomputeSettings the parsed flags describe, with the receiver's TLS and token files read."""
    receiver = config_from_args(ReceiverConfig, args, **credentials_from_args(args))
    return config_from_args(PrecomputeSettings, args, receiver=receiver)


async def _run(paths: Sequence[str], settings: PrecomputeSettings) -> Summary:
    files = collect_images(paths)
    if settings.model:
        backend: ServerBackend | InProcessBackend = await asyncio.to_thread(
            InProcessBackend, settings.model, settings.device, wire.DTYPE_NAMES[settings.dtype]
        )
        settings = replace(settings, concurrency=1)  # one forward at a time
    else:
        urls = [url.strip() for url in settings.encoder_url.split(",") if url.strip()]
        backend = ServerBackend(urls, settings.receiver)
    try:
        return await precompute(backend, files, settings)
    finally:
        await backend.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.encoder_url is None) == (args.model is None):
        parser.error("give exactly one of --encoder-url and --model")
    try:
        settings = settings_from_args(args)
    except (OSError, ValueError) as exc:  # a credential file missing or empty, a half TLS pair
        parser.error(str(exc))
    try:
        summary = asyncio.run(_run(args.paths, settings))
    except (EncoderError, FileNotFoundError) as exc:
        print(f"encoder-precompute: error: {exc}", file=sys.stderr)
        return 2
    for path, reason in summary.failed.items():
        print(f"failed: {path}: {reason}", file=sys.stderr)
    print(summary.line(args.out))
    return 1 if summary.failed else 0

