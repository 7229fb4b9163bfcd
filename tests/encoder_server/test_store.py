"""The fleet-wide embedding store on a real redis-server and real encoder servers (the built-in model):
an image one encoder computed is a lookup for another, byte for byte; an entry of another model or
preprocessing never matches; a corrupted, truncated or misplaced entry put there by hand is never
served; a store killed (SIGKILL) or hanging (SIGSTOP) costs forwards, never an answer, and hits resume
once it is back; entries are bounded by Redis's maxmemory and expire; the metrics, the flags and the
deploy manifest's Redis."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import subprocess
import time

import pytest
import torch
import yaml
from redis.asyncio import Redis

from encoder_common.env_flags import config_from_args
from encoder_server.cli import build_parser
from encoder_server.config import ServerConfig
from encoder_server.store import KEY_PREFIX, CircuitBreaker, CorruptEntry, StoreConfig, pack, unpack
from receiver import EncoderReceiver
from testkit import REPO_ROOT
from testkit.images import image_bytes
from testkit.redis_server import RedisServer, running_redis
from testkit.servers import running_server, wait_until
from tests.encoder_server.test_metrics import scrape, value

pytestmark = pytest.mark.services  # a real redis-server (scripts/setup_redis.sh)

_seeds = iter(range(50_000, 60_000))


def fresh_image(side: int = 84) -> bytes:
    return image_bytes(side, side, seed=next(_seeds))


@pytest.fixture
def redis_server(tmp_path):
    with running_redis(tmp_path, maxmemory="64mb") as server:
        yield server


@contextlib.asynccontextmanager
async def encoders(model_dir, url: str, count: int, **overrides):
    """`count` encoders sharing the store at `url`, and one receiver per encoder."""
    async with contextlib.AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(running_server(model_dir, store=StoreConfig(url=url), **overrides))
            for _ in range(count)
        ]
        receivers = [await stack.enter_async_context(EncoderReceiver([s.url])) for s in servers]
        yield servers, receivers


def store_key(server, data: bytes) -> bytes:
    return KEY_PREFIX + server.cache.key(hashlib.sha256(data).digest())


async def stored(server, count: int) -> None:
    assert await wait_until(lambda: server.store.stats.puts["stored"] >= count, 10), server.store.stats.puts


async def test_an_image_one_encoder_computed_is_a_store_hit_for_another_byte_for_byte(default_model_dir, redis_server):
    image = fresh_image()
    async with encoders(default_model_dir, redis_server.url, 2, metrics_port=0) as ((a, b), (to_a, to_b)):
        first = (await to_a.encode("first", [{"data": image}])).items[0]
        await stored(a, 1)
        second = (await to_b.encode("second", [{"data": image}])).items[0]
        assert not first.cache_hit and second.cache_hit  # no forward on b
        assert torch.equal(first.embedding, second.embedding) and second.grid_thw == first.grid_thw
        assert b.cache.holds(b.cache.key(hashlib.sha256(image).digest()))  # and its own cache keeps it now
        again = (await to_b.encode("again", [{"data": image}])).items[0]
        assert again.cache_hit and b.store.stats.lookups["hit"] == 1  # from the LRU: no second lookup
        samples = scrape(b.metrics_port)
        assert value(samples, "encoder_store_lookups_total", outcome="hit") == 1
        assert value(samples, "encoder_store_forwards_avoided_total") == 1
        assert value(samples, "encoder_store_seconds_count", op="get") == 1
        assert value(scrape(a.metrics_port), "encoder_store_lookups_total", outcome="miss") == 1
        assert value(scrape(a.metrics_port), "encoder_store_puts_total", outcome="stored") == 1
        redis = Redis.from_url(redis_server.url)
        assert 0 < await redis.ttl(store_key(a, image)) <= StoreConfig().ttl_s  # entries expire
        await redis.aclose()


async def test_an_entry_of_another_dtype_or_preprocessing_never_matches(default_model_dir, redis_server):
    image = fresh_image()
    async with encoders(default_model_dir, redis_server.url, 1) as ((a,), (to_a,)):
        await to_a.encode("float32", [{"data": image}])
        await stored(a, 1)
    for overrides in ({"dtype": torch.bfloat16}, {"preprocess_profile": "transformers"}):
        async with encoders(default_model_dir, redis_server.url, 1, **overrides) as ((other,), (to_other,)):
            item = (await to_other.encode("other", [{"data": image}])).items[0]
            assert not item.cache_hit and other.store.stats.lookups == {"miss": 1}, overrides


async def test_a_corrupted_truncated_or_misplaced_entry_is_never_served(default_model_dir, redis_server):
    flipped, truncated, misplaced, donor = images = [fresh_image() for _ in range(4)]
    redis = Redis.from_url(redis_server.url)
    async with encoders(default_model_dir, redis_server.url, 2) as ((a, b), (to_a, to_b)):
        want = await to_a.encode("want", [{"data": data} for data in images])
        await stored(a, 4)
        entry = await redis.get(store_key(a, flipped))
        await redis.setrange(store_key(a, flipped), len(entry) - 10, bytes([entry[-10] ^ 0x01]))
        entry = await redis.get(store_key(a, truncated))
        await redis.set(store_key(a, truncated), entry[: len(entry) - 100])
        await redis.set(store_key(a, misplaced), await redis.get(store_key(a, donor)))  # valid, but another image's

        got = await to_b.encode("got", [{"data": data} for data in images[:3]])
        for item, expected in zip(got.items, want.items):
            assert not item.cache_hit  # computed again
            assert torch.equal(item.embedding, expected.embedding)
        assert b.store.stats.lookups == {"corrupt": 3}
        # Each bad entry was dropped and b's own result put in its place.
        for data in images[:3]:
            assert await wait_until_async(lambda d=data: entry_is_valid(redis, a, d))
    await redis.aclose()


async def entry_is_valid(redis: Redis, server, data: bytes) -> bool:
    entry = await redis.get(store_key(server, data))
    if entry is None:
        return False
    with contextlib.suppress(CorruptEntry):
        unpack(store_key(server, data)[len(KEY_PREFIX) :], entry)
        return True
    return False


async def wait_until_async(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_a_store_killed_mid_run_costs_forwards_never_an_answer_and_hits_resume_when_it_is_back(
    default_model_dir, redis_server
):
    images = [fresh_image(56 + 28 * (i % 3)) for i in range(24)]
    async with (
        running_server(default_model_dir) as plain,
        EncoderReceiver([plain.url]) as reference,
        encoders(default_model_dir, redis_server.url, 2) as ((a, b), (to_a, to_b)),
        EncoderReceiver([a.url, b.url], seed=0) as both,
    ):
        want = {data: (await reference.encode("ref", [{"data": data}])).embedding for data in images}

        async def check(number: int, batch: list[bytes]) -> None:
            result = await both.encode(f"r{number}", [{"data": data} for data in batch])
            for data, item in zip(batch, result.items):
                torch.testing.assert_close(item.embedding, want[data], rtol=1e-5, atol=1e-5)

        batches = [images[i : i + 3] for i in range(0, len(images), 3)]
        await asyncio.gather(*(check(n, batch) for n, batch in enumerate(batches[:4])))
        redis_server.kill()  # while the rest are in flight
        await asyncio.gather(*(check(n, batch) for n, batch in enumerate(batches[4:], 4)))
        assert a.store.stats.lookups["error"] + b.store.stats.lookups["error"] >= 1
        assert a.store.breaker.is_open or b.store.breaker.is_open

        redis_server.start()  # empty, on the same port
        new = await put_through(to_a, a)
        item = (await to_b.encode("back", [{"data": new}])).items[0]
        assert item.cache_hit and b.store.stats.lookups["hit"] == 1


async def put_through(to_a: EncoderReceiver, a) -> bytes:
    """A fresh image encoded on a once a's put of it went through (after the breaker's cooldown, the first
    call that succeeds closes it)."""
    for number in range(40):
        data, before = fresh_image(), a.store.stats.puts["stored"]
        await to_a.encode(f"put-{number}", [{"data": data}])
        if await wait_until(lambda before=before: a.store.stats.puts["stored"] > before, 0.5):
            return data
    pytest.fail(f"no put went through: {a.store.stats}")


async def test_a_hanging_store_costs_at_most_its_timeout(default_model_dir, redis_server):
    async with encoders(default_model_dir, redis_server.url, 1) as ((a,), (to_a,)):
        await to_a.encode("warm", [{"data": fresh_image()}])
        plain_started = time.perf_counter()
        await to_a.encode("plain", [{"data": fresh_image()}])
        plain_s = time.perf_counter() - plain_started
        redis_server.pause()
        try:
            started = time.perf_counter()
            item = (await to_a.encode("hung", [{"data": fresh_image()}])).items[0]
            hung_s = time.perf_counter() - started
        finally:
            redis_server.resume()
    assert not item.cache_hit and a.store.stats.lookups["error"] == 1
    assert hung_s < plain_s + 2 * a.store.timeout_s + 0.5, (hung_s, plain_s)


async def test_entries_are_bounded_by_the_stores_maxmemory(default_model_dir, tmp_path):
    with running_redis(tmp_path, maxmemory="3mb") as small:
        async with encoders(default_model_dir, small.url, 1) as ((a,), (to_a,)):
            sizes = []
            for number in range(16):  # 64 embeddings of 128 KiB
                result = await to_a.encode(f"r{number}", [{"data": fresh_image(112)} for _ in range(4)])
                sizes.extend(item.embedding.nbytes for item in result.items)
            await stored(a, 64)
        redis = Redis.from_url(small.url)
        memory = await redis.info("memory")
        kept = await redis.dbsize()
        await redis.aclose()
    assert sum(sizes) > 2 * memory["maxmemory"]  # more was put than it may hold
    assert memory["used_memory"] <= memory["maxmemory"] + max(sizes) and 0 < kept < 64  # least recently used went


def test_entries_round_trip_and_every_damage_is_caught():
    from encoder_server.payload import ItemPayload
    from protos import encoder_pb2 as pb

    rows = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    header = pb.ItemHeader(num_tokens=3, hidden_size=4, dtype=pb.FLOAT32, num_deepstack_layers=1, payload_bytes=96)
    payload = ItemPayload(header, [rows[0], rows[1]])
    key = hashlib.sha256(b"image").digest()
    entry = pack(key, payload)
    back = unpack(key, entry)
    assert back.header.cache_hit and back.header.num_tokens == 3 and not back.header.HasField("timing")
    assert b"".join(bytes(v) for v in back.payload_views()) == b"".join(bytes(v) for v in payload.payload_views())
    damaged = {
        "a flipped byte": entry[:-1] + bytes([entry[-1] ^ 1]),
        "a truncated entry": entry[:-4],
        "a longer entry": entry + b"\0",
        "another format": b"x" * len(entry),
        "nothing": b"",
    }
    for what, bad in damaged.items():
        with pytest.raises(CorruptEntry):
            unpack(key, bad)
            pytest.fail(what)
    with pytest.raises(CorruptEntry, match="another key"):
        unpack(hashlib.sha256(b"other").digest(), entry)


def test_the_breaker_opens_after_failures_in_a_row_and_one_trial_closes_it():
    now = [0.0]
    breaker = CircuitBreaker(failures=3, cooldown_s=1.0, clock=lambda: now[0])
    for _ in range(2):
        assert breaker.allow()
        breaker.outcome(False)
    assert breaker.allow() and not breaker.is_open
    breaker.outcome(True)  # a success resets the count
    for _ in range(3):
        assert breaker.allow()
        breaker.outcome(False)
    assert breaker.is_open and not breaker.allow()
    now[0] += 1.0
    assert breaker.allow() and not breaker.allow()  # one trial at a time
    breaker.outcome(None)  # its caller gave up: another may try
    assert breaker.allow()
    breaker.outcome(False)  # a failed trial opens it again at once
    assert not breaker.allow()
    now[0] += 1.0
    assert breaker.allow()
    breaker.outcome(True)
    assert not breaker.is_open and breaker.allow()


def test_the_store_is_off_without_its_url_and_its_flags_are_checked(default_model_dir):
    parser = build_parser()
    config = config_from_args(ServerConfig, parser.parse_args(["--model", str(default_model_dir)]))
    assert config.store.url is None
    given = ["--model", "m", "--store-url", "redis://cache:6379/0", "--store-timeout-ms", "50"]
    config = config_from_args(ServerConfig, parser.parse_args(given))
    assert config.store == StoreConfig(url="redis://cache:6379/0", timeout_ms=50.0)
    with pytest.raises(ValueError, match="--cache-bytes"):
        config_from_args(ServerConfig, parser.parse_args([*given, "--cache-bytes", "0"]))
    with pytest.raises(ValueError, match="redis://"):
        StoreConfig(url="http://cache:6379")


STORE_MANIFEST = REPO_ROOT / "deploy" / "embedding-store.yaml"


def test_the_store_manifest_validates_and_its_redis_is_bounded_and_evicts(tmp_path):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="install the test extra")
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(STORE_MANIFEST.read_text()) if doc}
    assert set(docs) == {"Deployment", "Service"}
    for doc in docs.values():
        kubernetes_validate.validate(doc, kubernetes_validate.utils.latest_version(), strict=True)
    (redis,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    args = redis["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru"
    # The same arguments, given to a real redis-server: accepted, bounded and evicting.
    server = RedisServer(tmp_path)
    server.extra_args = args
    server.start()
    try:
        policy = subprocess.run(
            ["redis-cli", "-p", str(server.port), "config", "get", "maxmemory*"], capture_output=True, text=True, check=True
        ).stdout.split()
        settings = dict(zip(policy[::2], policy[1::2]))
        assert settings["maxmemory-policy"] == "allkeys-lru" and int(settings["maxmemory"]) > 0
    finally:
        server.kill()
    url = f"redis://{docs['Service']['metadata']['name']}:{docs['Service']['spec']['ports'][0]['port']}/0"
    assert f"value: {url}" in (REPO_ROOT / "deploy" / "encoder.yaml").read_text()  # the line that turns it on
    assert StoreConfig(url=url).url == url
