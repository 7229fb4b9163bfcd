"""Image URLs into the cluster: the gateway and the encoder server (with its SGLang service's reader)
refuse them without ever connecting, counted by listeners on loopback; redirects are checked hop by hop;
allowed fetches still work, TLS checked against the host name although the connection is pinned."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import ssl
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest
from aiohttp import web

from encoder_common.errors import InvalidItemError
from encoder_common.http_fetch import FetchLimits, fetch_http, internal_kind, system_resolve
from encoder_common.sources import SourcePolicy, SourceReader
from protos import encoder_pb2 as pb
from testkit.images import image_bytes
from testkit.servers import running_server
from tests.encoder_server.test_hostile_inputs import call_encode, item
from tests.encoder_server.test_security import pki  # noqa: F401  (fixture)
from tests.gateway.test_gateway import gateway, post
from tests.support.gateway import chat_request

PUBLIC_NAME = "images.example.com"  # resolves, in these tests, to the allowed redirecting site
INTERNAL_NAME = "intranet.example.com"  # resolves, in these tests, to 127.0.0.1
SITE_ADDRESS = "127.0.0.2"  # the one internal address the policy allows: the test's own web site
PNG = image_bytes(56, 56, seed=3)


class Listener:
    """TCP listeners on 127.0.0.1 (plain and TLS) and ::1 that count every connection they accept."""

    def __init__(self) -> None:
        self.accepted = 0
        self.servers: list[asyncio.Server] = []
        self.ports: dict[str, int] = {}

    def _protocol(self) -> asyncio.Protocol:
        self.accepted += 1  # called at accept, before any TLS handshake
        return asyncio.Protocol()

    async def start(self, tls: ssl.SSLContext) -> None:
        loop = asyncio.get_running_loop()
        listening = (("v4", "127.0.0.1", None), ("tls", "127.0.0.1", tls), ("v6", "::1", None))
        for name, host, context in listening:
            server = await loop.create_server(self._protocol, host, 0, ssl=context)
            self.servers.append(server)
            self.ports[name] = server.sockets[0].getsockname()[1]

    async def settle(self) -> int:
        """The count once any connection made so far has been accepted."""
        await asyncio.sleep(0.2)
        return self.accepted

    def close(self) -> None:
        for server in self.servers:
            server.close()


def server_tls(pki) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki.server.cert_file, pki.server.key_file)
    return context


@contextlib.asynccontextmanager
async def site(
    host: str, redirects: dict[str, str], *, tls: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[int, list[str]]]:
    """A web site serving /image.png and the given redirects; yields its port and the paths asked for."""
    asked: list[str] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        asked.append(request.path)
        if request.path == "/image.png":
            return web.Response(body=PNG, content_type="image/png")
        if request.path in redirects:
            raise web.HTTPFound(redirects[request.path])
        raise web.HTTPNotFound()

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, 0, ssl_context=tls).start()
    try:
        yield runner.addresses[0][1], asked
    finally:
        await runner.cleanup()


def resolver(names: dict[str, list[str]], calls: list[str] | None = None):
    """A resolver answering `names` itself and asking the system for the rest."""

    async def resolve(host: str, port: int) -> Sequence[str]:
        if calls is not None:
            calls.append(host)
        return names[host] if host in names else await system_resolve(host, port)

    return resolve


POLICY = SourcePolicy(
    http_urls="public",
    http_allow_networks=(ipaddress.ip_network(f"{SITE_ADDRESS}/32"),),
    fetch_timeout_s=5.0,
    resolve=resolver({PUBLIC_NAME: [SITE_ADDRESS], INTERNAL_NAME: ["127.0.0.1"]}),
)


def internal_urls(ports: dict[str, int], site_port: int) -> list[tuple[str, str]]:
    """(URL, what the refusal must say) for every way into the listener this test knows."""
    v4, tls, v6 = ports["v4"], ports["tls"], ports["v6"]
    redirected = f"http://{PUBLIC_NAME}:{site_port}"
    by_name = f"{INTERNAL_NAME} resolves to 127.0.0.1, which is a loopback address"
    return [
        (f"http://127.0.0.1:{v4}/a.png", "127.0.0.1 is a loopback address"),
        (f"https://127.0.0.1:{tls}/a.png", "127.0.0.1 is a loopback address"),
        (f"http://localhost:{v4}/a.png", "localhost resolves to"),
        (f"http://{INTERNAL_NAME}:{v4}/a.png", by_name),
        (f"https://{INTERNAL_NAME}:{tls}/a.png", by_name),
        (f"http://[::1]:{v6}/", "::1 is a loopback address"),
        (f"http://[::ffff:127.0.0.1]:{v4}/", "loopback (inside the IPv6 address ::ffff:7f00:1)"),
        (f"http://0.0.0.0:{v4}/", "0.0.0.0 is an unspecified address"),
        (f"http://2130706433:{v4}/", "2130706433 resolves to 127.0.0.1"),  # 127.0.0.1 as one decimal number
        (f"{redirected}/to-v4", "127.0.0.1 is a loopback address"),
        (f"{redirected}/to-tls", "127.0.0.1 is a loopback address"),
        (f"{redirected}/to-v6", "::1 is a loopback address"),
        (f"{redirected}/to-name", f"{INTERNAL_NAME} resolves to 127.0.0.1"),
    ]


@pytest.fixture(scope="module")
async def listener(pki) -> AsyncIterator[Listener]:
    listener = Listener()
    await listener.start(server_tls(pki))
    yield listener
    listener.close()


@pytest.fixture(scope="module")
async def redirecting_site(listener) -> AsyncIterator[tuple[int, list[str]]]:
    v4, tls, v6 = listener.ports["v4"], listener.ports["tls"], listener.ports["v6"]
    redirects = {
        "/to-v4": f"http://127.0.0.1:{v4}/a.png",
        "/to-tls": f"https://127.0.0.1:{tls}/a.png",
        "/to-v6": f"http://[::1]:{v6}/a.png",
        "/to-name": f"http://{INTERNAL_NAME}:{v4}/a.png",
        "/to-image": "/image.png",
    }
    async with site(SITE_ADDRESS, redirects) as served:
        yield served


@pytest.fixture(scope="module")
async def server(default_model_dir):
    async with running_server(default_model_dir, sources=POLICY) as server:
        yield server


async def test_the_gateway_refuses_every_internal_url_without_connecting(server, listener, redirecting_site):
    site_port, asked = redirecting_site
    async with gateway([server.url], sources=POLICY) as url:
        for image_url, why in internal_urls(listener.ports, site_port):
            part = {"type": "image_url", "image_url": {"url": image_url}}
            status, _, reply = await post(url, chat_request("m", [part]))
            message = reply["error"]["message"]
            assert status == 400, (image_url, status, message)
            assert message.startswith(f"message 0 part 0: fetching {image_url} refused: "), message
            assert why in message, message
    assert await listener.settle() == 0
    assert sorted(set(asked)) == ["/to-name", "/to-tls", "/to-v4", "/to-v6"]  # the first hops were made


async def test_the_server_refuses_every_internal_url_without_connecting(server, listener, redirecting_site):
    site_port, _ = redirecting_site
    async with grpc.aio.insecure_channel(server.url.removeprefix("grpc://")) as channel:
        for url, why in internal_urls(listener.ports, site_port):
            request = pb.EncodeRequest(request_id="ssrf", items=[item(url=url, index=3)])
            reply = await call_encode(channel, request)
            assert reply.code == grpc.StatusCode.INVALID_ARGUMENT, (url, reply.code, reply.details)
            assert reply.details.startswith(f"item 3: fetching {url} refused: "), reply.details
            assert why in reply.details, reply.details
        # ...and still serves an allowed URL: the allowed site, by a public-looking name, through a redirect.
        allowed = item(url=f"http://{PUBLIC_NAME}:{site_port}/to-image")
        reply = await call_encode(channel, pb.EncodeRequest(request_id="ok", items=[allowed]))
        assert reply.code == grpc.StatusCode.OK and reply.headers[0].num_tokens == 4, reply.details
    assert await listener.settle() == 0


async def test_the_sglang_reader_refuses_the_same(server, listener, redirecting_site):
    """The SGLang service reads item strings through the server's own SourceReader."""
    from encoder_server.sglang.items import read_item

    site_port, _ = redirecting_site
    for url, why in internal_urls(listener.ports, site_port)[:3]:
        with pytest.raises(InvalidItemError, match="refused: .*" + why.replace(".", r"\.")):
            await read_item(url, SourceReader(POLICY))
    assert await listener.settle() == 0


