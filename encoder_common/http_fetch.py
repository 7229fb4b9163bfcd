"""Downloads an image named by an http(s):// URL on a caller's behalf, never connecting to an internal
address unless allowed: the name resolved and every address checked first, at each redirect too; bounded
in size and time."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from encoder_common.errors import InvalidItemError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# (host name, port) -> the addresses it resolves to, as text; the system's resolver by default.
Resolve = Callable[[str, int], Awaitable[Sequence[str]]]

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # IPv4 addresses reached through a NAT64 gateway
_UNIQUE_LOCAL = ipaddress.ip_network("fc00::/7")


def internal_kind(address: IPAddress) -> str | None:
    """What makes `address` internal (e.g. "loopback"), or None for a public address.

    IPv6 forms that carry an IPv4 address (mapped, 6to4, NAT64) are judged by that IPv4 address.
    """
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            kind = internal_kind(embedded)
            return None if kind is None else f"{kind} (inside the IPv6 address {address})"
    checks = (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("unique-local", isinstance(address, ipaddress.IPv6Address) and address in _UNIQUE_LOCAL),
        ("reserved", address.is_reserved),
        ("private", address.is_private),
        ("non-global", not address.is_global),  # shared (carrier NAT), documentation, benchmarking ranges
    )
    return next((kind for kind, hit in checks if hit), None)


@dataclass(frozen=True, kw_only=True)
class FetchLimits:
    """Where and how far a fetch may go."""

    allow_internal: bool = False  # any address at all
    allow_networks: tuple[IPNetwork, ...] = ()  # internal networks reachable even so
    max_redirects: int = 3
    max_bytes: int = 32 << 20
    timeout_s: float = 10.0


async def system_resolve(host: str, port: int) -> list[str]:
    """The addresses the system's resolver gives for `host`."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


class _PinnedResolver(AbstractResolver):
    """aiohttp's resolver during one fetch: answers only with the addresses already checked for a name."""

    def __init__(self) -> None:
        self.pinned: dict[str, list[str]] = {}

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        addresses = self.pinned.get(host)
        if not addresses:  # never reached: every hop's name is pinned before its request
            raise OSError(f"{host} was not checked before connecting")
        return [
            ResolveResult(
                hostname=host,
                host=address,
                port=port,
                family=socket.AF_INET6 if ":" in address else socket.AF_INET,
                proto=socket.IPPROTO_TCP,
                flags=socket.AI_NUMERICHOST,
            )
            for address in addresses
        ]

    async def close(self) -> None:
        pass


class _Refused(Exception):
    """A fetch refused on our side; its text is the reason."""


async def fetch_http(
    url: str,
    limits: FetchLimits,
    *,
    resolve: Resolve | None = None,
    ssl_context: ssl.SSLContext | None = None,
    user_agent: str = "encoder-service",
) -> bytes:
    """The body of `url`, or InvalidItemError naming the URL and why it was refused or failed.

    `resolve` replaces the system's resolver (tests); `ssl_context` the default certificate checks.
    """
    shown = _shown(url)
    try:
        async with asyncio.timeout(limits.timeout_s):
            return await _fetch(url, limits, resolve or system_resolve, ssl_context, user_agent)
    except _Refused as exc:
        raise InvalidItemError(f"fetching {shown} refused: {exc}") from None
    except TimeoutError:
        raise InvalidItemError(f"fetching {shown} took over {limits.timeout_s:g} s") from None
    except aiohttp.ClientSSLError as exc:
        raise InvalidItemError(f"fetching {shown} failed: TLS: {_reason(exc)}") from None
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        raise InvalidItemError(f"fetching {shown} failed: {_reason(exc)}") from None


async def _fetch(
    url: str, limits: FetchLimits, resolve: Resolve, ssl_context: ssl.SSLContext | None, user_agent: str
) -> bytes:
    resolver = _PinnedResolver()
    # No proxy from the environment (trust_env off), no DNS cache: the resolver above is asked each time.
    connector = aiohttp.TCPConnector(resolver=resolver, use_dns_cache=False, ssl=ssl_context or True)
    async with aiohttp.ClientSession(connector=connector, headers={"User-Agent": user_agent}) as session:
        target = URL(url)
        hops = 0
        while True:
            await _check_target(target, limits, resolve, resolver)
            async with session.get(target, allow_redirects=False) as response:
                if response.status not in _REDIRECTS:
                    if response.status != 200:
                        raise InvalidItemError(f"fetching {_shown(url)} failed: HTTP {response.status}")
                    return await _body(response, limits.max_bytes)
                location = response.headers.get("Location")
                if hops == limits.max_redirects or not location:
                    why = f"more redirects than --max-redirects {limits.max_redirects}"
                    raise _Refused(f"HTTP {response.status} with {why if location else 'no Location'}")
                target = target.join(URL(location))
                hops += 1


async def _check_target(
    target: URL, limits: FetchLimits, resolve: Resolve, resolver: _PinnedResolver
) -> None:
    """Refuses a URL whose scheme is not http(s) or whose host has no address the limits allow; pins the
    allowed addresses of a host name for the connection that follows."""
    if target.scheme not in ("http", "https"):
        raise _Refused(f"redirected to a {target.scheme or '(no scheme)'}: URL; only http(s) is followed")
    host, port = target.raw_host, target.port
    if not host or port is None:
        raise _Refused("the URL names no host")
    try:
        literal: IPAddress | None = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:  # aiohttp connects to an address given in the URL without resolving it
        _check_address(host, literal, limits)
        return
    try:
        addresses = [ipaddress.ip_address(a.split("%", 1)[0]) for a in await resolve(host, port)]
    except OSError as exc:
        raise _Refused(f"{host} does not resolve: {_reason(exc)}") from None
    if not addresses:
        raise _Refused(f"{host} does not resolve")
    for address in addresses:
        _check_address(host, address, limits)
    resolver.pinned[host] = [str(address) for address in addresses]


def _check_address(host: str, address: IPAddress, limits: FetchLimits) -> None:
    if limits.allow_internal or any(address in network for network in limits.allow_networks):
        return
    kind = internal_kind(address)
    if kind is not None:
        named = host if host == str(address) else f"{host} resolves to {address}, which"
        article = "an" if kind.startswith("unspecified") else "a"
        raise _Refused(
            f"{named} is {article} {kind} address; internal addresses are reached only with --http-urls any "
            "or --http-allow-networks"
        )


async def _body(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    length = response.content_length
    if length is not None and length > max_bytes:
        raise _Refused(f"its body is {length} bytes, over the limit of {max_bytes}")
    parts, received = [], 0
    async for part in response.content.iter_chunked(1 << 16):
        received += len(part)
        if received > max_bytes:
            raise _Refused(f"its body is over the limit of {max_bytes} bytes")
        parts.append(part)
    return b"".join(parts)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError) and exc.os_error is not None:
        return exc.os_error.strerror or exc.os_error.__class__.__name__
    return str(exc) or exc.__class__.__name__


def _shown(url: str) -> str:
    return url if len(url) <= 200 else url[:200] + "..."
