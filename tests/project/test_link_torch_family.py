"""scripts/link_torch_family.py: the engine venvs share .venv's torch family on disk. Run on this
interpreter's own environment, it hard-links torch, torchvision, triton and the CUDA libraries into
another site-packages, and nothing else, so torch imports from there and pip sees it installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from importlib.metadata import distribution, distributions
from pathlib import Path

import pytest

from testkit import load_script

link_torch_family = load_script("link_torch_family")


@pytest.fixture
def target(tmp_path):
    """An empty site-packages beside this venv's, removed afterwards (its links would keep 4.6 GB alive
    after the venv itself is gone)."""
    if os.stat(tmp_path).st_dev != os.stat(sysconfig.get_paths()["purelib"]).st_dev:
        pytest.skip("the temporary directory lies on another filesystem than this venv: nothing is linked")
    target = tmp_path / "site-packages"
    target.mkdir()
    yield target
    shutil.rmtree(target)


def test_links_the_torch_family_and_nothing_else(target):
    assert link_torch_family.link_into(target) >= 3

    linked = {d.metadata["Name"].lower() for d in distributions(path=[str(target)])}
    assert {"torch", "torchvision", "triton"} <= linked
    assert all(link_torch_family.in_torch_family(name) for name in linked), linked
    assert "grpcio" not in linked and "transformers" not in linked
    for name in ("torch", "torchvision"):
        here = distribution(name).locate_file(f"{name}/__init__.py")
        assert os.stat(target / name / "__init__.py").st_ino == os.stat(here).st_ino
    assert link_torch_family.link_into(target) == 0  # a second run finds everything present

    code = (
        f"import sys; sys.path.insert(0, {str(target)!r}); import torch; "
        "print(torch.__file__, torch.ones(2).sum())"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    where, total = run.stdout.split(maxsplit=1)
    assert Path(where).is_relative_to(target) and total.strip() == "tensor(2.)"


def test_a_distribution_that_fails_to_link_is_taken_back_whole(target, capsys):
    (target / "torch").write_text("a file where torch's package directory goes")
    link_torch_family.link_into(target)

    assert "torch" not in {d.metadata["Name"].lower() for d in distributions(path=[str(target)])}
    assert not list(target.glob("torch-*.dist-info"))  # nothing half there: pip installs torch whole
    assert "torch not linked" in capsys.readouterr().err