async def test_with_internal_addresses_allowed_a_loopback_fetch_works():
    async with site("127.0.0.1", {"/hop": "/image.png", "/loop": "/loop"}) as (port, asked):
        image = f"http://127.0.0.1:{port}/image.png"
        reader = SourceReader(SourcePolicy(http_urls="any", max_redirects=2))
        assert await reader.read(image) == PNG
        assert await reader.read(f"http://localhost:{port}/hop") == PNG
        with pytest.raises(InvalidItemError, match="HTTP 302 with more redirects than --max-redirects 2"):
            await reader.read(f"http://127.0.0.1:{port}/loop")
        with pytest.raises(InvalidItemError, match="failed: HTTP 404"):
            await reader.read(f"http://127.0.0.1:{port}/missing.png")
        with pytest.raises(InvalidItemError, match=f"its body is {len(PNG)} bytes, over the limit of 100"):
            await SourceReader(SourcePolicy(http_urls="any", max_fetch_bytes=100)).read(image)
        with pytest.raises(InvalidItemError, match="HTTP 302 with more redirects than --max-redirects 0"):
            no_redirects = SourceReader(SourcePolicy(http_urls="any", max_redirects=0))
            await no_redirects.read(f"http://127.0.0.1:{port}/hop")
    assert asked.count("/loop") == 3


