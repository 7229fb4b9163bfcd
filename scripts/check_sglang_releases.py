"""Checks `encoder_server.sglang.embedding_data.LAYOUTS` against each SGLang release's own unpickler: downloads
each release's wheel (pip download --no-deps, into --wheel-dir), runs its `SafeUnpickler` source on the pickles
we send (testkit/sglang_releases.py) and prints, per release, the layout it gets and what, if anything, fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tooling

from encoder_server.sglang.embedding_data import LAYOUTS, layout_for
from testkit.sglang_releases import COMMON, WHEEL_DIR, check_release, read_sources, release_wheel

# The newest build of each release from 0.5.13, the first with safe_pickle_loads.
RELEASES = (
    "0.5.13.post1", "0.5.14", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18",
    "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23",
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--wheel-dir", type=Path, default=WHEEL_DIR, help="where the wheels are or go (default: %(default)s)"
    )
    parser.add_argument("releases", nargs="*", default=RELEASES, help="SGLang versions to check")
    args = parser.parse_args(argv)
    failures = 0
    print(f"{'SGLang':<14}{'EmbeddingData':<58}{'Modality':<44}result")
    for version in args.releases:
        sources = read_sources(release_wheel(version, args.wheel_dir))
        layout = layout_for(version)
        problems = check_release(sources, layout) if "class SafeUnpickler" in sources.get(COMMON, "") else [
            "no SafeUnpickler in this release"
        ]
        failures += bool(problems)
        result = "; ".join(problems) or "accepted, attributes equal"
        print(f"{version:<14}{'.'.join(layout.embedding_data):<58}{'.'.join(layout.modality):<44}{result}")
    print(f"{len(args.releases)} releases, {failures} failing; layouts cover {LAYOUTS[-1].first} to {LAYOUTS[0].last}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
