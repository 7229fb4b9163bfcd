"""scripts/bench_connector.py in a short run, so the hand-off benchmark cannot rot: every figure it
reports is in its JSON (timings are not asserted), and the files of runs that are over do not pile up
in /dev/shm."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

from testkit import REPO_ROOT


def test_bench_connector_short_run_writes_every_figure(tmp_path):
    out = tmp_path / "connector.json"
    # The lock file a run that is over left (nobody holds its flock): the next run sweeps it.
    left = Path("/dev/shm") / f"bench-connector.1.{secrets.token_hex(16)}.lock"
    left.touch(mode=0o600)
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
    assert not left.exists()
