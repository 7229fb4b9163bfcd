"""A soak and chaos run: a fleet of encoder servers on this machine under mixed load while a seeded
fault schedule lands, every request checked against its invariants and recorded in a history, the
processes' resources sampled and fitted for slope.

The fleet: `--encoders` server processes (the real server, shared memory on, a stand-in tower whose
output for an image is derived from the whole decoded image: its pixels' sha256 sets the size, 16 to 1792
tokens x 1024 bf16, and seeds the values, so that any two images get different embeddings and a reference
that derives it the same way from the item's bytes computes every item's embedding exactly), each behind a relay
(testkit.fault_proxy) that can partition or slow its link and follows it across restarts; two prefill
nodes, each an `EncoderReceiver` over all of them (one over shared memory, one over the gRPC stream).
Where .venv-engines exists (`--engine`), an engine lane too (scripts/soak_engine_lane.py): encoder-gateway
in front of a vLLM, with two real encoder servers on the default model behind relays of their own, which
the faults reach like the others (all but failing forwards); its chat requests are checked against the
same vLLM given the same images.

The workload (`--workers` at once): requests of one to four items, Zipf-repeated images from a pool and
fresh ones, PNG and JPEG of many sizes (three heights per width, so that different images of one size
meet), precomputed embeddings mixed in, now and then a hostile item (bytes that are no image, a truncated
PNG) and a call cancelled part-way; every request has a deadline.

The faults, at seeded random moments on a seeded random encoder, each held a few seconds, every kind
once per round in a seeded order: kill -9 and restart, SIGSTOP/SIGCONT, a partition that drops nothing
and closes nothing (the relay holds), a slow link, a graceful drain (SIGTERM) and restart, shared memory
that runs out (the segments live on a small tmpfs, filled up), an encoder whose forwards fail. One at a
time, or up to `--concurrent-faults` at once, each on an encoder of its own (`faults_at_once_max` in
the summary says how many overlapped).

Invariants, per request: each returned embedding equals its item's reference, in its slot (`wrong`);
each request ends with a result, a typed error (`EncoderError`) or its own cancellation within its
deadline and a grace (`lost`: anything else, or later; those in flight while the driver's own loop
went longer than the grace without a turn are also counted apart); each typed error has its cause
(`failure_cause`): a request with a hostile item gets exactly INVALID_ARGUMENT (HTTP 400 through the
gateway) naming that item, and any request fails otherwise only while faults held the encoders it
failed on, with a status those faults explain (`unexcused` otherwise); of the valid requests in flight
during a fault (or `--recovery-s` after it), at most `--max-failed-fraction` fail; repeats served from a
cache (`cache_hits`). `--inject slot_swap` or `--inject key_collision` plants a bug in the soak servers
(items in each other's slots; a cache key by the image's size instead of its bytes) that the run must
catch.
Resources per process every `--sample-s`: RSS, file descriptors, threads, and for the servers the
calls open, the stream budget's bytes, leases held (a tenth of the calls ask for a lease nobody
fetches) and segments outstanding; segment files in the shared-memory directory; slopes fitted per
process lifetime (least squares, per hour).

    .venv/bin/python scripts/soak.py --duration-s 3600 --seed 7 --json soak.json

Prints one JSON summary line; exits 1 when an invariant broke (`broken_invariants` says which).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from encoder_server.models import ImageEmbedding, PreparedImage  # noqa: E402
from testkit.bench_harness import Stopwatch, percentile, print_json, write_json  # noqa: E402
from testkit.encoders import EncoderDouble  # noqa: E402
from testkit.shm_dirs import small_shm_dir  # noqa: E402
from testkit.vllm_server import ENGINES_PYTHON  # noqa: E402

HIDDEN = 1024
FAULTS = ("kill9", "sigstop", "partition", "slow_link", "drain", "shm_full", "errors")
SHM_TMPFS_BYTES = 48 << 20
# Bugs a run can plant in its soak servers, to show that the invariants catch them (`--inject`).
INJECTIONS = ("slot_swap", "key_collision")


def image_digest(image) -> bytes:
    """The sha256 of a decoded image's every pixel, its size and mode: what the stand-in tower's output is
    derived from, on the servers and in the reference alike."""
    header = f"{image.mode} {image.width}x{image.height}\0".encode()
    return hashlib.sha256(header + image.tobytes()).digest()


def tokens_for(digest: bytes) -> int:
    """Tokens of the image of `digest`: mostly 16-255 (32-510 KiB), one image in 97 a 1792-token item (3.5 MiB)."""
    number = int.from_bytes(digest[:8], "little")
    return 1792 if number % 97 == 0 else 16 + number % 240


def stand_in_output(digest: bytes) -> ImageEmbedding:
    """The stand-in tower's output for the image of `digest`: pseudo-random rows seeded by the digest, so
    that any two images (two digests) get different embeddings, of sizes that differ too."""
    generator = torch.Generator().manual_seed(int.from_bytes(digest[8:16], "little") & (2**63 - 1))
    rows = torch.randn((tokens_for(digest), HIDDEN), generator=generator)
    return ImageEmbedding(rows.to(torch.bfloat16))


def reference_digest(data: bytes) -> bytes:
    """An item's digest as a server derives it: its bytes decoded by the servers' own decoder."""
    from encoder_server.images import decode_image

    return image_digest(decode_image(data))


class SoakEncoder(EncoderDouble):
    """The stand-in tower: made-up outputs derived from the whole image (`stand_in_output`); forwards fail
    while `fail_file` exists."""

    def __init__(self, fail_file: Path | None = None):
        super().__init__(tokens=1, hidden_size=HIDDEN, dtype=torch.bfloat16)
        self.fail_file = fail_file

    def _made_up_preprocess(self, image) -> PreparedImage:
        digest = image_digest(image)
        n = tokens_for(digest)
        pixels = torch.frombuffer(bytearray(digest), dtype=torch.uint8)  # the digest rides to the forward
        return PreparedImage(pixels, (1, 2, 2 * n), num_tokens=n, num_patches=4 * n)

    def encode(self, batch):
        if self.fail_file is not None and self.fail_file.exists():
            raise RuntimeError("soak: this encoder's forwards fail now")
        return [stand_in_output(bytes(prepared.pixel_values.tolist())) for prepared in batch]


def inject(bug: str) -> None:
    """Plants `bug` in this server process, for a run that must then fail:
    `slot_swap`: a call of two items or more gets the first two items' payloads in each other's slots;
    `key_collision`: the embedding cache keys an image by its pixel size instead of its bytes, so two
    images of one size share a key (the collision a reference seeded by the width alone could not see)."""
    import io

    from PIL import Image

    from encoder_server import cache, pipeline, sender

    if bug == "slot_swap":
        items = sender.ItemSender.items

        async def swapped(self, flows):
            held = []
            async with contextlib.aclosing(items(self, flows)) as outs:
                async for out in outs:
                    if len(flows) < 2 or held is None:
                        yield out
                        continue
                    held.append(out)
                    if len(held) == 2:
                        first, second = held
                        held = None
                        yield dataclasses.replace(first, payload=second.payload)
                        yield dataclasses.replace(second, payload=first.payload)

        sender.ItemSender.items = swapped
    elif bug == "key_collision":
        real_key = cache.content_key
        sizes: dict[bytes, bytes] = {}  # content sha256 -> that of the image's size alone

        def size_key(namespace: bytes, content_sha256: bytes) -> bytes:
            return real_key(namespace, sizes.get(content_sha256, content_sha256))

        read = pipeline.ItemPipeline._digest

        def digest(self, item, data):
            content_sha256 = read(self, item, data)
            if content_sha256 is not None:
                width, height = Image.open(io.BytesIO(bytes(data))).size  # the header alone
                sizes[content_sha256] = hashlib.sha256(f"{width}x{height}".encode()).digest()
            return content_sha256

        pipeline.ItemPipeline._digest = digest
        pipeline.content_key = cache.content_key = size_key
    else:
        raise ValueError(f"unknown bug {bug!r}; choose from {INJECTIONS}")


def serve(fail_file: str, bug: str | None = None) -> None:
    """One encoder server process of the fleet, until SIGTERM (then it drains, as a rolling update does).
    Every second it writes what it holds (calls open, stream budget, leases, segments) beside `fail_file`.
    `bug`: one of INJECTIONS, planted before it starts."""
    import logging

    from encoder_common.malloc import tune_server_malloc
    from encoder_server.leases import LeaseConfig
    from encoder_server.server import EncoderServer
    from encoder_server.transports.shm import ShmConfig
    from testkit.servers import server_config

    logging.basicConfig(level=logging.WARNING)
    tune_server_malloc()
    if bug is not None:
        inject(bug)

    async def run() -> None:
        config = server_config(REPO / "no-checkpoint", dtype=torch.bfloat16, grace_seconds=3.0,
                               shm=ShmConfig(max_bytes=32 << 20), cache_bytes=256 << 20,
                               leases=LeaseConfig(max_bytes=32 << 20, max_ttl_s=5.0))  # fmt: skip
        server = EncoderServer(config, encoder=SoakEncoder(Path(fail_file)))
        await server.start()
        asyncio.get_running_loop().create_task(write_stats(server, Path(fail_file).with_suffix(".stats")))
        stopping = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
        print(f"ready on 127.0.0.1:{server.port}", flush=True)
        await stopping.wait()
        await server.stop(grace=3.0)

    asyncio.run(run())


async def write_stats(server, path: Path) -> None:
    while True:
        stats = {
            "calls_open": server.streams.open_calls,
            "stream_bytes_held": server.streams.held,
            "leases": len(server.leases._leases) if server.leases is not None else 0,  # noqa: SLF001
            "shm_segments": len(server.transports["shm"].outstanding()),
        }
        path.with_suffix(".tmp").write_text(json.dumps(stats))
        path.with_suffix(".tmp").replace(path)
        await asyncio.sleep(1.0)


# The driver.


@dataclass
class Encoder:
    """One server process of the fleet and the relay in front of it."""

    index: int
    workdir: Path
    argv: list[str] | None = None  # None: a soak server (`serve`); else the real server of the engine lane
    bug: str | None = None  # planted in a soak server (`inject`)
    proxy: object = None
    launched: object = None
    lives: int = 0

    @property
    def kinds(self) -> tuple[str, ...]:
        """The faults that can land on it: forwards made to fail only on a soak server."""
        return FAULTS if self.argv is None else tuple(kind for kind in FAULTS if kind != "errors")

    @property
    def fail_file(self) -> Path:
        return self.workdir / f"fail-{self.index}"

    def held(self) -> dict:
        """What the server last said it holds (see `write_stats`); empty while it is down or stopped."""
        try:
            return json.loads(self.fail_file.with_suffix(".stats").read_text()) if self.pid is not None else {}
        except (OSError, ValueError):
            return {}

    @property
    def pid(self) -> int | None:
        return None if self.launched is None or self.launched.process.poll() is not None else self.launched.process.pid

    async def start(self) -> None:
        from testkit.launcher import start_process

        self.lives += 1
        argv = self.argv or [sys.executable, __file__, "--serve", str(self.fail_file), *([self.bug] if self.bug else [])]
        log = self.workdir / f"encoder-{self.index}-{self.lives}.log"
        self.launched = await asyncio.to_thread(start_process, argv, log)
        self.proxy.target_port = self.launched.port

    def signal(self, signum: int) -> None:
        if self.pid is not None:
            os.kill(self.pid, signum)

    async def wait_exit(self, timeout_s: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(self.launched.process.wait, timeout_s)
        self.launched.stop()


@dataclass
class History:
    requests: list[dict] = field(default_factory=list)
    faults: list[dict] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)


class Workload:
    """Items: Zipf-repeated images from a pool, fresh ones (new bytes: the cache has not seen them), hostile
    ones, precomputed embeddings. Each image's reference digest is derived from its bytes as the servers do."""

    def __init__(self, rng: random.Random, pool: int):
        self.rng = rng
        # (width, height, seed, format) of each repeated image; sizes drawn like the fresh ones', so that
        # images of one size but different bytes meet (a key or reference by size would confuse them).
        self.pool = [(28 + (i * 53) % 1400, _height(28 + (i * 53) % 1400, i % 3), i, ("PNG", "JPEG")[i % 2])
                     for i in range(pool)]  # fmt: skip
        self.weights = [1 / (rank + 1) for rank in range(pool)]
        self.made: dict[tuple, tuple[bytes, bytes]] = {}  # a pool image's bytes and digest, made once
        self.fresh_seed = 0
        self.seen: set[tuple] = set()

    def item(self) -> tuple[str, str | None, bytes, bytes | None]:
        """(kind, a label naming the image, its bytes (none for a precomputed item), its digest: None for a
        hostile item, whose expected answer is a refusal)."""
        from testkit.images import image_bytes

        rng = self.rng
        roll = rng.random()
        if roll < 0.06:  # embedded elsewhere: the receiver checks it and passes it through in its slot
            seed = rng.getrandbits(64)
            return "precomputed", f"precomputed/{seed}", b"", hashlib.sha256(seed.to_bytes(8, "little")).digest()
        if roll < 0.1:
            return "hostile", None, rng.choice([b"not an image at all", image_bytes(64, 64)[:300], b"\x89PNG\r\n\x1a\n" + bytes(50)]), None
        if roll < 0.7:
            image = rng.choices(self.pool, self.weights)[0]
        else:
            self.fresh_seed += 1
            width = rng.randrange(28, 1400)
            image = (width, _height(width, rng.randrange(3)), 100_000 + self.fresh_seed, rng.choice(["PNG", "JPEG"]))
        kind = "repeat" if image in self.seen else "first"
        self.seen.add(image)
        made = self.made.get(image)
        if made is None:
            width, height, seed, fmt = image
            data = image_bytes(width, height, seed=seed, fmt=fmt)
            made = (data, reference_digest(data))
            if seed < 100_000:  # a pool image comes back: its bytes and digest are kept
                self.made[image] = made
        return kind, "{}x{}/{}/{}".format(*image), *made


