"""Ours beside the engines' own disaggregated encoders, on the same checkpoint, the same requests and the same
machine: vLLM alone, vLLM's EPD (an `ec_producer` encoder instance and an `ec_consumer` instance with
`ECExampleConnector`, behind testkit/epd_proxy.py), our encoder server + encoder-gateway + vLLM (inline and
connector hand-offs), SGLang alone, SGLang's EPD (its `--encoder-only` server behind `--language-only`),
and our encoder server behind SGLang's `--language-only` server.

Each configuration is started in turn (nothing else runs beside it), warmed up, driven by vLLM's own serving
benchmark (`vllm bench serve`, random-mm: 1-4 images a request of several sizes, a fixed seed per rate) at
each request rate, asked the first rate's requests once more for their greedy tokens, and stopped. Every
process of a configuration shares the machine's cores; each has one encoder. The table gives each
figure as a ratio to the best peer (the engines' own configurations) in the same run, and whether each
configuration's tokens equal its engine alone's.

`--tower real` serves a checkpoint whose vision tower has Qwen2.5-VL-7B's width (and, with `--device cuda`,
its depth), so that the encode is real work; `--tower tiny` the built-in default model, where overheads
dominate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tooling

from testkit import REPO_ROOT
from testkit.bench_harness import markdown_table, write_json
from testkit.checkpoints import qwen2_5_vl_7b_tower
from testkit.default_model import write_default_model
from testkit.peers import CONFIGURATIONS, MAX_IMAGES, MODEL, PEERS, Context
from testkit.vllm_server import ENGINES_PYTHON, engines_env

BUCKETS = "{(224, 224, 1): 0.4, (448, 336, 1): 0.35, (560, 448, 1): 0.25}"
PERCENTILES = (50, 99)


# ------------------------------------------------------------------------------------------------ measuring


class ProcessTree:
    """The processes this script started (servers and their workers, any depth), less the benchmark client's
    own tree: their summed RSS sampled every half second (the peak is kept), and their CPU time on demand."""

    def __init__(self, exclude: Callable[[], int | None]):
        self.exclude, self.peak, self._stop = exclude, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, sum(_rss(pid) for pid in self.pids()))

    def pids(self) -> list[int]:
        parents: dict[int, int] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        found, frontier, exclude = [], [os.getpid()], self.exclude()
        while frontier:
            pid = frontier.pop()
            children = [child for child, parent in parents.items() if parent == pid and child != exclude]
            found += children
            frontier += children
        return found

    def cpu_seconds(self) -> dict[int, tuple[str, float]]:
        """Each process's name and the CPU time (user + system, all its threads) it has used so far."""
        seconds = {}
        for pid in self.pids():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                seconds[pid] = (_name(pid), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        return seconds


def _rss(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return 0


def _name(pid: int) -> str:
    """A process's title (vLLM names its workers), else the module or script its interpreter runs."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    if "python" not in Path(argv[0].split()[0]).name:
        return argv[0].split()[0]
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    return Path(argv[1]).name if len(argv) > 1 else argv[0]


def cpu_per_request(before: dict, after: dict, requests: int) -> dict[str, float]:
    """CPU seconds per completed request between two `cpu_seconds` readings, summed per process name."""
    spent: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        spent[name] = spent.get(name, 0.0) + seconds - before.get(pid, (name, 0.0))[1]
    return {name: value / max(requests, 1) for name, value in sorted(spent.items(), key=lambda kv: -kv[1])}


class Driver:
    """Runs testkit/vllm_bench.py (vLLM's serving benchmark, from the engines' venv) on a plan; remembers its
    pid so that ProcessTree leaves it out."""

    def __init__(self, work: Path):
        self.work, self.pid = work, None

    def run(self, plan: dict, name: str) -> None:
        path = self.work / f"plan-{name}.json"
        path.write_text(json.dumps(plan))
        with self.log(name).open("w") as log:
            process = subprocess.Popen([str(ENGINES_PYTHON), str(REPO_ROOT / "testkit" / "vllm_bench.py"), str(path)],
                                       stdout=log, stderr=subprocess.STDOUT, env=engines_env())  # fmt: skip
            self.pid = process.pid
            status = process.wait()
            self.pid = None
        if status != 0:
            raise RuntimeError(f"vllm bench serve failed: {self.log(name).read_text()[-2000:]}")

    def log(self, name: str) -> Path:
        return self.work / "logs" / f"bench-{name}.log"


def bench_args(args, ctx: Context) -> list[str]:
    """`vllm bench serve` arguments shared by every run: 1-4 images a request of three sizes, greedy."""
    return [
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--model", MODEL,
        "--tokenizer", str(ctx.model_dir), "--dataset-name", "random-mm",
        "--random-input-len", "32", "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
        "--random-mm-base-items-per-request", "3", "--random-mm-num-mm-items-range-ratio", "0.6",
        "--random-mm-limit-mm-per-prompt", json.dumps({"image": MAX_IMAGES, "video": 0}),
        "--random-mm-bucket-config", BUCKETS, "--temperature", "0", "--ignore-eos",
        "--percentile-metrics", "ttft,e2el", "--metric-percentiles", ",".join(map(str, PERCENTILES)),
        "--save-result", "--save-detailed", "--result-dir", str(ctx.work / "results"), "--disable-tqdm",
    ]  # fmt: skip


def measure(name: str, args, ctx: Context, driver: Driver) -> dict:
    """Starts configuration `name`, warms it up, drives it at every rate, asks for its tokens, stops it."""
    common = bench_args(args, ctx)
    _, start = CONFIGURATIONS[name]
    with ProcessTree(lambda: driver.pid) as tree, start(ctx) as running:
        warmup = {"base_url": running.url, "result_filename": f"{name}-warmup.json",
                  "args": ["--num-prompts", str(args.warmup), "--seed", "1"]}  # fmt: skip
        driver.run({"args": common, "runs": [warmup]}, f"{name}-warmup")
        before = running.images_encoded() if running.images_encoded else None
        cpu_before = tree.cpu_seconds()
        runs = [{"base_url": running.url, "result_filename": f"{name}-rate{i}.json",
                 "args": ["--num-prompts", str(args.prompts), "--request-rate", rate, "--seed", str(100 + i)]}
                for i, rate in enumerate(args.rates)]  # fmt: skip
        driver.run({"args": common, "runs": runs}, f"{name}-rates")
        cpu_after = tree.cpu_seconds()
        encoded = running.images_encoded() - before if running.images_encoded else None
        tokens = ctx.work / "results" / f"{name}-tokens.json"
        check = {"urls": {name: running.url}, "seeds": [100], "result": str(tokens)}
        driver.run(
            {"args": [*common, "--num-prompts", str(args.prompts)], "runs": [], "token_check": check},
            f"{name}-tokens",
        )
    results = [json.loads((ctx.work / "results" / run["result_filename"]).read_text()) for run in runs]
    seconds = sum(result["duration"] for result in results)
    cpu = cpu_per_request(cpu_before, cpu_after, sum(result["completed"] for result in results))
    return {
        "rates": {rate: _row(result) for rate, result in zip(args.rates, results)},
        "encoder_images_per_s": None if encoded is None else encoded / seconds,
        "peak_rss_gib": tree.peak / 2**30,
        "cpu_s_per_request": sum(cpu.values()),
        "cpu_s_per_request_by_process": cpu,
        "tokens": json.loads(tokens.read_text())["100"][name],
    }


def _row(result: dict) -> dict:
    return {
        "completed": result["completed"],
        "failed": result["failed"],
        "req_per_s": result["request_throughput"],
        "ttft_p50_ms": result["p50_ttft_ms"],
        "ttft_p99_ms": result["p99_ttft_ms"],
        "e2e_p99_ms": result["p99_e2el_ms"],
    }


# ---------------------------------------------------------------------------------------------------- report

COLUMNS = (  # key, heading, better
    ("req_per_s", "req/s", max),
    ("ttft_p50_ms", "TTFT p50 ms", min),
    ("ttft_p99_ms", "TTFT p99 ms", min),
    ("e2e_p99_ms", "E2E p99 ms", min),
)


def same_tokens(report: dict, name: str) -> str:
    reference = report[CONFIGURATIONS[name][0]]
    if "error" in reference or "error" in report[name]:
        return "–"
    ours, theirs = report[name]["tokens"], reference["tokens"]
    equal = sum(a == b and isinstance(a, list) for a, b in zip(ours, theirs))
    return f"{equal} / {len(theirs)}"


def print_table(report: dict, rates: list[str], title: str) -> None:
    print(f"\n### {title}\n")
    heads = ["configuration", "completed"] + [f"{h} (x best peer)" for _, h, _ in COLUMNS]
    heads += ["encoder images/s", "CPU s / request", "peak RSS GiB", "same tokens as its engine alone"]
    for rate in rates:
        rows = {name: entry["rates"][rate] for name, entry in report.items() if "error" not in entry}
        best = {key: better(rows[p][key] for p in PEERS if p in rows) for key, _, better in COLUMNS
                if any(p in rows for p in PEERS)}  # fmt: skip
        cells = []
        for name, entry in report.items():
            if "error" in entry:
                cells.append([name, f"failed: {entry['error']}"] + [""] * (len(heads) - 2))
                continue
            row = rows[name]
            line = [name, f"{row['completed']} ({row['failed']} failed)"]
            line += [f"{row[key]:.1f} ({row[key] / best[key]:.2f}x)" if best.get(key) else f"{row[key]:.1f}"
                     for key, _, _ in COLUMNS]  # fmt: skip
            images = entry["encoder_images_per_s"]
            line += [
                "–" if images is None else f"{images:.1f}",
                f"{entry['cpu_s_per_request']:.2f}",
                f"{entry['peak_rss_gib']:.2f}",
                same_tokens(report, name),
            ]
            cells.append(line)
        print(f"request rate {rate}/s:\n")
        print("\n".join(markdown_table(heads, cells)) + "\n")
    print("CPU seconds per request (all rates), by process:\n")
    for name, entry in report.items():
        if "error" not in entry:
            parts = ", ".join(f"{proc} {s:.3f}" for proc, s in entry["cpu_s_per_request_by_process"].items())
            print(f"- {name}: {parts}")


def tower_model(tower: str, device: str, work: Path) -> Path:
    if tower == "tiny":
        return write_default_model(work / "model-tiny")
    depth = 32 if device == "cuda" else 1  # one real-width block on a CPU: the encode is real work, not hours
    return write_default_model(
        work / "model-real", hidden_size=3584, vision_config=qwen2_5_vl_7b_tower(depth)
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_peers.py", description=__doc__.splitlines()[0])
    p.add_argument("--tower", choices=("tiny", "real", "both"), default="both")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--rates", default="1,4,inf", help="request rates per second, comma-separated ('inf': all at once)"
    )
    p.add_argument("--prompts", type=int, default=24, help="requests per rate")
    p.add_argument("--warmup", type=int, default=4, help="requests before the measured ones, not counted")
    p.add_argument(
        "--output-len", type=int, default=8, help="tokens generated per request (greedy, ignore_eos)"
    )
    p.add_argument("--configurations", default=",".join(CONFIGURATIONS), help="which, comma-separated")
    p.add_argument("--out", type=Path, help="folder for logs, result files and report.json (default: temp)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.rates = args.rates.split(",")
    work = args.out or Path(tempfile.mkdtemp(prefix="bench-peers-"))
    reports = {}
    for tower in ("tiny", "real") if args.tower == "both" else (args.tower,):
        tower_work = work / tower  # its model, logs, result files and EPD storage
        (tower_work / "logs").mkdir(parents=True, exist_ok=True)
        (tower_work / "results").mkdir(exist_ok=True)
        dtype = "bfloat16" if args.device == "cuda" else "float32"
        ctx = Context(tower_model(tower, args.device, tower_work), tower_work, args.device, dtype)
        driver = Driver(tower_work)
        report = reports[tower] = {}
        for name in args.configurations.split(","):
            began = time.monotonic()
            try:
                report[name] = measure(name, args, ctx, driver)
            except Exception as error:  # noqa: BLE001 (a peer that fails is reported, and the run goes on)
                report[name] = {
                    "error": str(error).strip().splitlines()[-1][:300] if str(error).strip() else repr(error)
                }
            print(
                f"{tower} / {name}: {time.monotonic() - began:.0f} s",
                "failed" if "error" in report[name] else "",
                flush=True,
            )
        write_json(work / "report.json", reports)
    for tower, report in reports.items():
        print_table(report, args.rates, f"{tower} tower, {args.device}")
    print(f"logs and result files: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
