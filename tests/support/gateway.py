"""Helpers of the gateway tests: chat requests with images, and reading tokens and logprobs out of replies."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

# The request helpers live in testkit (benchmarks use them too); the gateway tests import them from here.
from testkit.chat import MAX_TOKENS, TOP_LOGPROBS, chat_request, data_url, engine_session, image_part  # noqa: F401
from testkit.images import image_bytes
from testkit.vllm_server import ENGINES_PYTHON, VllmServer, free_port, launch_vllm


@contextlib.contextmanager
def engine_server(model_dir: Path, log_dir: Path, extra_args: Sequence[str] = ()) -> Iterator[VllmServer]:
    """vLLM on `model_dir`; fails (never skips) without .venv-engines, since CI must run these tests."""
    if not ENGINES_PYTHON.exists():
        pytest.fail(f"{ENGINES_PYTHON} is missing: run ./scripts/setup_engines.sh (scripts/test.sh does)")
    with launch_vllm(model_dir, log_path=log_dir / "vllm.log", extra_args=extra_args) as server:
        yield server


async def answers(url: str, model: str, cases: dict[str, list[bytes]]) -> dict[str, list]:
    """The engine at `url`'s answer to each case: a chat request with the case's images (`complete`'s form)."""
    async with engine_session() as session:
        return {
            case: await complete(session, url, chat_request(model, [image_part(data) for data in images]))
            for case, images in cases.items()
        }


@contextlib.asynccontextmanager
async def running_gateway(engine_url: str | None, encoders: Sequence[str], **options: Any) -> AsyncIterator[str]:
    """encoder-gateway on 127.0.0.1 (an OS-chosen port) in front of `engine_url` (None: a port nothing
    listens on); yields its URL."""
    from gateway.app import start
    from gateway.config import GatewayConfig

    engine_url = engine_url or f"http://127.0.0.1:{free_port()}"
    runner, port = await start(
        GatewayConfig(engine_url=engine_url, encoders=tuple(encoders), host="127.0.0.1", port=0, **options)
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


# Where the families' checkpoints keep the vision side (tower, projector, LLaVA-NeXT's newline row): a tensor
# whose name has one of these is zeroed in the copies below.
VISION_WEIGHTS = ("visual.", "vision_tower.", "vision_model.", "multi_modal_projector.", "image_newline")


def zeroed_tower_copy(model_dir: Path, copy_dir: Path) -> Path:
    """A copy of the checkpoint with every vision weight zeroed: an engine on it cannot see, so it answers
    as vLLM alone does only when the embeddings come from elsewhere."""
    import shutil

    import torch

    from testkit.checkpoints import rewrite_tensors

    shutil.copytree(model_dir, copy_dir)
    zeroed = []

    def zero_visual(tensors):
        for name in tensors:
            if any(part in name for part in VISION_WEIGHTS):
                tensors[name] = torch.zeros_like(tensors[name])
                zeroed.append(name)
        return tensors

    rewrite_tensors(copy_dir, zero_visual)
    assert zeroed, "the checkpoint has no vision tower weights to zero"
    return copy_dir


def images(sizes: list[tuple[int, int]], seed: int = 0) -> list[bytes]:
    return [image_bytes(w, h, seed=seed + i) for i, (w, h) in enumerate(sizes)]


def _token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def _steps(logprob_content: list[dict[str, Any]]) -> list[tuple[int, float, dict[int, float]]]:
    return [
        (
            _token_id(step["token"]),
            step["logprob"],
            {_token_id(t["token"]): t["logprob"] for t in step["top_logprobs"]},
        )
        for step in logprob_content
    ]


async def complete(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> list[tuple[int, float, dict[int, float]]]:
    """POSTs a chat request and returns per generated token (id, logprob, {top id: logprob}), streamed or not."""
    async with session.post(f"{url}/v1/chat/completions", json=body) as reply:
        if reply.status != 200:
            raise AssertionError(f"{url} answered {reply.status}: {await reply.text()}")
        if not body.get("stream"):
            return _steps((await reply.json())["choices"][0]["logprobs"]["content"])
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        steps: list = []
        done = False
        async for line in reply.content:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                done = True
                continue
            choice = json.loads(line[6:])["choices"]
            if choice and choice[0].get("logprobs"):
                steps.extend(_steps(choice[0]["logprobs"]["content"]))
        assert done, "the stream ended without [DONE]"
        return steps


def logprob_gap(got: list, want: list) -> float:
    """Asserts the same token ids and top-logprob ids, and returns the largest logprob difference."""
    assert [step[0] for step in got] == [step[0] for step in want]
    worst = 0.0
    for (_, logprob, top), (_, want_logprob, want_top) in zip(got, want):
        worst = max(worst, abs(logprob - want_logprob))
        # Compare the tokens both top lists hold: a near-tie at the last rank may swap which one is listed.
        shared = top.keys() & want_top.keys()
        assert len(shared) >= TOP_LOGPROBS - 1, (top, want_top)
        worst = max([worst, *(abs(top[t] - want_top[t]) for t in shared)])
    return worst
