"""`encoder-gateway`: the OpenAI-compatible front of a vLLM server that encodes images on the encoder pods.
Every flag also reads $ENCODER_GATEWAY_<FLAG>."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from encoder_common import env_flags, tracing
from encoder_common.collector import freeze_startup_objects
from encoder_common.env_flags import EnvDefaultsParser, add_config_flags
from encoder_common.extras import require_extra
from encoder_common.malloc import tune_malloc
from receiver.config import ReceiverConfig, add_credential_flags, credentials_from_args

from .config import GatewayConfig

ENV_PREFIX = "ENCODER_GATEWAY_"


def build_parser() -> EnvDefaultsParser:
    """One flag per GatewayConfig setting (defaults and help from its fields), then the files the TLS
    credentials and the token are read from, --otlp-traces-endpoint and --log-level."""
    p = EnvDefaultsParser(
        prog="encoder-gateway",
        env_prefix=ENV_PREFIX,
        description="OpenAI-compatible chat-completions front for vLLM: images are encoded on encoder servers "
        "and handed to the engine as embeddings (start vLLM with --enable-mm-embeds).",
    )
    add_config_flags(p, GatewayConfig)
    add_credential_flags(p)
    tracing.add_flag(p)
    p.add_argument("--log-level", default="INFO", help="logging level")
    return p


def config_from_args(args) -> GatewayConfig:
    """The GatewayConfig the parsed flags describe, with the TLS and token files read."""
    receiver = env_flags.config_from_args(ReceiverConfig, args, **credentials_from_args(args))
    return env_flags.config_from_args(GatewayConfig, args, receiver=receiver)


async def serve(config) -> None:
    from .app import start

    runner, port = await start(config)
    freeze_startup_objects()  # see encoder_common.collector
    print(f"encoder-gateway ready on {config.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    require_extra("gateway", "encoder-gateway")
    args = build_parser().parse_args(argv)
    tune_malloc()  # embeddings of a megabyte and more arrive here: see encoder_common.malloc
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    tracing.configure_from_args(args, "encoder-gateway")
    try:
        asyncio.run(serve(config_from_args(args)))
    except (ValueError, OSError) as exc:  # a family vLLM cannot take, an unreadable TLS file, a busy port
        print(f"encoder-gateway: {exc}", file=sys.stderr)
        sys.exit(2)
    finally:
        tracing.shutdown()  # the spans not exported yet


if __name__ == "__main__":
    main()