def _height(width: int, step: int) -> int:
    """A height within the servers' aspect-ratio limit for an image `width` wide: one of three per width."""
    return max(8, width // 100) + (0, 8, 20)[step]


# What a receiver answers once no encoder could take an item in time: the last failure of an encoder that is
# down, stopped, cut off, slowed, draining or failing its forwards, or the deadline itself. The gateway
# answers 503 or 504 for the same. An invalid item's refusal is INVALID_ARGUMENT (HTTP 400), and nothing else is.
FAULT_STATUSES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "RESOURCE_EXHAUSTED", "INTERNAL", "UNKNOWN", "PROTOCOL"})
GATEWAY_FAULT_STATUSES = frozenset({503, 504})
# The statuses each kind of fault explains on the encoder it holds: failing forwards are INTERNAL and only they
# are; a full shared-memory directory sends items over the stream instead, and explains no failure at all.
FAULT_ANSWERS = {kind: FAULT_STATUSES - {"INTERNAL"} for kind in FAULTS} | {
    "errors": frozenset({"INTERNAL"}),
    "shm_full": frozenset(),
}


@dataclass(frozen=True)
class FaultWindow:
    """When a fault could keep an encoder from serving: from its start until `recovery_s` after its end (a
    restarted server starting, a receiver's back-off from a benched encoder running out)."""

    start: float
    end: float
    encoder: int
    answers: frozenset[str]  # the statuses it explains

    @classmethod
    def of(cls, fault: dict, recovery_s: float) -> FaultWindow:
        return cls(fault["start"], fault["end"] + recovery_s, fault["encoder"], FAULT_ANSWERS[fault["kind"]])

    def overlaps(self, request: dict) -> bool:
        return self.start <= request["start"] + request["seconds"] and request["start"] <= self.end


