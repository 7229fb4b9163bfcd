"""scripts/bench_connector.py in a short run, so the hand-off benchmark cannot rot: every figure it
reports is in its JSON (timings are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from testkit import REPO_ROOT


def test_bench_connector_short_run_writes_every_figure(tmp_path):
    out = tmp_path / "connector.json"
    run = subprocess.run(
        [sys.executable, "scripts/bench_connector.py", "--rounds", "1", "--json", str(out)],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    figures = json.loads(out.read_text())
    for key in ("grpc", "shm", "to_gateway", "json_write", "json_read", "json"):
        assert figures["median_s"][key] > 0, key
    assert figures["payload_bytes"] == 1024 * 3584 * 2
    assert figures["json_body_bytes"] > figures["payload_bytes"] * 4 / 3  # base64 alone is 4/3
    assert "JSON / connector-gRPC" in run.stdout
