"""Start-up objects frozen out of the garbage collector's full passes (encoder_common.collector), in a
child process, so that this one's collector is left as it is."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from testkit import REPO_ROOT

CHILD = textwrap.dedent(
    """
    import gc

    import torch  # what an encoder server imports: some 100,000 tracked objects
    import transformers.models.qwen2_5_vl  # noqa: F401

    from encoder_common.collector import freeze_startup_objects

    tracked = len(gc.get_objects())
    frozen = freeze_startup_objects()
    assert frozen >= tracked // 2, (frozen, tracked)
    assert len(gc.get_objects()) < 5000, len(gc.get_objects())  # what a full pass walks now

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # garbage made after start-up is still collected
    del a, b
    assert gc.collect() >= 2
    print("ok", tracked, frozen)
    """
)


def test_a_full_collection_after_freezing_walks_only_what_came_since():
    run = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("ok ")