def failure_cause(request: dict, windows: list[FaultWindow], lane_encoders: frozenset[int]) -> str:
    """Why a request that ended with a typed error failed: `refused` (it carried a hostile item and got exactly
    the documented refusal, naming that item), `fault` (no encoder could serve it in time: each encoder call
    that failed, and the request itself, failed with what a fault held on that encoder while the request was
    in flight explains), else `unexcused: ` and why."""
    hostile = {slot for slot, (kind, _) in enumerate(request["items"]) if kind == "hostile"}
    status = request["status"]
    gateway = request["node"] == "gateway"
    if status == (400 if gateway else "INVALID_ARGUMENT"):
        if not hostile:
            return "unexcused: a valid request refused as invalid"
        if not gateway and not (request["refused_items"] and set(request["refused_items"]) <= hostile):
            return "unexcused: a refusal named an item that is no hostile one"
        return "refused"
    held = [w for w in windows if w.overlaps(request) and w.answers]
    if gateway:  # no per-call story: 503/504 while a fault held one of the lane's encoders
        if status in GATEWAY_FAULT_STATUSES and any(w.encoder in lane_encoders for w in held):
            return "fault"
        return f"unexcused: HTTP {status} while no fault held an encoder of the gateway"
    if status not in frozenset().union(*(w.answers for w in held)):
        return f"unexcused: {status} while no fault held explains it"
    for encoder, answer in request["failed_on"]:
        if not any(w.encoder == encoder and answer in w.answers for w in held):
            return f"unexcused: encoder {encoder} answered {answer} while no fault held on it explains that"
    return "fault"


