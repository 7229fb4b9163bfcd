"""Ours beside the engines' own disaggregated encoders, on the same checkpoint, the same requests and the same
machine: vLLM alone, vLLM's EPD (an `ec_producer` encoder instance and an `ec_consumer` instance with
`ECExampleConnector`, behind testkit/epd_proxy.py), our encoder server + encoder-gateway + vLLM (inline and
connector hand-offs), SGLang alone, SGLang's EPD (its `--encoder-only` server behind `--language-only`),
and our encoder server behind SGLang's `--language-only` server.

Each configuration is started in turn (nothing else of the benchmark runs beside it), warmed up, driven by
vLLM's own serving benchmark (`vllm bench serve`, random-mm: images of the tower's sizes, a seed per rate
and repeat) at each request rate, `--repeats` times, asked the first rate's requests once more for their
greedy tokens, and stopped. Every request sent is counted from the benchmark's per-request record: completed,
failed by kind, and within the tower's SLO (TTFT and end-to-end) or not; percentiles are over every request,
a failed one counted as missing its SLO (where `vllm bench serve` leaves failures out). Each figure is the
median of the repeats with their range, and its ratio to the best peer (the engines' own configurations) in
the same run; each configuration's tokens are compared with its engine alone's.

The machine's load is recorded: before anything starts (a busy machine refuses the run unless
`--allow-busy`) and over each repeat, as the cores that processes other than the benchmark's kept busy
(a repeat over `--max-other-cores` is flagged in the table and the report).

`--tower tiny`: the built-in default model, where overheads dominate; `--tower real`: a checkpoint whose
vision tower is Qwen2.5-VL-7B's (32 blocks at its width), before a one-layer language model, with small
images so that a CPU run ends in hours; `both` (the default) runs the two one after the other.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Self

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tooling

from testkit import REPO_ROOT
from testkit.bench_harness import Stopwatch, markdown_table, percentile, write_json
from testkit.checkpoints import qwen2_5_vl_7b_tower
from testkit.default_model import write_default_model
from testkit.peers import CONFIGURATIONS, MAX_IMAGES, MODEL, PEERS, Context
from testkit.vllm_server import ENGINES_PYTHON, engines_env

PERCENTILES = (50, 99)
TOKEN_CHECK_SEED = 100  # the first rate's requests of the first repeat
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Tower:
    """A checkpoint's tower and the load it is measured under: image sizes (random-mm buckets, (height,
    width, frames): probability), images a request (random-mm's base count and range ratio), request rates,
    and the service level a request must meet to count as goodput."""

    buckets: str
    images: tuple[int, float]
    rates: str
    slo_ttft_ms: float
    slo_e2e_ms: float


TOWERS = {
    # 1-4 images of up to 560x448 (the default model's tower costs 17-56 ms an image on one thread).
    "tiny": Tower("{(224, 224, 1): 0.4, (448, 336, 1): 0.35, (560, 448, 1): 0.25}", (3, 0.6), "1,4,inf", 1000, 2000),
    # 1-3 images of 16 or 36 patches: at so few, a forward of Qwen2.5-VL-7B's 32 blocks (677M parameters) costs
    # about what reading its 2.7 GB of float32 weights does, whatever the image's size; bigger images add hours.
    "real": Tower("{(56, 56, 1): 0.6, (84, 84, 1): 0.4}", (2, 0.5), "0.5,inf", 6000, 8000),
}


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

    def pids(self, everything: bool = False) -> list[int]:
        """Every process under this one, less the benchmark client's tree unless `everything`."""
        parents: dict[int, int] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        found, frontier, exclude = [], [os.getpid()], None if everything else self.exclude()
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
                seconds[pid] = (_name(pid), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
        return seconds

    def all_cpu_seconds(self) -> float:
        """CPU time of everything this benchmark runs: this process, its live descendants (the client's
        included) with the children each of them has reaped, and the children this process has reaped."""
        total = 0.0
        for pid in self.pids(everything=True):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += sum(int(value) for value in fields[11:15]) / CLOCK_TICKS  # utime stime cutime cstime
        own = resource.getrusage(resource.RUSAGE_SELF)
        reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
        return total + own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


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


def machine_busy_seconds() -> float:
    """CPU time the whole machine has spent busy (every core, everything but idle and iowait), from /proc/stat."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


class OtherLoad:
    """The cores that processes other than this benchmark's kept busy over a stretch: the machine's busy time
    less the benchmark's own (`ProcessTree.all_cpu_seconds`), over the wall time. A process of the benchmark
    that ends unreaped inside the stretch takes its CPU time with it and reads as other load: an upper bound."""

    def __init__(self, tree: ProcessTree):
        self.tree = tree
        self.cores: float | None = None

    def __enter__(self) -> Self:
        self._watch, self._busy, self._ours = Stopwatch(), machine_busy_seconds(), self.tree.all_cpu_seconds()
        return self

    def __exit__(self, *_) -> None:
        other = machine_busy_seconds() - self._busy - (self.tree.all_cpu_seconds() - self._ours)
        self.cores = max(0.0, other / self._watch.seconds())


def other_load_now(seconds: float = 3.0) -> dict:
    """The machine before the benchmark starts anything: load averages, and the cores others kept busy."""
    with ProcessTree(lambda: None) as tree, OtherLoad(tree) as load:
        time.sleep(seconds)
    return {"load_average": os.getloadavg(), "other_cores": round(load.cores, 2), "cpus": os.cpu_count()}


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


def bench_args(args, ctx: Context, tower: Tower) -> list[str]:
    """`vllm bench serve` arguments shared by every run: the tower's images, greedy, per-request records kept."""
    base, ratio = tower.images
    return [
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--model", MODEL,
        "--tokenizer", str(ctx.model_dir), "--dataset-name", "random-mm",
        "--random-input-len", "32", "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
        "--random-mm-base-items-per-request", str(base), "--random-mm-num-mm-items-range-ratio", str(ratio),
        "--random-mm-limit-mm-per-prompt", json.dumps({"image": MAX_IMAGES, "video": 0}),
        "--random-mm-bucket-config", tower.buckets, "--temperature", "0", "--ignore-eos",
        "--percentile-metrics", "ttft,e2el", "--metric-percentiles", ",".join(map(str, PERCENTILES)),
        "--save-result", "--save-detailed", "--result-dir", str(ctx.work / "results"), "--disable-tqdm",
    ]  # fmt: skip


def measure(name: str, args, ctx: Context, driver: Driver, tower: Tower) -> dict:
    """Starts configuration `name`, warms it up, drives it at every rate `--repeats` times (a seed per rate
    and repeat: no repeat meets a cache the one before filled), asks for its tokens, stops it."""
    common = bench_args(args, ctx, tower)
    _, start = CONFIGURATIONS[name]
    rates = tower.rates.split(",")
    repeats = []
    with ProcessTree(lambda: driver.pid) as tree, start(ctx) as running:
        warmup = {"base_url": running.url, "result_filename": f"{name}-warmup.json",
                  "args": ["--num-prompts", str(args.warmup), "--seed", "1"]}  # fmt: skip
        driver.run({"args": common, "runs": [warmup]}, f"{name}-warmup")
        before = running.images_encoded() if running.images_encoded else None
        cpu_before = tree.cpu_seconds()
        for repeat in range(args.repeats):
            runs = [{"base_url": running.url, "result_filename": f"{name}-repeat{repeat}-rate{i}.json",
                     "args": ["--num-prompts", str(args.prompts), "--request-rate", rate,
                              "--seed", str(TOKEN_CHECK_SEED + 10 * repeat + i)]}
                    for i, rate in enumerate(rates)]  # fmt: skip
            with OtherLoad(tree) as load:
                driver.run({"args": common, "runs": runs}, f"{name}-repeat{repeat}")
            results = [json.loads((ctx.work / "results" / run["result_filename"]).read_text()) for run in runs]
            repeats.append({"other_cores": round(load.cores, 2), "seconds": sum(r["duration"] for r in results),
                            "rates": {rate: counted(result, tower) for rate, result in zip(rates, results)}})  # fmt: skip
        cpu_after = tree.cpu_seconds()
        encoded = running.images_encoded() - before if running.images_encoded else None
        tokens = ctx.work / "results" / f"{name}-tokens.json"
        check = {"urls": {name: running.url}, "seeds": [TOKEN_CHECK_SEED], "result": str(tokens)}
        driver.run(
            {"args": [*common, "--num-prompts", str(args.prompts)], "runs": [], "token_check": check},
            f"{name}-tokens",
        )
    seconds = sum(repeat["seconds"] for repeat in repeats)
    completed = sum(row["completed"] for repeat in repeats for row in repeat["rates"].values())
    cpu = cpu_per_request(cpu_before, cpu_after, completed)
    return {
        "rates": {rate: spread([repeat["rates"][rate] for repeat in repeats]) for rate in rates},
        "repeats": repeats,
        "other_cores_max": max(repeat["other_cores"] for repeat in repeats),
        "encoder_images_per_s": None if encoded is None else encoded / seconds,
        "peak_rss_gib": tree.peak / 2**30,
        "cpu_s_per_request": sum(cpu.values()),
        "cpu_s_per_request_by_process": cpu,
        "tokens": json.loads(tokens.read_text())[str(TOKEN_CHECK_SEED)][name],
    }


def failure_kind(error: str) -> str:
    """What a failed request of `vllm bench serve` met: the HTTP reason it got (e.g. "Service Unavailable"),
    the exception the client raised (the last line of its traceback), or no token at all."""
    if error.startswith("Never received a valid chunk"):
        return "no token streamed"
    lines = [line for line in error.strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Traceback"):
        return lines[-1].split(":", 1)[0].rsplit(".", 1)[-1]
    return lines[0][:80] if lines else "no reason given"


def counted(result: dict, tower: Tower) -> dict:
    """One run's every request, from the benchmark's per-request record: completed, failed by kind, within the
    SLO; throughput and goodput; TTFT and end-to-end percentiles over all of them, a failed request counting
    as missing its SLO (an infinite time: a percentile that lands on one is None, "missed")."""
    errors = result["errors"]
    ok = [not error for error in errors]
    ttft_ms = [ttft * 1000 if good else math.inf for ttft, good in zip(result["ttfts"], ok)]
    e2e_ms = [latency * 1000 if good else math.inf for latency, good in zip(result["latencies"], ok)]
    within = sum(t <= tower.slo_ttft_ms and e <= tower.slo_e2e_ms for t, e in zip(ttft_ms, e2e_ms))
    duration = result["duration"]

    def pct(values: list[float], q: int) -> float | None:
        value = percentile(values, q / 100)
        return None if math.isinf(value) else value

    return {
        "requests": len(errors),
        "completed": sum(ok),
        "failed": len(errors) - sum(ok),
        "failed_by_kind": dict(collections.Counter(failure_kind(e) for e in errors if e)),
        "within_slo": within,
        "req_per_s": sum(ok) / duration,
        "goodput_req_per_s": within / duration,
        **{f"ttft_p{q}_ms": pct(ttft_ms, q) for q in PERCENTILES},
        **{f"e2e_p{q}_ms": pct(e2e_ms, q) for q in PERCENTILES},
    }


def spread(rows: list[dict]) -> dict:
    """The repeats of one rate: the requests and failures summed, each figure's median, min and max (a missed
    percentile, None, counts as longer than any time)."""
    out = {"requests": sum(r["requests"] for r in rows), "completed": sum(r["completed"] for r in rows),
           "failed": sum(r["failed"] for r in rows), "within_slo": sum(r["within_slo"] for r in rows),
           "failed_by_kind": dict(sum((collections.Counter(r["failed_by_kind"]) for r in rows), collections.Counter()))}  # fmt: skip
    for key, _, _ in COLUMNS:
        values = [math.inf if r[key] is None else r[key] for r in rows]
        figures = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        out[key] = {name: None if math.isinf(value) else value for name, value in figures.items()}
    return out


# ---------------------------------------------------------------------------------------------------- report

COLUMNS = (  # key, heading, better
    ("req_per_s", "req/s", max),
    ("goodput_req_per_s", "goodput req/s", max),
    ("ttft_p50_ms", "TTFT p50 ms", min),
    ("ttft_p99_ms", "TTFT p99 ms", min),
    ("e2e_p99_ms", "E2E p99 ms", min),
)


def same_tokens(report: dict, name: str) -> str:
    """Its tokens against its engine alone's, for every configuration but the engine alone itself."""
    reference = CONFIGURATIONS[name][0]
    if reference == name:
        return "(the reference)"
    if reference not in report or "error" in report[reference]:
        return "no reference"
    if "error" in report[name]:
        return "–"
    ours, theirs = report[name]["tokens"], report[reference]["tokens"]
    equal = sum(a == b and isinstance(a, list) for a, b in zip(ours, theirs))
    return f"{equal} / {len(theirs)}"


def _figure(cell: dict, best: float | None) -> str:
    """median (min-max) and its ratio to the best peer's median; "missed" where failed requests set it."""

    def text(value: float | None) -> str:
        return "missed" if value is None else f"{value:.1f}"

    out = text(cell["median"])
    if cell["min"] != cell["max"]:
        out += f" ({text(cell['min'])}-{text(cell['max'])})"
    if best and cell["median"] is not None:
        out += f", {cell['median'] / best:.2f}x"
    return out


def print_table(report: dict, title: str, tower: Tower, repeats: int, max_other_cores: float) -> None:
    print(f"\n### {title}\n")
    print(f"SLO: TTFT <= {tower.slo_ttft_ms:.0f} ms and end-to-end <= {tower.slo_e2e_ms:.0f} ms. Each figure: "
          f"the median of {repeats} repeats (their range), x the best peer's median.\n")  # fmt: skip
    heads = ["configuration", "requests: completed / failed (by kind)", "within SLO"]
    heads += [heading for _, heading, _ in COLUMNS]
    heads += ["encoder images/s", "CPU s / request", "peak RSS GiB", "other load (cores)", "same tokens as its engine alone"]
    for rate in tower.rates.split(","):
        rows = {name: entry["rates"][rate] for name, entry in report.items() if "error" not in entry}
        best = {}
        for key, _, better in COLUMNS:
            medians = [rows[p][key]["median"] for p in PEERS if p in rows and rows[p][key]["median"] is not None]
            best[key] = better(medians) if medians else None
        cells = []
        for name, entry in report.items():
            if "error" in entry:
                cells.append([name, f"failed: {entry['error']}"] + [""] * (len(heads) - 2))
                continue
            row = rows[name]
            kinds = ", ".join(f"{count} {kind}" for kind, count in row["failed_by_kind"].items())
            line = [name, f"{row['requests']}: {row['completed']} / {row['failed']}" + (f" ({kinds})" if kinds else ""),
                    f"{row['within_slo'] / row['requests']:.0%}"]  # fmt: skip
            line += [_figure(row[key], best[key]) for key, _, _ in COLUMNS]
            images = entry["encoder_images_per_s"]
            busy = entry["other_cores_max"] > max_other_cores
            line += [
                "–" if images is None else f"{images:.1f}",
                f"{entry['cpu_s_per_request']:.2f}",
                f"{entry['peak_rss_gib']:.2f}",
                f"{entry['other_cores_max']:.2f}" + (" (busy)" if busy else ""),
                same_tokens(report, name),
            ]
            cells.append(line)
        print(f"request rate {rate}/s:\n")
        print("\n".join(markdown_table(heads, cells)) + "\n")
    print("CPU seconds per request (all rates and repeats), by process:\n")
    for name, entry in report.items():
        if "error" not in entry:
            parts = ", ".join(f"{proc} {s:.3f}" for proc, s in entry["cpu_s_per_request_by_process"].items())
            print(f"- {name}: {parts}")


def error_summary(error: Exception) -> str:
    """What stopped a configuration, in a line: what failed ("encoder-gateway did not start") and the last line
    of the log or traceback that came with it."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return repr(error)
    return (lines[0] if len(lines) == 1 else f"{lines[0].rstrip(':')}: {lines[-1].strip()}")[:300]


def tower_model(tower: str, work: Path) -> Path:
    if tower == "tiny":
        return write_default_model(work / "model-tiny")
    return write_default_model(work / "model-real", hidden_size=3584, vision_config=qwen2_5_vl_7b_tower(32))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_peers.py", description=__doc__.splitlines()[0])
    p.add_argument("--tower", choices=("tiny", "real", "both"), default="both")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rates", help="request rates per second, comma-separated ('inf': all at once); "
                   "default: the tower's (tiny 1,4,inf; real 0.5,inf)")  # fmt: skip
    p.add_argument("--prompts", type=int, default=100, help="requests per rate and repeat")
    p.add_argument("--repeats", type=int, default=3, help="times every rate is run, each with requests of its own")
    p.add_argument("--warmup", type=int, default=4, help="requests before the measured ones, not counted")
    p.add_argument(
        "--output-len", type=int, default=8, help="tokens generated per request (greedy, ignore_eos)"
    )
    p.add_argument("--slo-ttft-ms", type=float, help="goodput's TTFT bound (default: the tower's, tiny 1000, real 6000)")
    p.add_argument("--slo-e2e-ms", type=float, help="goodput's end-to-end bound (default: tiny 2000, real 8000)")
    p.add_argument("--max-other-cores", type=float, default=0.3,
                   help="cores other processes may keep busy: more before the run refuses it, during a repeat flags it")  # fmt: skip
    p.add_argument("--allow-busy", action="store_true", help="run on a busy machine anyway (its repeats flagged)")
    p.add_argument("--configurations", default=",".join(CONFIGURATIONS), help="which, comma-separated")
    p.add_argument("--out", type=Path, help="folder for logs, result files and report.json (default: temp)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    before = other_load_now()
    if before["other_cores"] > args.max_other_cores and not args.allow_busy:
        print(f"refused: other processes kept {before['other_cores']:.2f} cores busy (load average "
              f"{before['load_average'][0]:.1f}); wait for a quiet machine or pass --allow-busy", file=sys.stderr)  # fmt: skip
        return 2
    work = args.out or Path(tempfile.mkdtemp(prefix="bench-peers-"))
    towers = ("tiny", "real") if args.tower == "both" else (args.tower,)
    reports: dict = {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "machine_before": before,
                     "settings": {"prompts": args.prompts, "repeats": args.repeats, "warmup": args.warmup,
                                  "output_len": args.output_len, "device": args.device}, "towers": {}}  # fmt: skip
    for name in towers:
        tower = TOWERS[name]
        tower = Tower(tower.buckets, tower.images, args.rates or tower.rates,
                      args.slo_ttft_ms or tower.slo_ttft_ms, args.slo_e2e_ms or tower.slo_e2e_ms)  # fmt: skip
        tower_work = work / name  # its model, logs, result files and EPD storage
        (tower_work / "logs").mkdir(parents=True, exist_ok=True)
        (tower_work / "results").mkdir(exist_ok=True)
        dtype = "bfloat16" if args.device == "cuda" else "float32"
        ctx = Context(tower_model(name, tower_work), tower_work, args.device, dtype)
        driver = Driver(tower_work)
        report = {}
        reports["towers"][name] = {"tower": asdict(tower), "configurations": report}
        for configuration in args.configurations.split(","):
            began = time.monotonic()
            try:
                report[configuration] = measure(configuration, args, ctx, driver, tower)
            except Exception as error:  # noqa: BLE001 (a peer that fails is reported, and the run goes on)
                report[configuration] = {"error": error_summary(error)}
            print(
                f"{name} / {configuration}: {time.monotonic() - began:.0f} s",
                "failed" if "error" in report[configuration] else "",
                flush=True,
            )
            write_json(work / "report.json", reports)
    reports["machine_after"] = {"load_average": os.getloadavg()}
    write_json(work / "report.json", reports)
    for name, entry in reports["towers"].items():
        tower = Tower(**entry["tower"])
        print_table(entry["configurations"], f"{name} tower, {args.device}", tower, args.repeats, args.max_other_cores)
    print(f"logs and result files: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
