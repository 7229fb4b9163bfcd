"""The benchmark's short mode runs end to end, so it cannot rot: every section lands in the JSON."""

from __future__ import annotations

import json
import subprocess
import sys

from testkit import REPO_ROOT

SECTIONS = ("transport", "serving", "batching", "scale_out", "cache", "image_sizes")


def test_quick_benchmark_writes_every_section(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "scripts/bench.py", "--quick", "--json", str(out), "--workdir", str(tmp_path / "work")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["quick"] is True and set(SECTIONS) <= set(results)

    for size in ("8MiB", "32MiB"):
        transport = results["transport"][size]
        assert set(transport["gbps"]) == {
            "ours_cached", "ours_computed", "ours_computed_server_malloc_default",
            "bare_grpc", "bare_grpc_torch_empty", "zmq", "memcpy",
        }  # fmt: skip
        assert all(value > 0 for value in transport["gbps"].values())
        assert transport["ours_vs_bare_grpc"] > 0 and transport["ours_vs_zmq"] > 0 and transport["ours_vs_memcpy"] > 0
    assert results["serving"]["server_images_per_s"]["median"] > 0
    assert results["serving"]["in_process_images_per_s"]["median"] > 0
    assert results["batching"]["clients"] == 16
    assert results["batching"]["on_images_per_s"]["median"] > 0 and results["batching"]["off_images_per_s"]["median"] > 0
    assert results["scale_out"]["two_images_per_s"]["median"] > 0 and results["scale_out"]["one_images_per_s"]["median"] > 0
    assert results["cache"]["hit_ms"]["median"] > 0 and results["cache"]["miss_ms"]["median"] > 0
    assert set(results["image_sizes"]["sizes"]) == {"112x112", "224x224"}

    goals = {goal["goal"]: goal for goal in results["goals"]}
    assert len(goals) == 6 and all(isinstance(goal["met"], bool) for goal in goals.values())
    assert "goal batching: on / off >= 1.5" in run.stdout  # the printed table
    assert f"wrote {out}" in run.stdout
