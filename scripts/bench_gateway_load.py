"""Concurrent chat requests of 1-3 images of mixed sizes, driven by vLLM's own serving benchmark (`vllm bench
serve`, random-mm dataset), against vLLM alone and through encoder-gateway (inline and connector hand-off),
from one run: throughput, TTFT and end-to-end latency percentiles per path, every request's success, and
its greedy token ids compared with vLLM alone's (the same requests sent again after the benchmark, since
`vllm bench serve` keeps only texts).

One vLLM (CPU build, .venv-engines) serves all three paths: it runs as `ec_consumer` with
`receiver.vllm.connector`, answers raw images with its own tower (the "vLLM alone" path) and takes the
gateways' embeddings. One encoder server process. Rounds interleave the paths; each round has its own
seed (the same requests for the three paths), and vLLM's prefix and multimodal caches and the encoder's
embedding cache are off, so no path is served from another's work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tooling

from gateway.app import start
from gateway.config import GatewayConfig
from testkit import REPO_ROOT
from testkit.bench_harness import (
    MachineLoad,
    add_record_flag,
    markdown_table,
    median,
    record_result,
    write_json,
)
from testkit.default_model import write_default_model
from testkit.launcher import launch_server
from testkit.vllm_server import ENGINES_PYTHON, connector_transfer_config, engines_env, launch_vllm

MODEL = "tiny"
PATHS = ("vllm", "inline", "connector")
LABELS = {"vllm": "vLLM alone (its own tower)", "inline": "gateway, inline", "connector": "gateway, connector"}
# Sides are multiples of 28 px (one merged Qwen2.5-VL token), so neither vLLM nor the encoder resizes.
BUCKETS = "{(224, 224, 1): 0.4, (336, 448, 1): 0.35, (560, 448, 1): 0.25}"
PERCENTILES = (50, 90, 99)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_gateway_load.py", description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=24, help="requests per path and round")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (--max-concurrency)")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs every path once, order rotated")
    p.add_argument("--output-len", type=int, default=8, help="tokens generated per request (greedy, ignore_eos)")
    p.add_argument("--input-len", type=int, default=32, help="random text tokens per request besides the images")
    p.add_argument("--out", type=Path, help="folder for vllm bench's result files and the summary (default: temp)")
    add_record_flag(p)
    return p


def bench_args(args, model_dir: Path, result_dir: Path) -> list[str]:
    """`vllm bench serve` arguments shared by every run: 1-3 images per request (2 +- 50%), mixed sizes."""
    return [
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--model", MODEL, "--tokenizer", str(model_dir),
        "--dataset-name", "random-mm", "--num-prompts", str(args.prompts),
        "--max-concurrency", str(args.concurrency),
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--random-range-ratio", "0",
        "--random-mm-base-items-per-request", "2", "--random-mm-num-mm-items-range-ratio", "0.5",
        "--random-mm-limit-mm-per-prompt", json.dumps({"image": 3, "video": 0}),
        "--random-mm-bucket-config", BUCKETS,
        "--temperature", "0", "--ignore-eos",
        "--percentile-metrics", "ttft,e2el", "--metric-percentiles", ",".join(map(str, PERCENTILES)),
        "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--disable-tqdm",
    ]  # fmt: skip


def seed(round_index: int) -> int:
    return 1000 + round_index


def plan_runs(rounds: int, urls: dict[str, str]) -> list[dict]:
    """Every path once per round, the order rotated each round; a round's seed is the same for its paths."""
    runs = []
    for round_index in range(rounds):
        shift = round_index % len(PATHS)
        for path in PATHS[shift:] + PATHS[:shift]:
            runs.append(
                {"base_url": urls[path], "result_filename": f"{path}-{round_index}.json",
                 "args": ["--seed", str(seed(round_index))]}
            )  # fmt: skip
    return runs


def summarize(rounds: int, result_dir: Path) -> dict[str, dict]:
    """Per path: medians over rounds of each figure, failures, and texts and token ids equal to vLLM alone's."""
    results = {
        (path, r): json.loads((result_dir / f"{path}-{r}.json").read_text()) for path in PATHS for r in range(rounds)
    }
    token_ids = json.loads((result_dir / "token-ids.json").read_text())
    summary = {}
    for path in PATHS:
        runs = [results[path, r] for r in range(rounds)]
        figures = {"request_throughput": "req/s", "output_throughput": "tok/s"}
        row = {name: median(run[name] for run in runs) for name in figures}
        for metric in ("ttft", "e2el"):
            for q in PERCENTILES:
                row[f"p{q}_{metric}_ms"] = median(run[f"p{q}_{metric}_ms"] for run in runs)
        row["requests"] = sum(len(run["generated_texts"]) for run in runs)
        row["failed"] = sum(run["failed"] for run in runs) + sum(bool(e) for run in runs for e in run["errors"])
        row["same_text_as_vllm"] = sum(
            ours == theirs
            for r in range(rounds)
            for ours, theirs in zip(results[path, r]["generated_texts"], results["vllm", r]["generated_texts"])
        )
        checked = [(ours, theirs) for r in range(rounds) for ours, theirs in
                   zip(token_ids[str(seed(r))][path], token_ids[str(seed(r))]["vllm"])]  # fmt: skip
        row["token_check_failed"] = sum(isinstance(ours, str) for ours, _ in checked)
        row["same_token_ids_as_vllm"] = sum(ours == theirs and isinstance(ours, list) for ours, theirs in checked)
        summary[path] = row
    return summary


