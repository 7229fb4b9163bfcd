"""Item files (receiver.vllm.item_files) keep the shared-memory transport's liveness scheme: a sweep removes
what a killed process left and nothing of a live one, judged by flock, never by pid."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import torch

from receiver.vllm.item_files import create_item_file, map_item_file, new_item_path, sweep_dead
from testkit import REPO_ROOT

PREFIX = "encitem"

# A child that writes one item file, says where, and waits to be killed (or released).
CHILD = r"""
import sys
from pathlib import Path
import torch
from receiver.vllm.item_files import create_item_file, new_item_path
path = new_item_path(Path(sys.argv[1]), sys.argv[2])
create_item_file(path, (4, 8), torch.float32).fill_(1.5)
print(path, flush=True)
sys.stdin.read()
"""


def start_child(directory) -> tuple[subprocess.Popen, str]:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory), PREFIX],
        cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    return child, child.stdout.readline().strip()


def test_a_sweep_removes_a_killed_process_files_and_keeps_live_ones(tmp_path):
    own = new_item_path(tmp_path, PREFIX)
    create_item_file(own, (2, 2), torch.float16).fill_(3)
    live, live_path = start_child(tmp_path)
    doomed, doomed_path = start_child(tmp_path)
    try:
        assert map_item_file(doomed_path, (4, 8), torch.float32).eq(1.5).all()
        doomed.send_signal(signal.SIGKILL)
        assert doomed.wait(30) == -signal.SIGKILL
        # The killed child's item and then its lock file go; the live child's and this process's stay.
        doomed_item = Path(doomed_path).name
        assert sweep_dead(tmp_path, PREFIX) == [doomed_item, doomed_item.split(".item.")[0] + ".lock"]
        assert own.exists() and map_item_file(live_path, (4, 8), torch.float32).eq(1.5).all()
        assert sweep_dead(tmp_path, PREFIX) == []
    finally:
        live.kill()
        live.wait(30)
    assert len(sweep_dead(tmp_path, PREFIX)) == 2  # the live child, once gone
    assert own.exists()


def test_files_of_other_prefixes_and_strangers_are_left_alone(tmp_path):
    stranger = tmp_path / f"{PREFIX}.123.notours"
    stranger.write_bytes(b"x")
    other, _ = start_child(tmp_path)
    other.kill()
    other.wait(30)
    assert sweep_dead(tmp_path, "otherprefix") == []
    assert stranger.exists()
