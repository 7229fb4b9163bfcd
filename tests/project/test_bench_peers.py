"""The peers benchmark runs end to end on the tiny tower: vLLM alone, vLLM's own EPD and ours (inline), each
driven by `vllm bench serve`, each answering with its engine alone's tokens, with its CPU time per request
accounted to the processes that spent it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testkit import REPO_ROOT

pytestmark = pytest.mark.engine

CONFIGURATIONS = ("vllm-alone", "vllm-epd", "ours-inline")


def test_three_configurations_answer_like_vllm_alone_and_account_their_cpu(tmp_path):
    script = REPO_ROOT / "scripts" / "bench_peers.py"
    argv = [sys.executable, str(script), "--tower", "tiny", "--rates", "inf", "--prompts", "2", "--warmup", "1",
            "--configurations", ",".join(CONFIGURATIONS), "--out", str(tmp_path)]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-5000:]
    report = json.loads((tmp_path / "report.json").read_text())["tiny"]
    assert list(report) == list(CONFIGURATIONS)
    for name, entry in report.items():
        assert "error" not in entry, f"{name}: {entry}"
        assert entry["rates"]["inf"]["completed"] == 2, name
        assert entry["tokens"] == report["vllm-alone"]["tokens"], name  # greedy: its engine alone's ids
        assert all(isinstance(ids, list) and ids for ids in entry["tokens"]), name
        assert entry["cpu_s_per_request"] > 0 and entry["peak_rss_gib"] > 0
    ours = report["ours-inline"]
    assert {"encoder_server", "gateway"} <= set(ours["cpu_s_per_request_by_process"])
    assert ours["encoder_images_per_s"] > 0 and report["vllm-epd"]["encoder_images_per_s"] > 0
    assert "| ours-inline | 2 (0 failed) |" in run.stdout and "2 / 2 |" in run.stdout
    assert "CPU seconds per request (all rates), by process:" in run.stdout
