"""The Python floor in pyproject.toml is true: vermin finds no module of the checkout that needs a newer one."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from testkit import REPO_ROOT

CHECKED = ["protos", "encoder_common", "encoder_server", "precompute", "receiver", "gateway", "testkit", "scripts", "tests"]


def test_no_module_needs_a_newer_python_than_requires_python():
    floor = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert floor.startswith(">="), floor
    checked = subprocess.run(
        [sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())", f"--target={floor[2:]}-", "--violations", "--no-tips",
         "--no-parse-comments", *CHECKED],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
