"""The benchmark's short mode runs end to end, so it cannot rot: every section lands in the JSON
(the same-host shared-memory figures, the server users run beside its stand-in at 7 MiB, the optional
Mooncake ones in the transport section, tracing on and off)."""

from __future__ import annotations

import json
import subprocess
import sys

from testkit import REPO_ROOT

SECTIONS = ("transport", "serving", "batching", "scale_out", "cache", "image_sizes", "tracing")


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

    for size in ("7MiB", "32MiB"):
        transport = results["transport"][size]
        served = {"served_cached_seq", "served_cached_x4", "served_shm", "served_shm_x4"} if size == "7MiB" else set()
        assert set(transport["gbps"]) == {
            "bare_seq", "bare_x4", "bare_named_seq", "bare_named_x4", "stream_cached_seq", "stream_cached_x4",
            "stream_computed_seq", "stream_computed_x4", "shm", "shm_x4", "zmq", "memcpy", "memcpy_threads", "memcpy_cold",
        } | served  # fmt: skip
        assert all(value > 0 for value in transport["gbps"].values())
        assert len(transport["stream_vs_best_bare"]) == 4 and all(v > 0 for v in transport["stream_vs_best_bare"].values())
        assert transport["shm_vs_zmq"] > 0 and transport["shm_vs_memcpy"] > 0 and transport["shm_latency_vs_stream"] > 0
        assert transport["shm_x4_vs_zmq"] > 0 and transport["shm_x4_vs_memcpy"] > 0
        assert transport["shm_vs_memcpy_cold"] > 0 and transport["shm_x4_vs_memcpy_cold"] > 0
        assert set(transport["stream_vs_bare_same_mode"]) == set(transport["stream_vs_best_bare"])
        assert set(transport["stream_vs_bare_same_request"]) == {"stream_cached_seq", "stream_cached_x4"}
        # What no server could pass in this run: decoding only lowers a computed item's ceiling.
        ceilings = transport["ceilings"]
        assert 0 < ceilings["stream_computed_seq"] < ceilings["stream_cached_seq"] <= 1
        assert 0 < ceilings["stream_computed_x4"] <= 1 and ceilings["shm_seq_vs_zmq"] > 0
    # The encoder server users run (a real checkpoint, its cached 7 MiB item) beside the stand-in.
    served = results["transport"]["7MiB"]["served"]
    assert set(served["vs_standin"]) == {"served_cached_seq", "served_cached_x4", "served_shm", "served_shm_x4"}
    assert all(v > 0 for v in served["vs_standin"].values()) and served["shm_vs_zmq"] > 0
    assert "the server users run, stream cached seq" in run.stdout and "served" not in results["transport"]["32MiB"]
    assert all(v > 0 for v in results["transport"]["floor_ms"].values())
    assert results["transport"]["request_jpeg_bytes"] > 200_000  # each call carries a real JPEG
    assert results["transport"]["small"]["ours_vs_bare_latency"] > 0
    # Mooncake is optional: measured when installed, else the reason it was skipped.
    assert results["transport"]["mooncake"] == "measured" or "Error" in results["transport"]["mooncake"]
    engine = results["transport"].get("engine")
    assert (engine is None) == (results["transport"]["mooncake"] != "measured")
    for size in ("7MiB", "32MiB") if engine else ():  # our transfer-engine path, with both sides' CPU
        row = engine[size]
        assert set(row["gbps"]) == {"engine_seq", "engine_x4", "raw_seq", "raw_x4", "stream_cached_seq",
                                    "stream_cached_x4", "bare_seq", "bare_x4", "memcpy"}  # fmt: skip
        assert all(v > 0 for v in row["gbps"].values())
        assert row["engine_vs_stream_seq"] > 0 and row["engine_vs_stream_x4"] > 0
        assert 0 < row["ceilings"]["engine_vs_stream_seq"] and 0 < row["ceilings"]["engine_vs_stream_x4"]
        assert all(cpu["receiver"] >= 0 and cpu["server"] >= 0 for cpu in row["cpu_s_per_gb"].values())
    assert engine is None or engine["declined_offer"]["auto_vs_grpc"] > 0
    assert results["serving"]["server_images_per_s"]["median"] > 0
    assert results["serving"]["in_process_images_per_s"]["median"] > 0
    assert results["batching"]["clients"] == 16
    assert results["batching"]["on_images_per_s"]["median"] > 0 and results["batching"]["off_images_per_s"]["median"] > 0
    assert results["scale_out"]["two_images_per_s"]["median"] > 0 and results["scale_out"]["one_images_per_s"]["median"] > 0
    assert results["cache"]["hit_ms"]["median"] > 0 and results["cache"]["miss_ms"]["median"] > 0
    assert set(results["image_sizes"]["sizes"]) == {"112x112", "224x224"}
    for size in ("7MiB", "small"):
        tracing = results["tracing"][size]
        assert tracing["on_ms"] > 0 and tracing["off_ms"] > 0 and tracing["on_vs_off"] > 0
        assert set(tracing["cpu_us_per_call"]) == {"on", "off"}

    goals = {(goal["goal"], goal["target"]): goal for goal in results["goals"]}  # one ratio may have two targets
    engine_goals = 5 if engine else 0
    goals_expected = 2 * 14 + 1 + 4 + 4 + 2 + engine_goals
    assert len(goals) == goals_expected and all(isinstance(goal["met"], bool) for goal in goals.values())
    assert "goal transport 7 MiB: shared memory x4 / zmq >= 2.0" in run.stdout
    with_ceiling = [goal for goal in goals.values() if "ceiling" in goal]
    assert len(with_ceiling) == 2 * 4 + (2 if engine else 0) and all(goal["reachable"] == (goal["ceiling"] >= goal["target"]) for goal in with_ceiling)
    assert "goal batching: on / off >= 1.5" in run.stdout  # the printed table
    assert f"wrote {out}" in run.stdout
