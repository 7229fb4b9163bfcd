"""The soak's engine lane: encoder-gateway (inline hand-off) in front of a vLLM from .venv-engines, with two
encoder servers of its own on the built-in default model, each behind a relay that the fault schedule
reaches like the rest of the fleet.

Every chat request through the gateway is checked against the same vLLM answering the same bytes with its
own tower (greedy; the reference is asked once per image set): the same token ids, or a typed error (an
OpenAI-style error body with a status other than 500) within the deadline and its grace, which the soak
then judges by its cause (scripts/soak.py `failure_cause`): a request with a hostile image refused with 400,
or any request answered 503/504 while a fault held one of the lane's encoders (the encoders decode images:
as on the other nodes, a hostile item can meet no encoder to refuse it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class EngineLane:
    def __init__(
        self,
        workdir: Path,
        seed: int,
        encode_deadline_s: float,
        request_deadline_s: float,
        grace_s: float,
        mm_cache_gb: float | None = None,
        preload: str | None = None,
    ):
        """`mm_cache_gb`: vLLM's multimodal processor cache (its --mm-processor-cache-gb); None: vLLM's default.
        `preload`: a shared library vLLM's processes start with (LD_PRELOAD), e.g. an allocator."""
        self.workdir = workdir / "engine-lane"
        self.workdir.mkdir()
        self.rng = random.Random(seed + 5)
        self.encode_deadline_s = encode_deadline_s
        self.request_deadline_s = request_deadline_s
        self.grace_s = grace_s
        self.mm_cache_gb = mm_cache_gb
        self.preload = preload
        self.model_dir: Path | None = None
        self.references: dict[tuple, list[int]] = {}
        # The reference asks that vLLM alone did not answer (HTTP status or exception): nothing to compare.
        self.engine_alone_failures: collections.Counter[str] = collections.Counter()
        self.gateway: subprocess.Popen | None = None
        self.gateway_url = ""
        self.vllm = None
        self._stack = contextlib.ExitStack()
        self.pool = [
            (56 + 28 * (i % 9), 56 + 28 * ((i * 5) % 7), i) for i in range(24)
        ]  # (width, height, seed)
        self.weights = [1 / (rank + 1) for rank in range(len(self.pool))]
        self.fresh_seed = 10_000

    def write_model(self) -> Path:
        from testkit.default_model import write_default_model

        self.model_dir = write_default_model(self.workdir / "model")
        return self.model_dir

    def encoder_argv(self) -> list[str]:
        """The lane's encoder servers: the real server on the default model, float32 as the engine runs it."""
        from testkit.launcher import server_argv

        return server_argv(self.model_dir, "--dtype", "float32", "--shm-transfer", "--grace-seconds", "3")

    async def start_engine(self) -> None:
        from testkit.vllm_server import launch_vllm

        extra_args = ["--no-enable-prefix-caching"]
        if self.mm_cache_gb is not None:
            extra_args += ["--mm-processor-cache-gb", str(self.mm_cache_gb)]
        extra_env = {"LD_PRELOAD": self.preload} if self.preload else None
        engine = launch_vllm(
            self.model_dir, log_path=self.workdir / "vllm.log", extra_args=extra_args, extra_env=extra_env
        )
        self.vllm = await asyncio.to_thread(self._stack.enter_context, engine)

    async def start_gateway(self, encoder_urls: list[str]) -> None:
        from testkit.vllm_server import free_port, serving

        port = free_port()
        self.gateway_url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "gateway", "--engine-url", self.vllm.url, "--encoders", ",".join(encoder_urls),
                "--host", "127.0.0.1", "--port", str(port), "--handoff", "inline", "--placement", "affinity",
                "--encode-timeout", str(self.encode_deadline_s)]  # fmt: skip
        with (self.workdir / "gateway.log").open("w") as log:
            self.gateway = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
            )
        serving_cm = serving(
            self.gateway, self.gateway_url, self.workdir / "gateway.log", timeout=120, name="encoder-gateway"
        )
        await asyncio.to_thread(self._stack.enter_context, serving_cm)

    def processes(self) -> list[tuple[str, int]]:
        """(name, pid) of the gateway, vLLM's API server and every process under it (its engine core, the
        engine core's model worker), for the sampler."""
        procs = []
        if self.gateway is not None and self.gateway.poll() is None:
            procs.append(("gateway", self.gateway.pid))
        if self.vllm is not None and self.vllm.process.poll() is None:
            procs.append(("vllm", self.vllm.process.pid))
            for i, child in enumerate(_descendants(self.vllm.process.pid)):
                procs.append((f"vllm-child{i}-{_command_name(child)}", child))
        return procs

    def distinct_answers(self) -> int:
        return len({tuple(tokens) for tokens in self.references.values()})

    def close(self) -> None:
        self._stack.close()

    def request(self) -> tuple[list, list[bytes]]:
        """One request's images: one to three, Zipf-repeated from a pool or fresh, now and then a hostile one."""
        from testkit.images import image_bytes

        rng = self.rng
        items, data = [], []
        for _ in range(rng.choice([1, 1, 2, 3])):
            roll = rng.random()
            if roll < 0.05:
                items.append(["hostile", None])
                data.append(b"\x89PNG\r\n\x1a\n" + bytes(60))
                continue
            if roll < 0.75:
                image, kind = rng.choices(self.pool, self.weights)[0], "repeat"
            else:
                self.fresh_seed += 1
                image, kind = (rng.randrange(40, 400), rng.randrange(40, 300), self.fresh_seed), "fresh"
            items.append([kind, list(image)])
            data.append(image_bytes(*image))
        return items, data

    async def worker(self, soak) -> None:
        """Chat requests one after another until the soak stops, each recorded in the soak's history."""
        import aiohttp

        from testkit.chat import chat_request, engine_session, image_part

        n = 0
        # The reference asks go to vLLM: idle connections dropped before its keep-alive closes them.
        async with engine_session(self.request_deadline_s + self.grace_s) as session:
            while not soak.stop.is_set():
                n += 1
                items, data = self.request()
                body = chat_request(str(self.model_dir), [image_part(png) for png in data])
                hostile = any(kind == "hostile" for kind, _ in items)
                key = tuple(tuple(image) for _, image in items if image is not None)
                if not hostile and key not in self.references:
                    try:
                        status, answer = await _ask(session, self.vllm.url, body)
                    except (TimeoutError, aiohttp.ClientError) as exc:
                        status = type(exc).__name__
                    if status != 200:  # the engine alone failed: nothing to compare against; not ours to count
                        self.engine_alone_failures[str(status)] += 1
                        continue
                    self.references[key] = answer
                record = {"id": f"gateway-{n}", "node": "gateway", "items": items, "start": round(soak.now(), 3),
                          "during_fault": soak.active_faults > 0, "repeats": 0, "cache_hits": 0}  # fmt: skip
                start = asyncio.get_running_loop().time()
                try:
                    status, answer = await _ask(session, self.gateway_url, body)
                    record.update(self.judge(status, answer, hostile, self.references.get(key)), status=status)
                except TimeoutError:
                    record["outcome"] = "lost: no answer within the deadline and its grace"
                except aiohttp.ClientError as exc:
                    record["outcome"] = f"lost: untyped {type(exc).__name__}"
                    record["error"] = str(exc)[:300]
                record["seconds"] = round(asyncio.get_running_loop().time() - start, 4)
                soak.history.requests.append(record)

    @staticmethod
    def judge(status: int, answer, hostile: bool, reference: list[int] | None) -> dict:
        if status == 200:
            if hostile:
                return {"outcome": "wrong: a hostile item was answered", "wrong": 1}
            return {"outcome": "ok", "wrong": int(answer != reference)}
        message = answer.get("error", {}).get("message") if isinstance(answer, dict) else None
        if not message or status == 500:
            return {"outcome": f"lost: untyped HTTP {status}", "error": str(answer)[:300]}
        return {"outcome": "typed_error", "error": f"HTTP {status}: {message}"[:300]}


async def _ask(session, url: str, body: dict) -> tuple[int, object]:
    """(status, the generated token ids on 200, else the error body)."""
    async with session.post(f"{url}/v1/chat/completions", json=body) as reply:
        text = await reply.text()
        try:
            payload = json.loads(text)
        except ValueError:  # not JSON (aiohttp's own plain-text 500): judged by its status, the text kept
            payload = text
        if reply.status != 200:
            return reply.status, payload
        steps = payload["choices"][0]["logprobs"]["content"]
        return 200, [int(step["token"].removeprefix("token_id:")) for step in steps]


def _descendants(pid: int) -> list[int]:
    """Every process under `pid`, depth first."""
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return [found for child in children for found in (child, *_descendants(child))]


def _command_name(pid: int) -> str:
    """What the process calls itself (vLLM names its own: `VLLM::EngineCore`, `VLLM::Worker`)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip().removeprefix("VLLM::")
    except OSError:
        return "gone"
