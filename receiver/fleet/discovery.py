"""Encoder discovery: fixed `grpc://host:port` URLs, and `dns:///name:port` names resolved to every
address behind them (A and AAAA: the pods of a headless Service), re-resolved periodically and
after an encoder fails; plus the pool that keeps one channel per discovered encoder."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from encoder_common.errors import UnavailableError

from ..config import DEFAULT_REFRESH_S
from ..metrics import ReceiverMetrics
from ..urls import grpc_target
from .channels import EncoderEndpoint

log = logging.getLogger(__name__)

DEFAULT_PORT = 50051  # encoder-server's default --port
DEFAULT_FAILURE_COOLDOWN_S = 15.0

# (host, port) -> every (address, port) behind it. Blocking; it runs on a worker thread.
Resolver = Callable[[str, int], Sequence[tuple[str, int]]]


def resolve_all(host: str, port: int) -> list[tuple[str, int]]:
    """Every IPv4 and IPv6 address of `host`, through the system resolver (getaddrinfo)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({(sockaddr[0], sockaddr[1]) for _family, _type, _proto, _name, sockaddr in infos})


@dataclass(frozen=True)
class DnsName:
    """A `dns:` encoder URL: a name whose addresses are the encoders."""

    url: str
    host: str
    port: int


def parse_encoder_url(url: str) -> DnsName | str:
    """A `dns:///host[:port]` (or `dns:host[:port]`) URL as a DnsName; any other URL checked and returned.

    The port defaults to 50051. `dns://server/...` (a DNS server of one's own) is refused: the
    system resolver answers here, as it does for a pod.
    """
    if not url.startswith("dns:"):
        grpc_target(url)  # raises ValueError on an unsupported scheme
        return url
    rest = url[len("dns:") :]
    if rest.startswith("//"):
        authority, slash, rest = rest[2:].partition("/")
        if authority or not slash:
            raise ValueError(f"{url!r}: a DNS server in the URL is not supported; use dns:///name:port")
    host, port = _split_host_port(rest, url)
    if not host:
        raise ValueError(f"{url!r} names no host; use dns:///name:port")
    return DnsName(url, host, port)