def longest_idle(samples: list[dict], key: str) -> float | None:
    """The longest time, in seconds between samples, over which the count `key` did not grow."""
    points = [(s["t"], s[key]) for s in samples if key in s]
    if len(points) < 2:
        return None
    longest, since = 0.0, points[0]
    for t, count in points[1:]:
        if count > since[1]:
            since = (t, count)
        longest = max(longest, t - since[0])
    return round(longest, 1)


def most_at_once(faults: list[dict]) -> int:
    """The most faults held at one moment."""
    edges = sorted([(f["start"], 1) for f in faults] + [(f["end"], -1) for f in faults])  # an end before a start
    held = most = 0
    for _, step in edges:
        held += step
        most = max(most, held)
    return most


def fitted_slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per hour."""
    n = len(points)
    if n < 3:
        return 0.0
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return 0.0 if var == 0 else 3600 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var


def proc_stats(pid: int) -> dict | None:
    try:
        status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
        return {
            "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
            "threads": int(status["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
        }
    except (FileNotFoundError, ProcessLookupError, KeyError):
        return None


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: Path, shm_dir: Path, tmpfs: bool):
        self.args = args
        self.workdir = workdir
        self.shm_dir = shm_dir
        self.tmpfs = tmpfs
        self.rng = random.Random(args.seed)
        self.history = History()
        self.encoders = [Encoder(i, workdir, bug=args.inject) for i in range(args.encoders)]
        self.engine_lane = None
        if args.engine == "on" or (args.engine == "auto" and ENGINES_PYTHON.exists()):
            from soak_engine_lane import EngineLane

            self.engine_lane = EngineLane(
                workdir, args.seed, args.deadline_s, args.engine_deadline_s, args.grace_s, args.engine_mm_cache_gb,
                args.engine_preload,
            )
        self.shm_node = None  # the prefill node that offers shared memory: its transfer stats are sampled
        self.active_faults = 0
        self.faulted: dict[int, str] = {}  # encoder index: the kind of fault it holds now
        self.stop = asyncio.Event()
        self.clock = Stopwatch()  # the run's timeline: every record's and sample's time is on it

    def now(self) -> float:
        return self.clock.seconds()

    async def run(self) -> dict:
        from receiver import EncoderReceiver

        lane = self.engine_lane
        urls = [encoder.proxy.url for encoder in await self.start_encoders(self.encoders)]
        if lane is not None:
            await asyncio.to_thread(lane.write_model)
            lane_encoders = [Encoder(len(self.encoders) + i, self.workdir, argv=lane.encoder_argv()) for i in range(2)]
            self.encoders += lane_encoders
            await asyncio.gather(self.start_encoders(lane_encoders), lane.start_engine())
            await lane.start_gateway([encoder.proxy.url for encoder in lane_encoders])
        nodes = {
            # Placed by content key, so that a repeated image goes to the encoder that has it cached.
            "node-a-shm": EncoderReceiver(urls, transfer="auto", seed=self.args.seed, timeout=self.args.deadline_s,
                                          placement="affinity"),
            "node-b-stream": EncoderReceiver(urls, transfer="grpc", seed=self.args.seed + 1,
                                             timeout=self.args.deadline_s, placement="affinity"),
        }
        self.shm_node = nodes["node-a-shm"]
        workload = Workload(random.Random(self.args.seed + 2), self.args.pool)
        try:
            tasks = [asyncio.ensure_future(self.worker(i, nodes, workload)) for i in range(self.args.workers)]
            tasks += [asyncio.ensure_future(self.faults()), asyncio.ensure_future(self.sample())]
            if lane is not None:
                tasks.append(asyncio.ensure_future(lane.worker(self)))
            await asyncio.sleep(self.args.duration_s)
            self.stop.set()
            await asyncio.gather(*tasks)
        finally:
            for node in nodes.values():
                await node.close()
            for encoder in self.encoders:
                encoder.proxy.resume()
                encoder.signal(signal.SIGCONT)
            await asyncio.gather(*(asyncio.to_thread(e.launched.stop, 5) for e in self.encoders if e.launched))
            for encoder in self.encoders:
                await encoder.proxy.close()
            if lane is not None:
                await asyncio.to_thread(lane.close)
        return self.summary()

    @staticmethod
    async def start_encoders(encoders: list[Encoder]) -> list[Encoder]:
        from testkit.fault_proxy import FaultProxy

        for encoder in encoders:
            encoder.proxy = FaultProxy(0)
            await encoder.proxy.start()
        await asyncio.gather(*(encoder.start() for encoder in encoders))
        return encoders

    async def worker(self, index: int, nodes: dict, workload: Workload) -> None:
        from encoder_common.errors import EncoderError

        rng = random.Random(self.args.seed * 1000 + index)
        n = 0
        while not self.stop.is_set():
            n += 1
            node_name = rng.choice(sorted(nodes))
            items = [workload.item() for _ in range(rng.choice([1, 1, 1, 2, 3, 4]))]
            record = {"id": f"w{index}-{n}", "node": node_name, "items": [[kind, label] for kind, label, _, _ in items],
                      "start": round(self.now(), 3), "during_fault": self.active_faults > 0}  # fmt: skip
            cancel_after = rng.uniform(0.0, 0.3) if rng.random() < 0.05 else None
            sent = [
                {"precomputed_embedding": stand_in_output(digest).embedding} if kind == "precomputed" else {"data": data}
                for kind, _, data, digest in items
            ]
            # Some calls ask for leases that nobody fetches: they must expire, not pile up.
            lease_ms = 2000 if rng.random() < 0.1 else None
            call = asyncio.ensure_future(nodes[node_name].encode(record["id"], sent, lease_ms=lease_ms))
            watch = Stopwatch()
            try:
                if cancel_after is not None:
                    done, _ = await asyncio.wait([call], timeout=cancel_after)
                    if not done:
                        call.cancel()
                result = await asyncio.wait_for(call, self.args.deadline_s + self.args.grace_s)
                record["outcome"] = "ok"
                record.update(self.check(items, result))
            except asyncio.CancelledError:
                if cancel_after is None or not call.cancelled():
                    raise
                record["outcome"] = "cancelled"
            except asyncio.TimeoutError:
                record["outcome"] = "lost: no answer within the deadline and its grace"
            except EncoderError as exc:
                record["outcome"] = "typed_error"
                record["error"] = f"{type(exc).__name__}: {exc}"[:300]
                record.update(self.attempts(exc))
            except Exception as exc:  # noqa: BLE001 - anything untyped is a finding
                record["outcome"] = f"lost: untyped {type(exc).__name__}"
                record["error"] = str(exc)[:300]
            record["seconds"] = round(watch.seconds(), 4)
            if record["outcome"] in ("ok", "typed_error") and record["seconds"] > self.args.deadline_s + self.args.grace_s:
                record["outcome"] = "lost: ended after the deadline and its grace"
            self.history.requests.append(record)
            if any(kind == "hostile" for kind, _, _, _ in items) and record["outcome"] == "ok":
                record["outcome"] = "wrong: a hostile item was answered"

    @staticmethod
    def check(items: list, result) -> dict:
        """Each returned embedding against its item's reference, in its slot; the indices of those that differ."""
        wrong, hits, repeats = [], 0, 0
        for slot, ((kind, _, _, digest), item) in enumerate(zip(items, result.items, strict=True)):
            expected = stand_in_output(digest).embedding
            if item.embedding.shape != expected.shape or not torch.equal(item.embedding.cpu(), expected):
                wrong.append(slot)
            if kind == "repeat":
                repeats += 1
                hits += bool(item.cache_hit)
        return {"wrong": len(wrong), "wrong_slots": wrong, "repeats": repeats, "cache_hits": hits}

    def attempts(self, error) -> dict:
        """What a typed error says of its cause: its status, the items that refusals as invalid named (a server
        names the item it refuses: "item 2: ..."), and the encoders (fleet indices) whose calls failed."""
        by_url = {encoder.proxy.url: encoder.index for encoder in self.encoders}
        tries = getattr(error, "attempts", {})
        refusals = [a.message for t in tries.values() for a in t if a.status == "INVALID_ARGUMENT"]
        return {
            "status": getattr(getattr(error, "code", None), "name", type(error).__name__),
            "refused_items": sorted({int(m.group(1)) for text in refusals if (m := re.match(r"item (\d+):", text))}),
            # (encoder, status) of every call that failed one of the request's items
            "failed_on": sorted({(by_url.get(a.encoder_url, -1), a.status) for t in tries.values() for a in t if a.status != "OK"}),
        }

    async def faults(self) -> None:
        """`--concurrent-faults` lanes, each landing one fault after another: that many at once at most, never
        two on one encoder, and one filling the shared-memory directory at a time."""
        await asyncio.gather(*(self.fault_lane(lane) for lane in range(self.args.concurrent_faults)))

    async def fault_lane(self, lane: int) -> None:
        rng = self.rng if lane == 0 else random.Random(self.args.seed * 7919 + lane)
        kinds = [kind for kind in FAULTS if kind != "shm_full" or self.tmpfs]
        deck: list[str] = []  # every kind once per round, in a seeded order
        while not self.stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), rng.uniform(*self.args.fault_gap_s))
            if self.stop.is_set():
                return
            if not deck:
                deck = rng.sample(kinds, len(kinds))
            # The next kind of the deck that can land now: another lane may hold every encoder it could hit.
            kind = next((kind for kind in reversed(deck) if self.free_for(kind)), None)
            if kind is None:
                continue
            deck.remove(kind)
            encoder = rng.choice(self.free_for(kind))
            hold_s = rng.uniform(*self.args.fault_hold_s)
            fault = {"kind": kind, "encoder": encoder.index, "start": round(self.now(), 3)}
            self.active_faults += 1
            self.faulted[encoder.index] = kind
            try:
                await self.land(kind, encoder, hold_s)
            except Exception as exc:  # noqa: BLE001 - the schedule goes on; the history says what failed
                fault["error"] = f"{type(exc).__name__}: {exc}"[:300]
            finally:
                self.active_faults -= 1
                del self.faulted[encoder.index]
            fault["end"] = round(self.now(), 3)
            self.history.faults.append(fault)

    def free_for(self, kind: str) -> list[Encoder]:
        """The encoders `kind` can land on now: none that a fault holds; none while the directory is full."""
        if kind == "shm_full" and kind in self.faulted.values():
            return []
        return [e for e in self.encoders if kind in e.kinds and e.index not in self.faulted]

    async def land(self, kind: str, encoder: Encoder, hold_s: float) -> None:
        if kind == "kill9":
            encoder.signal(signal.SIGKILL)
            await encoder.wait_exit(5)
            await asyncio.sleep(hold_s)
            await encoder.start()
        elif kind == "sigstop":
            encoder.signal(signal.SIGSTOP)
            await asyncio.sleep(hold_s)
            encoder.signal(signal.SIGCONT)
        elif kind == "partition":
            encoder.proxy.hold()
            await asyncio.sleep(hold_s)
            encoder.proxy.resume()
        elif kind == "slow_link":
            encoder.proxy.delay_s = 0.005  # ~13 MB/s
            await asyncio.sleep(hold_s)
            encoder.proxy.delay_s = 0.0
        elif kind == "drain":
            encoder.signal(signal.SIGTERM)
            await encoder.wait_exit(15)
            await encoder.start()
        elif kind == "shm_full":
            filler = self.shm_dir / "soak-filler"
            free = os.statvfs(self.shm_dir)
            with contextlib.suppress(OSError):  # fills it up to the last byte, as another tenant would
                with open(filler, "wb") as f:
                    f.write(bytes(free.f_bavail * free.f_frsize))
            await asyncio.sleep(hold_s)
            filler.unlink(missing_ok=True)
        elif kind == "errors":
            encoder.fail_file.touch()
            await asyncio.sleep(hold_s)
            encoder.fail_file.unlink(missing_ok=True)

    async def sample(self) -> None:
        me = os.getpid()
        last = self.now()
        while not self.stop.is_set():
            now = self.now()
            # How late this turn came: a stall of the driver's own loop (or of its process), during which
            # no deadline of its receivers could be enforced either.
            sample = {"t": round(now, 1), "driver_lag_s": round(max(0.0, now - last - self.args.sample_s), 2),
                      "shm_files": len(list(self.shm_dir.iterdir())), "procs": {}}  # fmt: skip
            if self.shm_node is not None:  # items through shared memory so far, and why others were not
                stats = self.shm_node.transfer_stats
                sample["shm_items"], sample["shm_fallbacks"] = stats.items_shm, dict(stats.fallbacks)
            last = now
            engine_procs = [(name, pid, 1) for name, pid in self.engine_lane.processes()] if self.engine_lane else []
            encoders = [(f"encoder-{e.index}", e.pid, e.lives) for e in self.encoders]
            for name, pid, life in [("driver", me, 1), *encoders, *engine_procs]:
                if pid is not None and (stats := proc_stats(pid)) is not None:
                    sample["procs"][f"{name}#{life}"] = stats
            for encoder in self.encoders:
                proc = sample["procs"].get(f"encoder-{encoder.index}#{encoder.lives}")
                if proc is not None and (held := encoder.held()):  # not while it is down or exiting
                    proc.update(held)
            self.history.samples.append(sample)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.args.sample_s)

    def stalled_during(self, request: dict) -> bool:
        """Whether the driver went more than the grace without a turn while `request` was in flight."""
        start, end = request["start"], request["start"] + request["seconds"]
        return any(
            s["driver_lag_s"] > self.args.grace_s and start <= s["t"] and s["t"] - s["driver_lag_s"] - self.args.sample_s <= end
            for s in self.history.samples
        )

    def failures(self) -> dict:
        """Every typed error by its cause (`failure_cause`), and the valid requests that failed, bounded against the
        fault windows: of the valid requests in flight during one, at most `--max-failed-fraction` may fail."""
        requests = self.history.requests
        windows = [FaultWindow.of(fault, self.args.recovery_s) for fault in self.history.faults]
        lanes = frozenset(e.index for e in self.encoders if e.argv is not None)
        failed = [r for r in requests if r["outcome"] == "typed_error"]
        for request in failed:
            request["cause"] = failure_cause(request, windows, lanes)
        valid = [r for r in requests if r["outcome"] in ("ok", "typed_error") and all(k != "hostile" for k, _ in r["items"])]
        exposed = [r for r in valid if any(w.overlaps(r) for w in windows)]
        valid_failed = sum(r["outcome"] == "typed_error" for r in valid)
        return {
            "failures_by_cause": dict(collections.Counter(r["cause"] for r in failed)),
            "failures_by_status": dict(collections.Counter(str(r["status"]) for r in failed)),
            "unexcused": sum(r["cause"].startswith("unexcused") for r in failed),
            "unexcused_examples": [{k: r[k] for k in ("id", "start", "seconds", "cause", "error")}
                                   for r in failed if r["cause"].startswith("unexcused")][:10],
            "valid_requests": len(valid),
            "valid_in_fault_windows": len(exposed),
            "valid_failed": valid_failed,
            "valid_failed_fraction_in_fault_windows": round(valid_failed / len(exposed), 4) if exposed else 0.0,
            "fault_window_s": round(sum(w.end - w.start for w in windows), 1),
        }

    def summary(self) -> dict:
        requests = self.history.requests
        outcomes = collections.Counter(r["outcome"] for r in requests)
        ok = [r for r in requests if r["outcome"] == "ok"]
        failures = self.failures()

        def p99(rows: list[dict]) -> float | None:
            return None if not rows else round(percentile([r["seconds"] for r in rows], 0.99), 3)

        def hit_rate(rows: list[dict]) -> float | None:
            repeats = sum(r["repeats"] for r in rows)
            return None if not repeats else round(sum(r["cache_hits"] for r in rows) / repeats, 3)

        # Slopes per process lifetime, after its first minute (or third of the run) of warming up.
        warm = min(60.0, self.args.duration_s / 3)
        series: dict[str, dict[str, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
        first_seen: dict[str, float] = {}
        for sample in self.history.samples:
            for proc, stats in sample["procs"].items():
                first_seen.setdefault(proc, sample["t"])
                if sample["t"] - first_seen[proc] >= warm:
                    for key, value in stats.items():
                        series[proc][key].append((sample["t"], value))
            if sample["t"] >= warm:
                series["shm_dir"]["files"].append((sample["t"], sample["shm_files"]))
        slopes = {
            proc: {
                key: {"per_h": round(fitted_slope(points), 2), "min": min(v for _, v in points), "max": max(v for _, v in points)}
                for key, points in by.items()
            } | {"samples": len(next(iter(by.values()))), "seconds": round(by[next(iter(by))][-1][0] - by[next(iter(by))][0][0])}
            for proc, by in series.items() if by and len(next(iter(by.values()))) >= 3
        }  # fmt: skip
        last = self.history.samples[-1] if self.history.samples else {}
        result = {
            "seconds": round(self.now(), 1),
            "seed": self.args.seed,
            "encoders": self.args.encoders,
            "requests": len(requests),
            "requests_by_node": dict(collections.Counter(r["node"] for r in requests)),
            "engine_lane": self.engine_lane is not None,
            # The engine's own answers to the lane's image sets differ from each other: its check can fail.
            "engine_lane_distinct_answers": self.engine_lane.distinct_answers() if self.engine_lane else None,
            "engine_alone_failures": dict(self.engine_lane.engine_alone_failures) if self.engine_lane else None,
            "items": sum(len(r["items"]) for r in requests),
            "outcomes": dict(outcomes),
            "items_checked": sum(len(r["items"]) for r in ok),
            "wrong": sum(r.get("wrong", 0) for r in requests) + outcomes.get("wrong: a hostile item was answered", 0),
            "wrong_in_multi_item_requests": sum(r.get("wrong", 0) for r in requests if len(r["items"]) > 1),
            **failures,
            "lost": sum(count for outcome, count in outcomes.items() if outcome.startswith("lost")),
            "lost_while_the_driver_stalled": sum(1 for r in requests if r["outcome"].startswith("lost") and self.stalled_during(r)),
            "driver_stalls_over_grace": [(s["t"], s["driver_lag_s"]) for s in self.history.samples if s["driver_lag_s"] > self.args.grace_s],
            "repeats_checked": sum(r.get("repeats", 0) for r in ok),
            "repeat_cache_hits": sum(r.get("cache_hits", 0) for r in ok),
            "repeat_hit_rate_outside_faults": hit_rate([r for r in ok if not r["during_fault"]]),
            "repeat_hit_rate_during_faults": hit_rate([r for r in ok if r["during_fault"]]),
            "faults": dict(collections.Counter(f["kind"] for f in self.history.faults)),
            "faults_at_once_max": most_at_once(self.history.faults),
            "fault_errors": [f for f in self.history.faults if "error" in f],
            # The receivers' encode calls; the gateway's chat requests (vLLM's prefill and decode included) apart.
            "p99_s_during_faults": p99([r for r in ok if r["during_fault"] and r["node"] != "gateway"]),
            "p99_s_outside_faults": p99([r for r in ok if not r["during_fault"] and r["node"] != "gateway"]),
            "gateway_p99_s_during_faults": p99([r for r in ok if r["during_fault"] and r["node"] == "gateway"]),
            "gateway_p99_s_outside_faults": p99([r for r in ok if not r["during_fault"] and r["node"] == "gateway"]),
            "slopes": slopes,
            "shm_files_at_end": last.get("shm_files"),
            # The shared-memory node's items through segments, why others came over the stream, and the
            # longest stretch without one: the fast path must come back after every fault.
            "shm_items": last.get("shm_items"),
            "shm_fallbacks": last.get("shm_fallbacks"),
            "shm_longest_idle_s": longest_idle(self.history.samples, "shm_items"),
            "shm_tmpfs": self.tmpfs,
            "injected": self.args.inject,
        }
        result["broken_invariants"] = broken_invariants(result, self.args.max_failed_fraction)
        return result


def broken_invariants(summary: dict, max_failed_fraction: float) -> list[str]:
    """The run's verdict from its summary: each invariant it broke (none: it passed)."""
    broken = []
    if summary["wrong"]:
        broken.append(f"{summary['wrong']} wrong: an embedding unequal to its item's reference, or a hostile item answered")
    if summary["lost"]:
        broken.append(f"{summary['lost']} lost: no result, typed error or cancellation within the deadline and its grace")
    if summary["unexcused"]:
        broken.append(f"{summary['unexcused']} failed without a cause: not a hostile item's refusal, nor while faults held their encoders")
    if summary["valid_failed_fraction_in_fault_windows"] > max_failed_fraction:
        broken.append(f"{summary['valid_failed']} of {summary['valid_in_fault_windows']} valid requests in fault windows "
                      f"failed: over {max_failed_fraction:.0%}")  # fmt: skip
    return broken


def copy_logs(workdir: Path, to: Path) -> None:
    """Every *.log under the run's directory, to the same place under `to`."""
    for log in workdir.rglob("*.log"):
        target = to / log.relative_to(workdir)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, target)


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        serve(*sys.argv[2:4])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--encoders", type=int, default=3)
    p.add_argument("--workers", type=int, default=4, help="requests in flight at once")
    p.add_argument("--pool", type=int, default=300, help="widths repeated, Zipf-weighted")
    p.add_argument("--deadline-s", type=float, default=10.0)
    p.add_argument("--grace-s", type=float, default=5.0, help="past the deadline, a request not ended is lost")
    p.add_argument("--fault-gap-s", type=float, nargs=2, default=(3.0, 8.0), help="pause between faults, min max")
    p.add_argument("--fault-hold-s", type=float, nargs=2, default=(2.0, 8.0), help="how long a fault lasts, min max")
    p.add_argument("--concurrent-faults", type=int, default=1, help="faults landing at once, on distinct encoders")
    p.add_argument("--recovery-s", type=float, default=5.0,
                   help="after a fault ends, how long a request failing on its encoder is still put down to it")
    p.add_argument("--max-failed-fraction", type=float, default=0.05,
                   help="of the valid requests in flight during a fault window, the most that may fail")
    p.add_argument("--inject", choices=INJECTIONS, help="plant a bug in the soak servers: the run must then fail")
    p.add_argument("--sample-s", type=float, default=3.0)
    p.add_argument("--engine", choices=("auto", "on", "off"), default="auto",
                   help="the engine lane (encoder-gateway, vLLM and two encoders of their own); auto: where .venv-engines exists")
    p.add_argument("--engine-deadline-s", type=float, default=60.0, help="a chat request's deadline through the gateway")
    p.add_argument("--engine-mm-cache-gb", type=float,
                   help="vLLM's --mm-processor-cache-gb in the engine lane (default: vLLM's own, 4)")  # fmt: skip
    p.add_argument("--engine-preload", metavar="LIB",
                   help="a library vLLM's processes preload (LD_PRELOAD), e.g. libtcmalloc_minimal.so.4")  # fmt: skip
    p.add_argument("--json", type=Path, help="write the summary and the whole history here")
    p.add_argument("--logs", type=Path, help="copy the run's logs here when it ends, however it ends: each encoder "
                   "life's, and the engine lane's gateway and vLLM")  # fmt: skip
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp, small_shm_dir(Path(tmp), SHM_TMPFS_BYTES) as (shm_dir, tmpfs):
        os.environ["ENCODER_SHM_DIR"] = str(shm_dir)  # the servers (children) and the receivers
        soak = Soak(args, Path(tmp), shm_dir, tmpfs)
        try:
            summary = asyncio.run(soak.run())
        finally:
            if args.logs:
                copy_logs(Path(tmp), args.logs)
        if args.json:
            history = soak.history
            write_json(args.json, {"summary": summary, "requests": history.requests, "faults": history.faults,
                                   "samples": history.samples}, indent=None)  # fmt: skip
    print_json(summary)
    sys.exit(1 if summary["broken_invariants"] else 0)


if __name__ == "__main__":
    main()
