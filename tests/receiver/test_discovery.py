"""DNS discovery of encoders: real servers on 127.0.0.1, a resolver the test controls mapping a name
onto their ports, servers appearing and disappearing between calls."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
import torch

from encoder_common.errors import UnavailableError
from receiver import EncoderReceiver
from receiver.fleet.discovery import (
    DEFAULT_PORT,
    DnsName,
    EncoderDiscovery,
    address_url,
    parse_encoder_url,
    resolve_all,
)
from testkit.images import image_bytes
from testkit.servers import running_server
from testkit.vllm_server import free_port

NAME = "encoder-headless.llm.svc.cluster.local"
URL = f"dns:///{NAME}:50051"


class FakeDns:
    """A name -> addresses table the test edits between calls; counts the lookups."""

    def __init__(self, table: dict[str, list[tuple[str, int]]]):
        self.table = table
        self.lookups = 0

    def __call__(self, host: str, port: int) -> list[tuple[str, int]]:
        self.lookups += 1
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(self.table[host])


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
async def servers(default_model_dir):
    async with (
        running_server(default_model_dir) as a,
        running_server(default_model_dir) as b,
        running_server(default_model_dir) as c,
    ):
        yield [a, b, c]


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [image_bytes(28 * (1 + i % 3), 28 * (2 + i % 2), seed=40 + i) for i in range(6)]


@pytest.fixture(scope="module")
async def baseline(servers, images):
    async with EncoderReceiver([servers[0].url]) as rx:
        return await rx.encode("baseline", [{"data": d} for d in images])


def addresses(*servers) -> list[tuple[str, int]]:
    return [("127.0.0.1", s.port) for s in servers]


def receiver(dns: FakeDns, clock: FakeClock | None = None, **kwargs) -> EncoderReceiver:
    rx = EncoderReceiver([URL], resolver=dns, refresh_s=kwargs.pop("refresh_s", 60.0), **kwargs)
    if clock is not None:
        rx.discovery.clock = clock
    return rx


def assert_same_embeddings(result, baseline) -> None:
    assert [item.index for item in result.items] == list(range(len(baseline.items)))
    for got, want in zip(result.items, baseline.items):
        torch.testing.assert_close(got.embedding, want.embedding, rtol=1e-5, atol=1e-5)


async def test_a_dns_name_shards_across_every_address_behind_it(servers, images, baseline):
    dns = FakeDns({NAME: addresses(*servers)})
    used = set()
    for seed in range(4):
        async with receiver(dns, seed=seed) as rx:
            result = await rx.encode(f"dns-{seed}", [{"data": d} for d in images])
        assert_same_embeddings(result, baseline)
        by_encoder = {item.encoder_url for item in result.items}
        assert len(by_encoder) == 3  # 6 items over 3 encoders: 2 each
        used |= by_encoder
        assert rx.metrics.snapshot()["items_by_encoder"] == {
            url: sum(item.encoder_url == url for item in result.items) for url in by_encoder
        }
    assert used == {s.url for s in servers}


async def test_new_pods_get_work_after_a_refresh_and_gone_pods_stop_getting_it(servers, images, baseline):
    a, b, c = servers
    dns, clock = FakeDns({NAME: addresses(a, b)}), FakeClock()
    items = [{"data": d} for d in images]
    async with receiver(dns, clock, refresh_s=10.0, seed=0) as rx:
        first = await rx.encode("two", items)
        assert {i.encoder_url for i in first.items} == {a.url, b.url} and dns.lookups == 1

        dns.table[NAME] = addresses(a, b, c)  # a pod came up
        clock.now += 5  # not due yet: the cached addresses serve
        still_two = await rx.encode("cached", items)
        assert {i.encoder_url for i in still_two.items} == {a.url, b.url} and dns.lookups == 1

        clock.now += 5
        three = await rx.encode("three", items)
        assert {i.encoder_url for i in three.items} == {a.url, b.url, c.url} and dns.lookups == 2
        assert_same_embeddings(three, baseline)

        dns.table[NAME] = addresses(b, c)  # pod a went away
        clock.now += 10
        channel_a = next(e.channel for e in rx.endpoints if e.url == a.url)
        for seed in range(3):
            result = await rx.encode(f"after-{seed}", items)
            assert {i.encoder_url for i in result.items} == {b.url, c.url}
            assert_same_embeddings(result, baseline)
        assert [e.url for e in rx.endpoints] == sorted([b.url, c.url])
        # a's channel is closed once its (grace-limited) close has run; it had no calls in flight
        for _ in range(3000):  # 30 s: far more than a loaded machine needs
            if channel_a.get_state() == grpc.ChannelConnectivity.SHUTDOWN:
                break
            await asyncio.sleep(0.01)
        assert channel_a.get_state() == grpc.ChannelConnectivity.SHUTDOWN


async def test_an_unreachable_address_triggers_re_resolution_and_is_left_out(servers, images, baseline):
    a = servers[0]
    dead = ("127.0.0.1", free_port())  # nothing listens on it
    dead_url = address_url(*dead)
    dns, clock = FakeDns({NAME: [dead, *addresses(a)]}), FakeClock()
    async with receiver(dns, clock, seed=0) as rx:
        # One item lands on the dead address; the receiver re-resolves, leaves it out and fails
        # that item over to the live pod, so the call completes.
        result = await rx.encode("hits-dead", [{"data": images[0]}, {"data": images[1]}])  # one item each
        assert {i.encoder_url for i in result.items} == {a.url}
        assert dns.lookups == 2
        assert rx.endpoints == [e for e in rx.endpoints if e.url == a.url]
        after = await rx.encode("after", [{"data": d} for d in images])
        assert dns.lookups == 2 and {i.encoder_url for i in after.items} == {a.url}
        assert_same_embeddings(after, baseline)
        snapshot = rx.metrics.snapshot()
        assert snapshot["shard_failures"] == {f"{dead_url} UNAVAILABLE": 1}
        assert snapshot["failovers"] == {dead_url: 1}
        assert snapshot["requests"] == {"ok": 2}
        assert snapshot["resolutions"] == {"ok": 2}
        # After the cooldown it is tried again (DNS still lists it), and fails again.
        clock.now += rx.discovery.failure_cooldown_s + rx.discovery.refresh_s
        assert dead_url in await rx.discovery.urls()


async def test_resolution_failures_keep_previous_addresses_and_none_at_all_is_unavailable(servers, images):
    a = servers[0]
    dns, clock = FakeDns({}), FakeClock()
    async with receiver(dns, clock) as rx:
        with pytest.raises(UnavailableError, match=NAME):
            await rx.encode("nothing", [{"data": images[0]}])
        dns.table[NAME] = addresses(a)  # the first pod is ready: the next call finds it at once
        assert (await rx.encode("resolved", [{"data": images[0]}])).items[0].encoder_url == a.url
        del dns.table[NAME]  # the DNS server stops answering for the name
        clock.now += 60
        assert (await rx.encode("kept", [{"data": images[0]}])).items[0].encoder_url == a.url
        assert dns.lookups == 3
        assert rx.metrics.snapshot()["resolutions"] == {"error": 2, "ok": 1}


async def test_fixed_urls_and_dns_names_mix(servers, images, baseline):
    a, b, c = servers
    dns = FakeDns({NAME: addresses(b, c, a)})  # a also behind the name: listed once
    async with EncoderReceiver([a.url, URL], resolver=dns, seed=2) as rx:
        result = await rx.encode("mixed", [{"data": d} for d in images])
        assert [e.url for e in rx.endpoints] == [a.url, *sorted([b.url, c.url])]
        infos = await rx.model_info()
    assert {i.encoder_url for i in result.items} == {a.url, b.url, c.url}
    assert_same_embeddings(result, baseline)
    assert set(infos) == {a.url, b.url, c.url}


async def test_concurrent_calls_share_one_resolution(servers, images):
    dns = FakeDns({NAME: addresses(*servers)})
    async with receiver(dns) as rx:
        results = await asyncio.gather(*(rx.encode(f"c{i}", [{"data": images[i]}]) for i in range(6)))
    assert dns.lookups == 1
    assert [r.request_id for r in results] == [f"c{i}" for i in range(6)]


def test_dns_url_forms():
    assert parse_encoder_url(URL) == DnsName(URL, NAME, 50051)
    assert parse_encoder_url("dns:encoders:6000") == DnsName("dns:encoders:6000", "encoders", 6000)
    assert parse_encoder_url("dns:///encoders") == DnsName("dns:///encoders", "encoders", DEFAULT_PORT)
    assert parse_encoder_url("dns:///[fd00::7]:7000").host == "fd00::7"
    assert parse_encoder_url("grpc://10.0.0.1:50051") == "grpc://10.0.0.1:50051"
    for bad, why in [
        ("dns://8.8.8.8/encoders:50051", "DNS server"),
        ("dns:///encoders:http", "not a number"),
        ("dns:///encoders:70000", "out of range"),
        ("dns:///", "no host"),
        ("http://encoders:50051", "unsupported"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_encoder_url(bad)
    with pytest.raises(ValueError, match="DNS server"):
        EncoderReceiver(["dns://1.1.1.1/x:1"])


def test_addresses_become_urls_with_ipv6_in_brackets():
    assert address_url("10.1.2.3", 50051) == "grpc://10.1.2.3:50051"
    assert address_url("fd00::7", 50051) == "grpc://[fd00::7]:50051"


def test_the_system_resolver_returns_ipv4_and_ipv6_addresses():
    assert ("127.0.0.1", 50051) in resolve_all("localhost", 50051)
    assert resolve_all("::1", 7) == [("::1", 7)]
    assert resolve_all("127.0.0.1", 7) == [("127.0.0.1", 7)]


async def test_discovery_orders_fixed_first_and_needs_a_url():
    dns = FakeDns({"n": [("10.0.0.2", 1), ("10.0.0.1", 1), ("fd00::1", 1)]})
    discovery = EncoderDiscovery(["grpc://z:1", "dns:///n:1"], resolver=dns)
    assert await discovery.urls() == ["grpc://z:1", "grpc://10.0.0.1:1", "grpc://10.0.0.2:1", "grpc://[fd00::1]:1"]
    with pytest.raises(ValueError):
        EncoderDiscovery([])
