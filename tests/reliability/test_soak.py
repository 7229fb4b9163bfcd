"""The short soak: scripts/soak.py for about 90 seconds with faults every few seconds, two at a time, so that
every kind lands at least once, its engine lane (encoder-gateway and vLLM) included; nothing wrong, nothing
lost, every fault landed and undone. Shorter runs without the engine show that its invariants catch a
planted slot swap and a planted cache-key collision, and that the same run passes without them; its
stand-in tower and its judge of failures are checked on their own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from testkit import REPO_ROOT, load_script
from testkit.images import image_bytes

soak = load_script("soak")


def run_soak(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict, dict]:
    """Runs scripts/soak.py: the process, its summary line and its history."""
    history = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, "scripts/soak.py", *args, "--json", str(history)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.stdout.strip(), run.stderr[-3000:]
    return run, json.loads(run.stdout.strip().splitlines()[-1]), json.loads(history.read_text())


def test_the_stand_in_tower_gives_every_image_its_own_output_and_the_reference_derives_it_the_same_way():
    from encoder_server.images import decode_image

    tower = soak.SoakEncoder()
    # Two images of one size (and so one width) but different pixels, and one of them again in JPEG.
    images = [image_bytes(300, 12, seed=1), image_bytes(300, 12, seed=2), image_bytes(300, 12, seed=1, fmt="JPEG")]
    outputs = [tower.encode([tower.preprocess(decode_image(data))])[0].embedding for data in images]
    for data, output in zip(images, outputs):
        assert torch.equal(output, soak.stand_in_output(soak.reference_digest(data)).embedding)
    assert not torch.equal(outputs[0][:16], outputs[1][:16]) and not torch.equal(outputs[0][:16], outputs[2][:16])
    assert torch.equal(tower.encode([tower.preprocess(decode_image(images[0]))])[0].embedding, outputs[0])


def request(items: list[str], status, start: float = 10.0, seconds: float = 1.0, **fields) -> dict:
    return {"node": "node-a-shm", "items": [[kind, None] for kind in items], "status": status, "start": start,
            "seconds": seconds, "refused_items": [], "failed_on": []} | fields  # fmt: skip


def test_a_failure_is_excused_only_by_its_documented_cause():
    windows = [soak.FaultWindow.of({"kind": kind, "encoder": encoder, "start": 9.0, "end": 10.5}, recovery_s=2.0)
               for kind, encoder in (("partition", 0), ("errors", 1), ("shm_full", 2))]  # fmt: skip
    lanes = frozenset({3})

    def cause(r: dict) -> str:
        return soak.failure_cause(r, windows, lanes)

    # A hostile item: exactly INVALID_ARGUMENT, naming that item.
    assert cause(request(["first", "hostile"], "INVALID_ARGUMENT", refused_items=[1])) == "refused"
    assert cause(request(["first", "hostile"], "INVALID_ARGUMENT", refused_items=[0])).startswith("unexcused")
    assert cause(request(["first"], "INVALID_ARGUMENT", refused_items=[0])).startswith("unexcused")
    # Failures while a fault held the encoders that failed, with what that fault explains.
    assert cause(request(["first"], "DEADLINE_EXCEEDED", failed_on=[[0, "DEADLINE_EXCEEDED"]])) == "fault"
    assert cause(request(["first"], "INTERNAL", failed_on=[[1, "INTERNAL"]])) == "fault"
    assert cause(request(["hostile"], "UNAVAILABLE", failed_on=[[0, "UNAVAILABLE"]])) == "fault"
    # Not on an encoder no fault held, not with what its fault does not explain, not outside every window.
    assert cause(request(["first"], "UNAVAILABLE", failed_on=[[2, "UNAVAILABLE"]])).startswith("unexcused")
    assert cause(request(["first"], "INTERNAL", failed_on=[[0, "INTERNAL"]])).startswith("unexcused")
    assert cause(request(["first"], "UNAVAILABLE", start=13.0)).startswith("unexcused")
    assert cause(request(["first"], "NOT_FOUND", failed_on=[[0, "NOT_FOUND"]])).startswith("unexcused")
    # Through the gateway: 400 for a hostile image; 503/504 only while a fault held one of its encoders.
    gateway = {"node": "gateway"}
    assert cause(request(["hostile"], 400, **gateway)) == "refused"
    assert cause(request(["first"], 400, **gateway)).startswith("unexcused")
    assert cause(request(["first"], 503, **gateway)).startswith("unexcused")
    lane_fault = soak.FaultWindow.of({"kind": "kill9", "encoder": 3, "start": 9.0, "end": 10.5}, recovery_s=2.0)
    assert soak.failure_cause(request(["first"], 503, **gateway), [lane_fault], lanes) == "fault"


QUICK_SOAK = ("--seed", "5", "--fault-gap-s", "1", "3", "--fault-hold-s", "1", "3", "--concurrent-faults", "2",
              "--engine", "off")  # fmt: skip
# Seconds of each run: a planted bug shows within a few seconds of multi-item requests and repeated sizes.
QUICK_SOAK_S = {None: "20", "slot_swap": "12", "key_collision": "12"}


@pytest.mark.parametrize("bug", [None, *soak.INJECTIONS])
def test_the_soak_fails_when_a_slot_swap_or_a_key_collision_is_planted_and_passes_without(tmp_path, bug):
    run, summary, recorded = run_soak(
        tmp_path, "--duration-s", QUICK_SOAK_S[bug], *QUICK_SOAK, *(["--inject", bug] if bug else [])
    )
    assert summary["injected"] == bug and summary["faults"], summary
    if bug is None:
        assert run.returncode == 0 and summary["broken_invariants"] == [], summary
        assert summary["outcomes"]["ok"] >= 100 and summary["failures_by_cause"].get("refused", 0) > 0, summary
        assert summary["valid_in_fault_windows"] > 0
        return
    # Items came back in the wrong slots, or another image's embedding came back under the same key.
    assert run.returncode == 1 and summary["wrong"] > 0, summary
    assert any(problem.startswith(f"{summary['wrong']} wrong") for problem in summary["broken_invariants"])
    assert sum(r.get("wrong", 0) for r in recorded["requests"]) > 0


@pytest.mark.engine  # the engine lane runs vLLM from .venv-engines
def test_a_short_soak_under_every_fault_keeps_its_invariants(tmp_path):
    run, summary, recorded = run_soak(tmp_path, "--duration-s", "90", "--seed", "11", "--fault-gap-s", "1", "3",
                                      "--fault-hold-s", "1", "3", "--concurrent-faults", "2", "--engine", "on")  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert summary["wrong"] == 0 and summary["lost"] == 0 and summary["broken_invariants"] == [], summary
    assert summary["outcomes"]["ok"] >= 100 and summary["items_checked"] >= 200, summary
    # Every failure had its cause: hostile items refused with exactly their status (some were), the others
    # only while faults held the encoders they failed on; and some calls were cancelled part-way.
    assert summary["unexcused"] == 0 and summary["failures_by_cause"].get("refused", 0) > 0, summary
    assert summary["outcomes"].get("cancelled", 0) > 0
    kinds = {"kill9", "sigstop", "partition", "slow_link", "drain", "errors"} | ({"shm_full"} if summary["shm_tmpfs"] else set())
    assert kinds <= set(summary["faults"]) and not summary["fault_errors"], summary["faults"]
    assert summary["faults_at_once_max"] == 2, summary["faults"]  # they overlapped, on distinct encoders
    assert summary["repeat_cache_hits"] > 0
    # Shared memory carried items all along: whatever the faults did to it, the fast path came back.
    assert summary["shm_items"] > 0 and summary["shm_longest_idle_s"] < 30, summary
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
