"""The one reader of image sources and its policy, used with the same flags by every command that reads
images: `data:` URIs, `file://` URLs under configured roots, and http(s) URLs fetched without reaching
internal addresses (aiohttp imported only then), each bounded in size."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from encoder_common.data_uri import decode_data_uri
from encoder_common.env_flags import comma_separated, flag
from encoder_common.errors import InvalidItemError
from encoder_common.file_url import read_file_url

if TYPE_CHECKING:
    from encoder_common.http_fetch import IPNetwork, Resolve

# --http-urls: off refuses http(s) URLs; public fetches them from public addresses only; any reaches
# internal addresses too (loopback, private, link-local, ...).
HTTP_URL_MODES = ("off", "public", "any")
# data: URIs up to this size are decoded on the event loop; larger ones, and every file, on a thread.
INLINE_DECODE_CHARS = 1 << 20


def root_paths(text: str) -> tuple[Path, ...]:
    """--file-roots: comma-separated directories."""
    return tuple(Path(root) for root in comma_separated(text))


def networks(text: str) -> tuple[IPNetwork, ...]:
    """--http-allow-networks: comma-separated addresses or CIDR networks."""
    try:
        return tuple(ipaddress.ip_network(part, strict=False) for part in comma_separated(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _joined(values) -> str:
    return ",".join(map(str, values))


@dataclass(frozen=True, kw_only=True)
class SourcePolicy:
    """Which image sources are read and how far; one set of flags on every command."""

    file_roots: tuple[Path, ...] = field(  # none refuses file://
        default=(),
        metadata=flag(
            "directories file:// image URLs may be read from, comma-separated (default: file:// refused)",
            type=root_paths,
            shown=_joined,
        ),
    )
    http_urls: str = field(
        default="off",
        metadata=flag(
            "which http(s):// image URLs are fetched: off; public (never connecting to a loopback, private, "
            "link-local or otherwise internal address); any (internal ones too)",
            choices=HTTP_URL_MODES,
        ),
    )
    http_allow_networks: tuple[IPNetwork, ...] = field(
        default=(),
        metadata=flag(
            "internal addresses or CIDR networks http(s) URLs may reach even so, comma-separated "
            "(e.g. an in-cluster image store)",
            type=networks,
            shown=_joined,
        ),
    )
    max_redirects: int = field(
        default=3,
        metadata=flag("redirects one http(s) fetch follows, each checked like the first URL (0: none)"),
    )
    max_fetch_bytes: int = field(
        default=32 << 20, metadata=flag("largest image read from an http(s) URL, a file or a data: URI")
    )
    fetch_timeout_s: float = field(
        default=10.0, metadata=flag("time limit of one http(s) fetch, redirects included, seconds")
    )
    # The host-name resolver of http(s) fetches (None: the system's); tests inject one.
    resolve: Resolve | None = field(default=None, compare=False, repr=False)


class SourceReader:
    """Reads the encoded image bytes a URL names, under one SourcePolicy. Errors are InvalidItemError
    naming the URL (never a resolved path) and why."""

    def __init__(self, policy: SourcePolicy, *, user_agent: str = "encoder-service"):
        self.policy = policy
        self.user_agent = user_agent
        self._roots = tuple(root.resolve() for root in policy.file_roots)

    async def read(self, url: str) -> bytes:
        """The bytes of a `data:`, `file://` or http(s) URL; files and large `data:` URIs on a thread."""
        scheme = _scheme(url)
        if scheme in ("http", "https"):
            return await self._fetch(url, scheme)
        if scheme == "file" or len(url) > INLINE_DECODE_CHARS:
            return await asyncio.to_thread(self.read_local, url)
        return self.read_local(url)

    def read_local(self, url: str) -> bytes:
        """The bytes of a `data:` or `file://` URL, read in the calling thread."""
        scheme, limit = _scheme(url), self.policy.max_fetch_bytes
        if scheme == "data":
            data = decode_data_uri(url)
            if len(data) > limit:
                raise InvalidItemError(f"data: URI is {len(data)} bytes, over the limit of {limit}")
            return data
        if scheme == "file":
            if not self._roots:
                raise InvalidItemError(
                    "file:// URLs are disabled here (no --file-roots); send the bytes instead"
                )
            return read_file_url(url, self._roots, max_bytes=limit)
        if scheme in ("http", "https"):
            raise InvalidItemError(f"{scheme}:// URLs are not read here; send the bytes or a file:// URL")
        raise InvalidItemError(
            f"unsupported URL scheme {scheme or '(none)'!r}; use data:, file:// or http(s)://"
        )

    async def _fetch(self, url: str, scheme: str) -> bytes:
        policy = self.policy
        if policy.http_urls == "off":
            raise InvalidItemError(
                f"{scheme}:// URLs are disabled here (--http-urls off); send the bytes instead"
            )
        try:
            from encoder_common import http_fetch
        except ModuleNotFoundError as exc:
            raise InvalidItemError(
                f"{scheme}:// URLs need {exc.name}: pip install 'encoder-service[server]' (or [gateway])"
            ) from None
        limits = http_fetch.FetchLimits(
            allow_internal=policy.http_urls == "any",
            allow_networks=policy.http_allow_networks,
            max_redirects=policy.max_redirects,
            max_bytes=policy.max_fetch_bytes,
            timeout_s=policy.fetch_timeout_s,
        )
        return await http_fetch.fetch_http(url, limits, resolve=policy.resolve, user_agent=self.user_agent)


def _scheme(url: str) -> str:
    return url.split(":", 1)[0].lower() if ":" in url else ""
