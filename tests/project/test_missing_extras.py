"""Every console script whose extra is missing says so in one line naming the pip command, and exits
non-zero; the extra's modules are hidden from a child interpreter (None in sys.modules blocks an import)."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from encoder_common.extras import EXTRA_MODULES
from testkit import REPO_ROOT

SCRIPTS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
# command -> the extra it needs (None: the base install is enough)
EXTRAS = {
    "encoder-server": "server",
    "encoder-precompute": "server",
    "encoder-gateway": "gateway",
    "encoder-client": None,
}


def run_hiding(entry_point: str, hidden: list[str], *args: str) -> subprocess.CompletedProcess:
    module, function = entry_point.split(":")
    code = (
        f"import sys\nfor name in {hidden!r}: sys.modules[name] = None\n"
        f"from {module} import {function}\nsys.exit({function}({list(args)!r}))"
    )
    command = [sys.executable, "-c", code]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def test_every_console_script_has_its_extra_named():
    assert set(EXTRAS) == set(SCRIPTS)


@pytest.mark.parametrize("command", [c for c, extra in EXTRAS.items() if extra])
def test_a_missing_extra_is_one_line_and_a_non_zero_exit(command):
    extra = EXTRAS[command]
    for module in EXTRA_MODULES[extra]:
        done = run_hiding(SCRIPTS[command], [module], "--help")
        assert done.returncode == 1, (module, done.stderr)
        expected = f"{command}: missing {module}; install it with: pip install 'encoder-service[{extra}]'\n"
        assert done.stderr == expected
        assert done.stdout == ""


def test_the_client_needs_no_extra():
    every_extra_module = sorted({m for modules in EXTRA_MODULES.values() for m in modules})
    done = run_hiding(SCRIPTS["encoder-client"], every_extra_module, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: encoder-client")