async def test_tls_is_checked_against_the_host_name_of_the_pinned_address(pki):
    """The certificate names localhost and 127.0.0.1. Another name resolving to the same address gets
    its certificate checked against that name, and fails; a CA the client does not trust fails too."""
    client = ssl.create_default_context(cafile=str(pki.ca.cert_file))
    allow = FetchLimits(allow_internal=True, timeout_s=5.0)
    calls: list[str] = []
    resolve = resolver({"other.example.com": ["127.0.0.1"]}, calls)
    async with site("127.0.0.1", {}, tls=server_tls(pki)) as (port, asked):
        trusting = dict(ssl_context=client, resolve=resolve)
        assert await fetch_http(f"https://localhost:{port}/image.png", allow, **trusting) == PNG
        assert await fetch_http(f"https://127.0.0.1:{port}/image.png", allow, **trusting) == PNG
        with pytest.raises(InvalidItemError, match="failed: TLS: .*(hostname|match)"):
            await fetch_http(f"https://other.example.com:{port}/image.png", allow, **trusting)
        with pytest.raises(InvalidItemError, match="failed: TLS: .*certificate verify failed"):
            await fetch_http(f"https://localhost:{port}/image.png", allow)  # the system's CAs only
    assert calls == ["localhost", "other.example.com"]  # once per fetch: the connection used that answer
    assert asked == ["/image.png", "/image.png"]


async def test_a_name_that_rebinds_after_the_check_is_not_followed(listener):
    """The first answer (the allowed site) is the one connected to, whatever the name resolves to later."""
    answers = [[SITE_ADDRESS], ["127.0.0.1"]]

    async def rebinding(host: str, port: int) -> Sequence[str]:
        return answers.pop(0) if len(answers) > 1 else answers[0]

    async with site(SITE_ADDRESS, {}) as (port, asked):
        limits = FetchLimits(allow_networks=(ipaddress.ip_network(SITE_ADDRESS),), timeout_s=5.0)
        url = f"http://rebind.example.com:{port}/image.png"
        assert await fetch_http(url, limits, resolve=rebinding) == PNG
        with pytest.raises(InvalidItemError, match="resolves to 127.0.0.1"):  # a second fetch asks again
            await fetch_http(url, limits, resolve=rebinding)
    assert asked == ["/image.png"]
    assert await listener.settle() == 0


@pytest.mark.parametrize(
    "address, kind",
    [
        ("127.0.0.1", "loopback"), ("10.1.2.3", "private"), ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "link-local"), ("100.64.0.1", "non-global"), ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"), ("240.0.0.1", "reserved"), ("::1", "loopback"), ("fe80::1", "link-local"),
        ("fd00::1", "unique-local"), ("ff02::1", "multicast"), ("::", "unspecified"),
        ("::ffff:10.0.0.1", "private (inside"), ("64:ff9b::a9fe:a9fe", "link-local (inside"),
        ("2002:7f00:1::", "loopback (inside"), ("8.8.8.8", None), ("2606:4700::1111", None),
    ],
)  # fmt: skip
def test_internal_address_kinds(address, kind):
    found = internal_kind(ipaddress.ip_address(address))
    assert found == kind if kind is None else found.startswith(kind), found


def test_the_receiver_reads_files_with_the_same_size_cap(tmp_path):
    from receiver.items import read_image_bytes

    big, limit = tmp_path / "big.png", SourcePolicy.max_fetch_bytes
    with big.open("wb") as f:
        f.truncate(limit + 1)  # sparse: costs no disk
    with pytest.raises(InvalidItemError, match=f"item 2: .*over the limit of {limit} bytes"):
        read_image_bytes({"url": big.as_uri()}, 2, None)
    (tmp_path / "a.png").write_bytes(PNG)
    assert read_image_bytes({"url": (tmp_path / "a.png").as_uri()}, 0, None) == PNG
    with pytest.raises(InvalidItemError, match="item 0: http:// URLs are not read here"):
        read_image_bytes({"url": "http://example.com/a.png"}, 0, None)
