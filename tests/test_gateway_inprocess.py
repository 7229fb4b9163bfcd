"""In-process prefill: vLLM's `LLM.generate` fed by `gateway.handoff.multi_modal_data` gives the same greedy
tokens as `LLM.generate` on the raw images (the script runs in .venv-engines; the encoder server in .venv)."""

from __future__ import annotations

import json
import subprocess

import pytest

from testkit import REPO_ROOT
from testkit.images import image_bytes
from testkit.launcher import launch_server
from testkit.vllm_server import ENGINES_PYTHON, engines_env

pytestmark = pytest.mark.engine


def test_llm_generate_with_helper_inputs_equals_raw_images(default_model_dir, tmp_path):
    paths = []
    for i, (w, h) in enumerate([(112, 84), (224, 196)]):
        paths.append(tmp_path / f"image{i}.png")
        paths[-1].write_bytes(image_bytes(w, h, seed=90 + i))
    with launch_server(default_model_dir, "--dtype", "float32", log_dir=tmp_path) as encoder:
        run = subprocess.run(
            [
                str(ENGINES_PYTHON),
                str(REPO_ROOT / "testkit" / "vllm_inprocess.py"),
                str(default_model_dir),
                encoder.url,
                *map(str, paths),
            ],
            env=engines_env(),
            capture_output=True,
            text=True,
            timeout=900,
        )
    assert run.returncode == 0, run.stderr[-5000:]
    results = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, run.stdout[-5000:] + run.stderr[-5000:]
    report = json.loads(results[-1].removeprefix("RESULT "))
    print(
        f"\nLLM.generate: ids {report['raw_ids']}, largest logprob difference {report['largest_difference']:.2e}"
    )
    assert report["embedded_ids"] == report["raw_ids"]
    assert report["largest_difference"] <= 1e-4
