"""The encode-stage benchmark runs end to end against vLLM's own path, and the two paths it times compute
the same embedding (so the ratio compares like with like)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testkit import REPO_ROOT

pytestmark = pytest.mark.engine


def test_one_round_reports_every_stage_and_equal_embeddings(default_model_dir, tmp_path):
    out = tmp_path / "encode_stage.json"
    script = REPO_ROOT / "scripts" / "bench_encode_stage.py"
    argv = [sys.executable, str(script), "--model", str(default_model_dir), "--rounds", "1"]
    argv += ["--images", "333x250", "--json", str(out)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-5000:]
    report = json.loads(out.read_text())
    (result,) = report["images"].values()
    assert report["threads"] == 1 and report["device"] == "cpu"
    assert set(result["ours_ms"]) == {"decode", "preprocess", "forward", "total"}
    assert set(result["vllm_ms"]) == {"load", "processor", "tower", "total"}
    assert result["tokens"] == 12 * 9  # 333x250 resizes to 336x252: 12x9 merged tokens of 28 px
    assert result["ratio"] > 0 and report["worst_ratio"] == result["ratio"]
    # Float32, the same weights, vLLM's processor output and ours: within float rounding.
    assert result["largest_embedding_difference"] < 1e-5
    assert "ratio" in run.stdout


def test_a_familys_test_checkpoint_against_vllms_path(tmp_path):
    """--family: InternVL's test checkpoint (tiles and a thumbnail, whose kwargs are not Qwen's), in float32."""
    out = tmp_path / "encode_stage.json"
    script = REPO_ROOT / "scripts" / "bench_encode_stage.py"
    argv = [sys.executable, str(script), "--family", "internvl", "--rounds", "1", "--images", "333x250"]
    run = subprocess.run(
        [*argv, "--json", str(out)], capture_output=True, text=True, timeout=600, check=False
    )
    assert run.returncode == 0, run.stderr[-5000:]
    report = json.loads(out.read_text())
    (result,) = report["images"].values()
    assert (report["model"], report["dtype"]) == ("internvl", "float32")
    assert result["tokens"] > 0 and result["ratio"] > 0
    # vLLM's processor and tower on the same weights give the same rows, within float rounding.
    assert result["largest_embedding_difference"] < 1e-5
    assert "internvl, float32" in run.stdout
