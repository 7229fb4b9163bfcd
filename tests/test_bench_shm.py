"""scripts/bench_shm.py in a short run, so the same-host benchmark cannot rot: every figure and
ratio it reports is in its JSON (timings are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from testkit import REPO_ROOT


def test_bench_shm_short_run_writes_every_figure(tmp_path):
    out = tmp_path / "shm.json"
    subprocess.run(
        [sys.executable, "scripts/bench_shm.py", "--sizes-mib", "1", "--rounds", "1", "--json", str(out)],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    figures = json.loads(out.read_text())
    assert set(figures) == {"floor_latency_s", "1MiB"}
    row = figures["1MiB"]
    for key in ("memcpy", "zmq", "zmq_view", "grpc", "shm", "grpc_latency", "shm_latency"):
        assert row[key] > 0, key
    for key in ("shm_over_zmq", "shm_over_memcpy", "shm_over_grpc", "latency_shm_over_grpc"):
        assert row[key] > 0, key
