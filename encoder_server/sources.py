"""Where an item's image bytes come from on the server: inline data and data: URIs always; file:// and
http(s):// URLs only where the operator enables them, bounded in size and time.

Fetching URLs on behalf of callers is server-side request forgery waiting to happen, so both are
off by default, and even where http(s) is enabled, connections to loopback, private, link-local or
otherwise internal addresses are refused unless allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from protos import encoder_pb2 as pb
from encoder_common.data_uri import decode_data_uri
from encoder_common.env_flags import flag
from encoder_common.errors import InvalidItemError
from encoder_common.file_url import read_file_url
from encoder_common.http_fetch import fetch_http


@dataclass(frozen=True, kw_only=True)
class SourcePolicy:
    file_root: str | None = field(  # None refuses file:// URLs
        default=None,
        metadata=flag("directory file:// item URLs may read from (default: file:// refused)", name="--allow-file-root"),
    )
    allow_http: bool = field(
        default=False, metadata=flag("fetch http(s):// item URLs (off: server-side request forgery)")
    )
    allow_private_hosts: bool = field(
        default=False, metadata=flag("let http(s) item URLs reach loopback, private and link-local addresses")
    )
    max_fetch_bytes: int = field(default=32 << 20, metadata=flag("largest file:// or http(s) item accepted"))
    fetch_timeout_s: float = field(default=10.0, metadata=flag("time limit of one http(s) item download"))


def item_bytes(item: pb.ImageItem, policy: SourcePolicy) -> bytes:
    """The encoded image bytes of `item` (its content_sha256, if any, is the caller's to check)."""
    source = item.WhichOneof("source")
    if source == "data":
        data = item.data
    elif source == "url":
        data = _url_bytes(item.url, policy)
    else:
        raise InvalidItemError("item has neither data nor url")
    return data


def _url_bytes(url: str, policy: SourcePolicy) -> bytes:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_data_uri(url)
    if scheme == "file":
        if policy.file_root is None:
            raise InvalidItemError("file:// URLs are disabled on this server; send the bytes instead")
        return read_file_url(url, [Path(policy.file_root).resolve()], max_bytes=policy.max_fetch_bytes)
    if scheme in ("http", "https"):
        if not policy.allow_http:
            raise InvalidItemError(f"{scheme}:// URLs are disabled on this server; send the bytes instead")
        return fetch_http(
            url,
            max_bytes=policy.max_fetch_bytes,
            timeout_s=policy.fetch_timeout_s,
            allow_internal=policy.allow_private_hosts,
            user_agent="encoder-server",
        )
    raise InvalidItemError(f"unsupported URL scheme {scheme or '(none)'!r}")

