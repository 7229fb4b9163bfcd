"""Where the gateway gets an image part's bytes: `data:` URIs, `file://` URLs under configured roots, and
http(s) URLs fetched with a size cap, a timeout, no redirects and (unless allowed) no internal addresses."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from encoder_common.data_uri import decode_data_uri
from encoder_common.env_flags import comma_separated, flag
from encoder_common.errors import InvalidItemError
from encoder_common.file_url import read_file_url
from encoder_common.http_fetch import fetch_http

from .protocol import ImagePart


def root_paths(text: str) -> tuple[Path, ...]:
    """--file-roots: comma-separated directories."""
    return tuple(Path(root) for root in comma_separated(text))


@dataclass(frozen=True, kw_only=True)
class SourcePolicy:
    file_roots: tuple[Path, ...] = field(  # none refuses file://
        default=(),
        metadata=flag(
            "directories file:// image URLs may read from, comma-separated (default: file:// refused)",
            type=root_paths,
            shown=lambda roots: ",".join(map(str, roots)),
        ),
    )
    allow_internal_urls: bool = field(
        default=False,
        metadata=flag("let http(s) image URLs reach loopback, private and link-local addresses (refused by default)"),
    )
    max_fetch_bytes: int = field(default=32 << 20, metadata=flag("largest image accepted from a URL or file"))
    fetch_timeout_s: float = field(
        default=10.0, metadata=flag("time limit of one http(s) image download, seconds", name="--fetch-timeout")
    )


def part_bytes(part: ImagePart, policy: SourcePolicy) -> bytes:
    """The encoded image bytes an image part names; InvalidItemError names the part on any refusal."""
    try:
        return _url_bytes(part.url, policy)
    except InvalidItemError as exc:
        raise InvalidItemError(f"{part.where}: {exc}") from None


def _url_bytes(url: str, policy: SourcePolicy) -> bytes:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = decode_data_uri(url)
        if len(data) > policy.max_fetch_bytes:
            raise InvalidItemError(
                f"data: URI is {len(data)} bytes, over the limit of {policy.max_fetch_bytes}"
            )
        return data
    if scheme == "file":
        if not policy.file_roots:
            raise InvalidItemError("file:// URLs are disabled on this gateway (no --file-roots)")
        return read_file_url(
            url, [root.resolve() for root in policy.file_roots], max_bytes=policy.max_fetch_bytes
        )
    if scheme in ("http", "https"):
        return fetch_http(
            url,
            max_bytes=policy.max_fetch_bytes,
            timeout_s=policy.fetch_timeout_s,
            follow_redirects=False,
            allow_internal=policy.allow_internal_urls,
            user_agent="encoder-gateway",
        )
    raise InvalidItemError(
        f"unsupported image URL scheme {scheme or '(none)'!r}; use data:, http(s):// or file://"
    )
