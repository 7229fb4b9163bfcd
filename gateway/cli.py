"""`encoder-gateway`: the OpenAI-compatible front of a vLLM server that encodes images on the encoder pods.
Every flag also reads $ENCODER_GATEWAY_<FLAG>."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

from encoder_common.env_flags import EnvDefaultsParser

ENV_PREFIX = "ENCODER_GATEWAY_"


def build_parser() -> EnvDefaultsParser:
    p = EnvDefaultsParser(
        prog="encoder-gateway",
        env_prefix=ENV_PREFIX,
        description="OpenAI-compatible chat-completions front for vLLM: images are encoded on encoder servers "
        "and handed to the engine as embeddings (start vLLM with --enable-mm-embeds).",
    )
    p.add_argument("--engine-url", required=True, help="the vLLM OpenAI server, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--encoders",
        required=True,
        help="encoder URLs, comma-separated: grpc://host:port, grpcs://host:port, or dns:///name:port",
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=9000, help="port to listen on (0: any free port)")
    p.add_argument(
        "--encode-timeout", type=float, default=60.0, help="deadline of one request's encode, seconds"
    )
    p.add_argument(
        "--engine-timeout",
        type=float,
        default=None,
        help="deadline of one engine call, seconds (default: none)",
    )
    p.add_argument(
        "--file-roots",
        default="",
        help="directories file:// image URLs may read from, comma-separated (default: file:// refused)",
    )
    p.add_argument(
        "--allow-internal-urls",
        action="store_true",
        help="let http(s) image URLs reach loopback, private and link-local addresses (refused by default)",
    )
    p.add_argument(
        "--max-fetch-bytes", type=int, default=32 << 20, help="largest image accepted from a URL or file"
    )
    p.add_argument(
        "--fetch-timeout", type=float, default=10.0, help="time limit of one http(s) image download, seconds"
    )
    p.add_argument(
        "--pass-non-image",
        action="store_true",
        help="forward video/audio parts to the engine untouched instead of answering 400",
    )
    p.add_argument(
        "--retry-after", type=int, default=1, help="Retry-After seconds of a 503 for overloaded encoders"
    )
    p.add_argument(
        "--transfer",
        default="auto",
        choices=["auto", "shm", "grpc"],
        help="how embeddings come back from encoders",
    )
    p.add_argument(
        "--tls-ca-file", default=None, help="PEM CAs to trust for grpcs:// encoders (default: the system's)"
    )
    p.add_argument("--tls-cert-file", default=None, help="PEM client certificate for mTLS to the encoders")
    p.add_argument("--tls-key-file", default=None, help="PEM private key of --tls-cert-file")
    p.add_argument(
        "--auth-token-file",
        default=None,
        help="file whose first line is the bearer token sent to the encoders",
    )
    p.add_argument("--log-level", default="INFO", help="logging level")
    return p


def config_from_args(args):
    from receiver import ClientTls

    from .config import GatewayConfig
    from .sources import SourcePolicy

    tls = None
    if args.tls_ca_file or args.tls_cert_file or args.tls_key_file:
        tls = ClientTls.from_files(
            ca_file=args.tls_ca_file, cert_file=args.tls_cert_file, key_file=args.tls_key_file
        )
    auth_token = None
    if args.auth_token_file:
        lines = Path(args.auth_token_file).read_text().splitlines()
        auth_token = lines[0].strip() if lines else ""
        if not auth_token:
            raise ValueError(f"{args.auth_token_file} holds no token")
    return GatewayConfig(
        engine_url=args.engine_url,
        encoders=tuple(url.strip() for url in args.encoders.split(",") if url.strip()),
        host=args.host,
        port=args.port,
        encode_timeout_s=args.encode_timeout,
        engine_timeout_s=args.engine_timeout,
        sources=SourcePolicy(
            file_roots=tuple(Path(root) for root in args.file_roots.split(",") if root.strip()),
            allow_internal_urls=args.allow_internal_urls,
            max_fetch_bytes=args.max_fetch_bytes,
            fetch_timeout_s=args.fetch_timeout,
        ),
        pass_non_image=args.pass_non_image,
        retry_after_s=args.retry_after,
        tls=tls,
        auth_token=auth_token,
        transfer=args.transfer,
    )


async def serve(config) -> None:
    from .app import start

    runner, port = await start(config)
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
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(serve(config_from_args(args)))
    except (ValueError, OSError) as exc:  # a family vLLM cannot take, an unreadable TLS file, a busy port
        print(f"encoder-gateway: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