def _split_host_port(hostport: str, url: str) -> tuple[str, int]:
    if hostport.startswith("["):
        host, bracket, tail = hostport[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise ValueError(f"{url!r}: malformed [IPv6] address")
        port_text = tail[1:]
    elif hostport.count(":") == 1:
        host, _, port_text = hostport.partition(":")
    else:
        host, port_text = hostport, ""
    try:
        port = int(port_text) if port_text else DEFAULT_PORT
    except ValueError:
        raise ValueError(f"{url!r}: port {port_text!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"{url!r}: port {port} is out of range")
    return host, port


def address_url(address: str, port: int) -> str:
    """`grpc://` URL of one resolved address; IPv6 in brackets."""
    try:
        is_v6 = ipaddress.ip_address(address.split("%", 1)[0]).version == 6
    except ValueError:
        is_v6 = False
    return f"grpc://[{address}]:{port}" if is_v6 else f"grpc://{address}:{port}"


class EncoderDiscovery:
    """The current encoder URLs: the fixed ones as given, then every address of each DNS name.

    `urls()` re-resolves the names when the last resolution is older than `refresh_s`, or after
    `report_failure`; concurrent callers share one resolution. An address whose encoder was
    reported unavailable is left out for `failure_cooldown_s` (DNS can list a gone pod for a
    while), unless that would leave no encoder at all. A name that fails to resolve keeps its
    previous addresses; a name that never resolved contributes none.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        resolver: Resolver = resolve_all,
        refresh_s: float = DEFAULT_REFRESH_S,
        failure_cooldown_s: float = DEFAULT_FAILURE_COOLDOWN_S,
        clock: Callable[[], float] = time.monotonic,
        metrics: ReceiverMetrics | None = None,
    ):
        if not urls:
            raise ValueError("no encoder URLs given")
        parsed = [parse_encoder_url(url) for url in urls]
        self.fixed = [p for p in parsed if isinstance(p, str)]
        self.names = [p for p in parsed if isinstance(p, DnsName)]
        self.resolver = resolver
        self.refresh_s = refresh_s
        self.failure_cooldown_s = failure_cooldown_s
        self.clock = clock
        self.metrics = metrics
        self._addresses: dict[DnsName, list[str]] = {name: [] for name in self.names}
        self._resolved_at: float | None = None
        self._cooling: dict[str, float] = {}  # discovered URL -> until when it is left out
        self._lock = asyncio.Lock()

    @property
    def static(self) -> bool:
        """True when there is nothing to resolve."""
        return not self.names

    def known(self) -> set[str]:
        """Every URL fixed or last resolved, cooling down or not."""
        return set(self.fixed).union(*self._addresses.values())

    def current(self) -> list[str]:
        """The URLs as last resolved, without resolving; fixed URLs first, then sorted addresses."""
        now = self.clock()
        discovered = sorted({url for urls in self._addresses.values() for url in urls})
        usable = [url for url in discovered if self._cooling.get(url, 0.0) <= now]
        urls = list(dict.fromkeys(self.fixed + (usable if usable or self.fixed else discovered)))
        return urls

    async def urls(self) -> list[str]:
        """The encoder URLs to shard onto now, re-resolving first if due; never empty."""
        if self.names and self._due():
            async with self._lock:
                if self._due():
                    await self._resolve()
        urls = self.current()
        if not urls:
            self._resolved_at = None  # try again on the next call, not after refresh_s
            names = ", ".join(name.url for name in self.names)
            raise UnavailableError(f"no encoder addresses: {names} resolved to none")
        return urls

    def report_failure(self, url: str) -> None:
        """An encoder was unreachable: re-resolve before the next call and leave it out for a while."""
        self._resolved_at = None
        if any(url in urls for urls in self._addresses.values()):
            self._cooling[url] = self.clock() + self.failure_cooldown_s

    def _due(self) -> bool:
        return self._resolved_at is None or self.clock() - self._resolved_at >= self.refresh_s

    async def _resolve(self) -> None:
        results = await asyncio.gather(
            *(asyncio.to_thread(self.resolver, name.host, name.port) for name in self.names), return_exceptions=True
        )
        for name, result in zip(self.names, results):
            if isinstance(result, BaseException) and not isinstance(result, OSError):
                raise result  # a broken resolver, not a DNS answer
            if isinstance(result, OSError) or not result:
                problem = result if isinstance(result, OSError) else "no addresses"
                log.warning(
                    "cannot resolve %s (%s); keeping its %d previous addresses", name.url, problem, len(self._addresses[name])
                )
                if self.metrics is not None:
                    self.metrics.resolved(ok=False)
                continue
            addresses = sorted({address_url(address, port) for address, port in result})
            if addresses != self._addresses[name]:
                log.info("%s resolves to %d encoders: %s", name.url, len(addresses), " ".join(addresses))
            self._addresses[name] = addresses
            if self.metrics is not None:
                self.metrics.resolved(ok=True)
        self._resolved_at = self.clock()
        now = self._resolved_at
        self._cooling = {url: until for url, until in self._cooling.items() if until > now}


class EndpointPool:
    """One channel per encoder URL that discovery returns: opened on first use, closed once gone.

    A gone encoder's channel is closed with a grace period, so calls still streaming from a
    draining pod finish instead of being cut.
    """

    def __init__(
        self,
        discovery: EncoderDiscovery,
        close_grace_s: float,
        connect: Callable[[str], EncoderEndpoint] = EncoderEndpoint.connect,
    ):
        self.discovery = discovery
        self.close_grace_s = close_grace_s
        self._connect = connect
        self._endpoints: dict[str, EncoderEndpoint] = {}
        self._current: list[EncoderEndpoint] = []
        self._closing: dict[asyncio.Task, EncoderEndpoint] = {}
        if discovery.static:
            self._update(discovery.current())

    @property
    def current(self) -> list[EncoderEndpoint]:
        """The endpoints of the latest `endpoints()` call."""
        return self._current

    async def endpoints(self) -> list[EncoderEndpoint]:
        """The endpoints to shard the next call onto, in discovery's order (a list of its own)."""
        self._update(await self.discovery.urls())
        return self._current

    def _update(self, urls: list[str]) -> None:
        if [e.url for e in self._current] == urls:
            return
        for url in urls:
            if url not in self._endpoints:
                self._endpoints[url] = self._connect(url)
        # Cooling-down addresses keep their channel: they come back after the cooldown.
        known = self.discovery.known()
        for url in [url for url in self._endpoints if url not in known]:
            endpoint = self._endpoints.pop(url)
            task = asyncio.get_running_loop().create_task(endpoint.channel.close(self.close_grace_s))
            self._closing[task] = endpoint
            task.add_done_callback(self._closing.pop)
        self._current = [self._endpoints[url] for url in urls]

    async def close(self) -> None:
        """Closes every channel, each once the ends of its finished calls are read (`EncoderEndpoint.close`),
        cutting calls still running on gone encoders."""
        closing = list(self._closing.values())
        for task in list(self._closing):
            task.cancel()
        await asyncio.gather(*(e.close() for e in [*closing, *self._endpoints.values()]), return_exceptions=True)
        self._endpoints.clear()
        self._current = []
