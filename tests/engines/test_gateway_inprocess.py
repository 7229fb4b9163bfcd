"""In-process prefill: vLLM's `LLM.generate` fed by `gateway.handoff.multi_modal_data` gives, for every image
of the parity set (testkit/image_set.py), the same greedy tokens as `LLM.generate` on the raw image as vLLM's
own loader makes it of the same bytes (the script runs in .venv-engines; the encoder server in .venv), in the
Qwen-VL form (the default model) and the plain tensor of LLaVA-NeXT."""

from __future__ import annotations

import json
import subprocess

import pytest

from testkit import REPO_ROOT
from testkit.checkpoints import write_checkpoint
from testkit.engine_files import write_engine_files
from testkit.image_set import image_set
from testkit.launcher import launch_server
from testkit.vllm_server import ENGINES_PYTHON, engines_env

pytestmark = pytest.mark.engine


@pytest.fixture(params=["qwen2_5_vl", "llava_next"])
def model_dir(request, default_model_dir, tmp_path_factory):
    if request.param == "qwen2_5_vl":
        return default_model_dir
    # vocab 320: room for the 256 byte tokens beside the special tokens at 250-255.
    root = tmp_path_factory.mktemp(request.param)
    return write_engine_files(write_checkpoint(request.param, root / "model", vocab_size=320))


def test_llm_generate_with_helper_inputs_equals_raw_images(model_dir, tmp_path):
    paths = []
    for name, data in image_set().items():
        paths.append(tmp_path / name)
        paths[-1].write_bytes(data)
    with launch_server(model_dir, "--dtype", "float32", log_dir=tmp_path) as encoder:
        run = subprocess.run(
            [
                str(ENGINES_PYTHON),
                str(REPO_ROOT / "testkit" / "vllm_inprocess.py"),
                str(model_dir),
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
    assert set(report) == set(image_set())
    for name, outcome in report.items():
        print(f"\n{name}: ids {outcome['raw_ids']}, largest logprob difference {outcome['largest_difference']:.2e}")
    for name, outcome in report.items():
        assert outcome["embedded_ids"] == outcome["raw_ids"], name
        assert outcome["largest_difference"] <= 1e-4, name
