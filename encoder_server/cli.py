"""`encoder-server`: parses flags (each also read from an ENCODER_* environment variable), sets up
logging and malloc, then loads the model and serves."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import logging
import os
import sys

from encoder_common.env_flags import EnvDefaultsParser, add_config_flags, config_from_args

from .config import ServerConfig


def build_parser() -> argparse.ArgumentParser:
    """One flag per ServerConfig setting (defaults and help from its fields), and --log-level."""
    p = EnvDefaultsParser(prog="encoder-server", env_prefix="ENCODER_", description="Serve a VLM's vision tower over gRPC.")
    add_config_flags(p, ServerConfig)
    p.add_argument("--log-level", default="INFO", help="logging level")
    return p


def tune_malloc() -> None:
    """Keeps glibc from mmapping (and page-faulting) every fresh buffer of 32 MiB or more.

    Measured on a 2-core x86-64 VM: large gRPC payloads moved 1.3-3x faster with these thresholds.
    mallopt applies in-process, so no environment variable has to be set before the interpreter starts.
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

    from .server import serve

    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise SystemExit("encoder-server: --tls-cert-file and --tls-key-file go together")
    if args.tls_client_ca_file and not args.tls_cert_file:
        raise SystemExit("encoder-server: --tls-client-ca-file needs --tls-cert-file and --tls-key-file")
    config = config_from_args(ServerConfig, args)
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
