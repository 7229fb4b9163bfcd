"""The benchmarks' shared harness: timing calls (after warm-up), medians and percentiles, ratios to a
baseline measured in the same run, measures run in interleaved rounds under a progress bar, the
printed tables and the JSON reports that every script under scripts/ writes.

It lives in testkit because every script already imports testkit from the repository root (each puts
the root on sys.path; tests have it there), so `python scripts/x.py` and a test that loads a script by
path both find it, and scripts/ needs no packaging.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
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
