"""`encoder-server`: checks the server extra is installed, parses flags (each also read from an ENCODER_*
environment variable), sets up logging and malloc, then loads the model and serves."""

from __future__ import annotations

import argparse
import logging
import sys

from encoder_common import tracing
from encoder_common.env_flags import EnvDefaultsParser, add_config_flags, config_from_args
from encoder_common.extras import require_extra
from encoder_common.malloc import tune_server_malloc


def build_parser() -> argparse.ArgumentParser:
    """One flag per ServerConfig setting (defaults and help from its fields), --otlp-traces-endpoint and
    --log-level."""
    from .config import ServerConfig  # imports pillow: after main's check for the server extra

    p = EnvDefaultsParser(prog="encoder-server", env_prefix="ENCODER_", description="Serve a VLM's vision tower over gRPC.")
    add_config_flags(p, ServerConfig)
    tracing.add_flag(p)
    p.add_argument("--log-level", default="INFO", help="logging level")
    return p


def main(argv: list[str] | None = None) -> None:
    require_extra("server", "encoder-server")
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    tune_server_malloc()

    import asyncio

    from .config import ServerConfig
    from .server import serve

    try:
        config = config_from_args(ServerConfig, args)
    except ValueError as exc:  # settings that do not go together
        raise SystemExit(f"encoder-server: {exc}") from None
    if config.backend == "vllm":  # a missing or unsupported vLLM is one line, before anything loads
        from .models.vllm_backend import VllmBackendError, check_vllm

        try:
            check_vllm()
        except VllmBackendError as exc:
            raise SystemExit(f"encoder-server: {exc}") from None
    tracing.configure_from_args(args, "encoder-server")
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:
        pass
    finally:
        tracing.shutdown()  # the spans not exported yet


if __name__ == "__main__":
    main()
