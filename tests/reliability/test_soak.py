"""The short soak: scripts/soak.py for about 90 seconds with faults every few seconds, two at a time, so that
every kind lands at least once, its engine lane (encoder-gateway and vLLM) included; nothing wrong, nothing
lost, every fault landed and undone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testkit import REPO_ROOT

pytestmark = pytest.mark.engine  # the engine lane runs vLLM from .venv-engines


def test_a_short_soak_under_every_fault_keeps_its_invariants(tmp_path):
    history = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, "scripts/soak.py", "--duration-s", "90", "--seed", "11", "--fault-gap-s", "1", "3",
         "--fault-hold-s", "1", "3", "--concurrent-faults", "2", "--engine", "on", "--json", str(history)],  # fmt: skip
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["wrong"] == 0 and summary["lost"] == 0, summary
    assert summary["outcomes"]["ok"] >= 100 and summary["items_checked"] >= 200, summary
    # Hostile items were refused with a typed error, and some calls were cancelled part-way.
    assert summary["outcomes"].get("typed_error", 0) > 0 and summary["outcomes"].get("cancelled", 0) > 0
    kinds = {"kill9", "sigstop", "partition", "slow_link", "drain", "errors"} | ({"shm_full"} if summary["shm_tmpfs"] else set())
    assert kinds <= set(summary["faults"]) and not summary["fault_errors"], summary["faults"]
    assert summary["faults_at_once_max"] == 2, summary["faults"]  # they overlapped, on distinct encoders
    assert summary["repeat_cache_hits"] > 0
    # Shared memory carried items all along: whatever the faults did to it, the fast path came back.
    assert summary["shm_items"] > 0 and summary["shm_longest_idle_s"] < 30, summary
    recorded = json.loads(history.read_text())
    assert len(recorded["requests"]) == summary["requests"] and recorded["samples"]
    assert all(r["outcome"] in ("ok", "typed_error", "cancelled") for r in recorded["requests"])
    faults = recorded["faults"]
    on_one_encoder = [(a, b) for a in faults for b in faults
                      if a is not b and a["encoder"] == b["encoder"] and a["start"] < b["end"] and b["start"] < a["end"]]  # fmt: skip
    assert not on_one_encoder, on_one_encoder
    # Chat requests through the gateway answered with vLLM's own tokens, while faults also hit its encoders.
    through_gateway = [r for r in recorded["requests"] if r["node"] == "gateway"]
    assert sum(r["outcome"] == "ok" for r in through_gateway) >= 10, summary["requests_by_node"]
    assert summary["engine_lane_distinct_answers"] > 1  # the images change the answer, so a wrong one shows
    lane_encoders = {summary["encoders"], summary["encoders"] + 1}
    assert any(fault["encoder"] in lane_encoders for fault in recorded["faults"]), recorded["faults"]
