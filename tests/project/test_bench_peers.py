"""The peers benchmark: every request of a run counted from `vllm bench serve`'s per-request record (failures
by kind, goodput within the SLO, percentiles with a failure as a missed SLO), repeats summed up as their
median and range, tokens compared with the engine alone for every other configuration; and end to end on
the tiny tower: vLLM alone and ours (inline), each answering with its engine alone's tokens,
with its CPU time per request accounted to the processes that spent it and the machine's other load recorded."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testkit import REPO_ROOT, load_script

bench_peers = load_script("bench_peers")
TOWER = bench_peers.Tower("{(224, 224, 1): 1.0}", (1, 0.0), "1", slo_ttft_ms=100, slo_e2e_ms=300)
REFUSED = "Service Unavailable"
DISCONNECTED = (
    "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
    "aiohttp.client_exceptions.ServerDisconnectedError: Server disconnected\n"
)


def result(ttfts_ms: list[float], e2es_ms: list[float], errors: list[str], duration: float = 10.0) -> dict:
    """What `vllm bench serve --save-detailed` writes, the fields the benchmark reads."""
    return {"duration": duration, "ttfts": [t / 1000 for t in ttfts_ms], "latencies": [e / 1000 for e in e2es_ms],
            "errors": errors}  # fmt: skip


def test_every_request_is_counted_and_a_failure_misses_the_slo():
    # 100 requests: 97 completed (95 within the SLO, one too slow to first token, one too slow to the end), 3 failed.
    ttfts, e2es = [50.0] * 95 + [150.0, 60.0], [200.0] * 95 + [250.0, 400.0]
    errors = [""] * 97 + [REFUSED, REFUSED, DISCONNECTED]
    row = bench_peers.counted(result(ttfts + [0.0] * 3, e2es + [0.0] * 3, errors), TOWER)
    assert (row["requests"], row["completed"], row["failed"], row["within_slo"]) == (100, 97, 3, 95)
    assert row["failed_by_kind"] == {REFUSED: 2, "ServerDisconnectedError": 1}
    assert row["req_per_s"] == pytest.approx(9.7) and row["goodput_req_per_s"] == pytest.approx(9.5)
    assert row["ttft_p50_ms"] == 50.0
    # p99 of 100 requests is the 100th-slowest but one: a failed request, so the SLO is missed there. Counting
    # the completed ones alone, as `vllm bench serve` does, would have given 150 ms.
    assert row["ttft_p99_ms"] is None and row["e2e_p99_ms"] is None
    fine = bench_peers.counted(result([50.0] * 100, [200.0] * 99 + [900.0], [""] * 100), TOWER)
    assert fine["ttft_p99_ms"] == 50.0 and fine["e2e_p99_ms"] == 900.0 and fine["within_slo"] == 99


def test_repeats_are_summed_up_as_their_median_and_range():
    rows = [
        bench_peers.counted(result([t] * 10, [2 * t] * 10, [""] * 10, duration=d), TOWER)
        for t, d in ((40.0, 5.0), (60.0, 4.0), (50.0, 2.0))
    ]
    rows.append(bench_peers.counted(result([50.0] * 10, [100.0] * 10, [""] * 9 + [REFUSED], duration=2.0), TOWER))
    figures = bench_peers.spread(rows[:3])
    assert figures["requests"] == 30 and figures["failed"] == 0
    assert figures["req_per_s"] == {"median": 2.5, "min": 2.0, "max": 5.0}
    assert figures["ttft_p50_ms"] == {"median": 50.0, "min": 40.0, "max": 60.0}
    with_a_failure = bench_peers.spread(rows[2:])  # one repeat's p99 missed: the range's top is missed too
    assert with_a_failure["failed"] == 1 and with_a_failure["failed_by_kind"] == {REFUSED: 1}
    assert with_a_failure["ttft_p99_ms"] == {"median": None, "min": 50.0, "max": None}
    assert bench_peers._figure(with_a_failure["ttft_p99_ms"], best=50.0) == "missed (50.0-missed)"
    assert bench_peers._figure(figures["ttft_p50_ms"], best=40.0) == "50.0 (40.0-60.0), 1.25x"


def test_tokens_are_compared_with_the_engine_alone_for_every_configuration_but_itself():
    report = {"vllm-alone": {"tokens": [[1, 2], [3, 4]]}, "ours-inline": {"tokens": [[1, 2], [3, 5]]},
              "ours-sglang": {"tokens": [["a"]]}}  # fmt: skip
    assert bench_peers.same_tokens(report, "vllm-alone") == "(the reference)"
    assert bench_peers.same_tokens(report, "ours-inline") == "1 / 2"
    assert bench_peers.same_tokens(report, "ours-sglang") == "no reference"  # SGLang alone did not run


def test_the_benchmarks_own_cpu_time_counts_its_children_alive_and_reaped():
    """What `OtherLoad` takes from the machine's busy time: a child's CPU time while it runs and after it
    ended, so that the benchmark's own work never reads as another process's."""
    tree = bench_peers.ProcessTree(lambda: None)
    before, busy_before = tree.all_cpu_seconds(), bench_peers.machine_busy_seconds()
    spin = "import sys, time\nwhile time.process_time() < 0.5: pass\nprint('spun', flush=True)\nsys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "spun\n"
    alive = tree.all_cpu_seconds()
    child.stdin.close()
    child.wait()
    reaped = tree.all_cpu_seconds()
    assert alive - before >= 0.45 and reaped >= alive - 0.02, (before, alive, reaped)  # /proc counts in ticks
    assert bench_peers.machine_busy_seconds() - busy_before >= 0.45


@pytest.mark.engine
def test_the_engine_alone_and_ours_answer_alike_and_account_their_cpu(tmp_path):
    """vLLM's own EPD pair is left to the benchmark: its encoder instance profiles the tower at its largest
    input for ~2.5 min on this machine's one bound core before it serves."""
    configurations = ("vllm-alone", "ours-inline")
    script = REPO_ROOT / "scripts" / "bench_peers.py"
    argv = [sys.executable, str(script), "--tower", "tiny", "--rates", "inf", "--prompts", "2", "--warmup", "1",
            "--repeats", "1", "--allow-busy", "--configurations", ",".join(configurations), "--out", str(tmp_path)]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-5000:]
    recorded = json.loads((tmp_path / "report.json").read_text())
    assert recorded["machine_before"]["cpus"] and recorded["settings"]["repeats"] == 1
    report = recorded["towers"]["tiny"]["configurations"]
    assert list(report) == list(configurations)
    for name, entry in report.items():
        assert "error" not in entry, f"{name}: {entry}"
        assert entry["rates"]["inf"]["requests"] == 2 and entry["rates"]["inf"]["completed"] == 2, name
        assert entry["tokens"] == report["vllm-alone"]["tokens"], name  # greedy: its engine alone's ids
        assert all(isinstance(ids, list) and ids for ids in entry["tokens"]), name
        assert entry["cpu_s_per_request"] > 0 and entry["peak_rss_gib"] > 0 and entry["other_cores_max"] >= 0
    ours = report["ours-inline"]
    assert {"encoder_server", "gateway"} <= set(ours["cpu_s_per_request_by_process"])
    assert ours["encoder_images_per_s"] > 0
    assert "| ours-inline | 2: 2 / 0 |" in run.stdout and "| 2 / 2 |" in run.stdout and "(the reference)" in run.stdout
    assert "CPU seconds per request (all rates and repeats), by process:" in run.stdout