def print_summary(summary: dict[str, dict], args) -> None:
    base = summary["vllm"]
    print(
        f"\n{args.rounds} rounds x {args.prompts} requests per path, concurrency {args.concurrency}, 1-3 images "
        f"of 224x224 / 448x336 / 448x560, {args.input_len} text tokens, {args.output_len} output tokens; "
        "medians over rounds:"
    )
    head = ["path", "req/s", "ratio"] + [f"TTFT p{q} ms" for q in PERCENTILES] + [f"E2E p{q} ms" for q in PERCENTILES]
    rows = []
    for path in PATHS:
        row = summary[path]
        cells = [LABELS[path], f"{row['request_throughput']:.2f}",
                 f"{row['request_throughput'] / base['request_throughput']:.2f}x"]
        cells += [f"{row[f'p{q}_ttft_ms']:.0f}" for q in PERCENTILES]
        cells += [f"{row[f'p{q}_e2el_ms']:.0f}" for q in PERCENTILES]
        cells += [str(row["failed"] + row["token_check_failed"]), f"{row['same_text_as_vllm']} / {row['requests']}",
                  f"{row['same_token_ids_as_vllm']} / {row['requests']}"]  # fmt: skip
        rows.append(cells)
    print("\n".join(markdown_table(head + ["failed", "same text", "same token ids"], rows)))


async def bench(args) -> int:
    load = MachineLoad()
    work = args.out or Path(tempfile.mkdtemp(prefix="bench-gateway-load-"))
    result_dir = work / "results"
    result_dir.mkdir(parents=True, exist_ok=True)
    model_dir = write_default_model(work / "model")
    with launch_server(model_dir, "--dtype", "float32", "--cache-bytes", "0", log_dir=work) as encoder:
        engine_flags = [
            "--served-model-name", MODEL, "--ec-transfer-config", connector_transfer_config([encoder.url]),
            "--no-enable-prefix-caching", "--mm-processor-cache-gb", "0",
        ]  # fmt: skip
        with launch_vllm(model_dir, log_path=work / "vllm.log", max_images=3, extra_args=engine_flags) as vllm:
            urls, runners = {"vllm": vllm.url}, []
            for handoff in ("inline", "connector"):
                config = GatewayConfig(
                    engine_url=vllm.url, encoders=(encoder.url,), host="127.0.0.1", port=0, handoff=handoff
                )
                runner, port = await start(config)
                runners.append(runner)
                urls[handoff] = f"http://127.0.0.1:{port}"
            plan_path = work / "plan.json"
            plan_path.write_text(
                json.dumps({
                    "args": bench_args(args, model_dir, result_dir),
                    "runs": plan_runs(args.rounds, urls),
                    "token_check": {"urls": urls, "seeds": [seed(r) for r in range(args.rounds)],
                                    "result": str(result_dir / "token-ids.json")},
                })  # fmt: skip
            )
            process = await asyncio.create_subprocess_exec(
                str(ENGINES_PYTHON), str(REPO_ROOT / "testkit" / "vllm_bench.py"), str(plan_path), env=engines_env()
            )
            status = await process.wait()
            for runner in runners:
                await runner.cleanup()
    if status != 0:
        print(f"vllm bench serve failed ({status}); logs in {work}", file=sys.stderr)
        return 1
    summary = summarize(args.rounds, result_dir)
    write_json(work / "summary.json", summary)
    if args.record:
        figures = {"args": {k: v for k, v in vars(args).items() if k not in ("record", "out")}, "paths": summary}
        print(f"wrote {record_result('gateway_load', figures, args.record, load=load)}")
    print_summary(summary, args)
    print(f"\nresult files: {result_dir}")
    clean = all(
        row["failed"] == row["token_check_failed"] == 0 and row["same_token_ids_as_vllm"] == row["requests"]
        for row in summary.values()
    )
    return 0 if clean else 1


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(bench(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
