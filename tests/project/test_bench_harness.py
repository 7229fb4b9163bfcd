"""testkit/bench_harness.py, the timing and reporting every benchmark script shares: stages timed one
after another, warm-up runs left out, ratios paired within a round, nearest-rank percentiles, rounds
in a changing order, the tables and JSON the scripts print and write, and the result files the docs are
drawn from."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from testkit.bench_harness import (
    MachineLoad,
    Stopwatch,
    add_record_flag,
    aligned_table,
    interleaved,
    markdown_table,
    median,
    paired_ratio,
    percentile,
    process_cpu_seconds,
    record_result,
    repeat_async,
    stage_medians,
    write_json,
)


def test_laps_time_consecutive_stages_that_add_up_to_the_whole():
    watch, whole = Stopwatch(), Stopwatch()
    time.sleep(0.02)
    first = watch.lap()
    second = watch.lap()
    assert first >= 0.02 and second < 0.02
    assert abs(first + second - whole.seconds()) < 0.01


async def test_warm_up_runs_are_made_but_not_timed():
    calls = []

    async def run() -> None:
        calls.append(len(calls))
        await asyncio.sleep(0.01 if len(calls) > 2 else 0.0)

    samples = await repeat_async(run, repeats=3, warmup=2)
    assert len(calls) == 5 and len(samples) == 3 and all(s >= 0.01 for s in samples)


def test_a_paired_ratio_cancels_drift_that_a_ratio_of_medians_keeps():
    ours, baseline = [1.0, 10.0, 100.0], [1.0, 5.0, 100.0]  # round 2 ran twice as fast as its baseline only
    assert paired_ratio(ours, baseline) == 1.0
    assert median(ours) / median(baseline) == 2.0


def test_percentiles_are_nearest_rank_values_of_the_sample():
    values = list(range(100, 0, -1))  # 100 .. 1, unsorted on purpose
    assert percentile(values, 0.99) == 100 and percentile(values, 0.5) == 51
    assert percentile([7.0], 0.99) == 7.0


def test_a_total_is_the_median_of_each_rounds_sum_not_the_sum_of_medians():
    rounds = [{"a": 1, "b": 10}, {"a": 10, "b": 1}, {"a": 5, "b": 5}]
    assert stage_medians(rounds, ("a", "b")) == {"a": 5, "b": 5, "total": 11}


async def test_every_measure_runs_once_a_round_in_an_order_that_changes():
    order: list[str] = []

    def measure(name: str):
        async def run() -> float:
            order.append(name)
            return float(len(order))

        return run

    names = [f"m{i}" for i in range(6)]
    runs = await interleaved("test", 3, {name: measure(name) for name in names})
    assert all(len(runs[name]) == 3 for name in names)
    rounds = [order[i : i + 6] for i in range(0, 18, 6)]
    assert all(sorted(r) == names for r in rounds) and len({tuple(r) for r in rounds}) > 1


def test_tables_align_their_columns_and_markdown_has_its_rule():
    lines = aligned_table(("figure", "ours"), [("a long figure name", "1.00x"), ("b", "2.00x")])
    assert lines[1] == "-" * len("a long figure name") + "-+-" + "-" * len("1.00x")
    assert len({line.index("|") for line in lines if "|" in line}) == 1
    assert markdown_table(["path", "req/s"], [["vLLM", "1.0"]]) == [
        "| path | req/s |",
        "| --- | --- |",
        "| vLLM | 1.0 |",
    ]


def test_a_report_is_written_with_its_folder_and_read_back(tmp_path):
    path = tmp_path / "runs" / "bench.json"
    write_json(path, {"ratio": 1.5, "runs": [1, 2]})
    assert path.read_text().endswith("}\n") and json.loads(path.read_text()) == {"ratio": 1.5, "runs": [1, 2]}


def test_cpu_seconds_of_a_process_grow_while_it_computes():
    before = process_cpu_seconds(os.getpid())
    watch = Stopwatch()
    while watch.seconds() < 0.2:
        sum(range(10_000))
    assert process_cpu_seconds(os.getpid()) > before


def test_a_result_file_holds_the_figures_with_machine_load_date_commit_and_command(tmp_path):
    load = MachineLoad(interval_s=0.05)
    time.sleep(0.2)
    path = record_result(
        "probe", {"ratio": 1.5, "where": tmp_path}, tmp_path, load=load, command="python x.py"
    )
    document = json.loads(path.read_text())
    assert path == tmp_path / "probe.json" and document["benchmark"] == "probe"
    assert document["result"] == {"ratio": 1.5, "where": str(tmp_path)}  # paths written as text
    assert document["command"] == "python x.py" and len(document["commit"]) == 40
    assert document["date"] == document["started_utc"][:10] and isinstance(document["checkout_changed"], bool)
    assert document["machine"]["cores"] == os.cpu_count() and document["machine"]["memory_gib"] > 0
    assert document["machine"]["packages"]["torch"]
    assert set(document["load"]) == {"load_average_before", "load_average_after", "others_cores_mean",
                                     "others_cores_max", "seconds"}  # fmt: skip
    assert 0 <= document["load"]["others_cores_mean"] <= os.cpu_count() + 0.5


def test_cpu_this_process_and_its_children_spend_is_not_counted_as_other_work():
    """A busy child's CPU shows in the machine's busy time but not in `others_cores_mean`: over the window,
    the other processes' cores are at most the machine's busy cores less the child's."""
    from testkit.bench_harness import _cpu_ticks_busy

    busy_loop = "import time\nend = time.time() + 2\nwhile time.time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", busy_loop])
    try:
        time.sleep(0.2)
        busy_before, child_before = _cpu_ticks_busy()[0], process_cpu_seconds(child.pid)
        load = MachineLoad(interval_s=0.25)
        time.sleep(1.0)
        child_s = process_cpu_seconds(child.pid) - child_before
        summary = load.summary()
        machine_s = (_cpu_ticks_busy()[0] - busy_before) / os.sysconf("SC_CLK_TCK")
    finally:
        child.wait()
    if child_s < 0.3:
        pytest.skip(f"the child got {child_s:.2f} CPU seconds of 1: the machine is too busy to tell")
    seconds = summary["seconds"]
    assert summary["others_cores_mean"] <= (machine_s - child_s) / seconds + 0.1, (
        summary,
        machine_s,
        child_s,
    )


def test_record_flag_defaults_to_the_results_folder(tmp_path):
    import argparse

    from testkit.bench_harness import RESULTS_DIR

    parser = argparse.ArgumentParser()
    add_record_flag(parser)
    assert parser.parse_args([]).record is None
    assert parser.parse_args(["--record"]).record == RESULTS_DIR
    assert parser.parse_args(["--record", str(tmp_path)]).record == tmp_path
