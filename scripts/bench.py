"""Throughput benchmark of the encode path; every figure stands beside a baseline measured in the same run.

Sections: transport (the gRPC stream and same-host shared memory vs bare grpcio, pyzmq raw frames,
memcpy and, when installed, Mooncake's TCP transfer engine), serving overhead (a server vs the same
model in-process), batching (on vs off, 16 clients), scale-out (2 encoder processes vs 1), cache (hit
vs miss), images/s by image size and tracing (on, every request sampled, vs off). Prints a table, writes
JSON (--json) and, with --record, one result file per section (benchmarks/results/bench_<section>.json, or
bench_gpu_<section>.json on a GPU), from which the docs' tables and plots are drawn. `--quick` is the short
CI run; `--device cuda` runs the real-size Qwen2.5-VL tower (random weights) on a GPU.

    python scripts/bench.py --json bench.json
    python scripts/bench.py --sections serving,cache --record
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import platform
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # this checkout's packages, not an installed copy

import grpc
import torch
from bench_sections import batching, cache, image_sizes, scale_out, serving, tracing, transport
from bench_sections.context import Children, Context, start_processes
from bench_sections.profile import Profile, profile_for
from bench_sections.report import goals, table
from bench_sections.transport_baselines import ROLES

from encoder_common.malloc import tune_malloc
from protos import wire
from testkit.bench_harness import MachineLoad, Stopwatch, add_record_flag, record_result, write_json

RUNNERS = {  # section -> its run(ctx) -> the section's JSON dict, in the order they run
    "transport": transport.run,
    "serving": serving.run,
    "batching": batching.run,
    "scale_out": scale_out.run,
    "cache": cache.run,
    "image_sizes": image_sizes.run,
    "tracing": tracing.run,
}
SECTIONS = tuple(RUNNERS)


def machine(profile: Profile) -> dict:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "chunk_bytes": wire.CHUNK_BYTES,
        "gpu": torch.cuda.get_device_name() if profile.device == "cuda" else None,
        "load_average_before": os.getloadavg(),
    }


async def run_benchmark(args, profile: Profile, workdir: Path) -> dict:
    sections = [s for s in SECTIONS if s in args.sections]
    children = Children(workdir, timeout=600 if profile.device == "cuda" else 300)
    ctx = Context(profile, children, workdir)
    if profile.device == "cpu":
        torch.set_num_threads(profile.torch_threads)
    results: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "quick": args.quick,
        "profile": dataclasses.asdict(profile),
        "machine": machine(profile),
    }
    watch = Stopwatch()
    try:
        await start_processes(ctx, sections)
        for section in sections:
            results[section] = await RUNNERS[section](ctx)
    finally:
        children.stop()
    results["machine"]["load_average_after"] = os.getloadavg()
    results["goals"] = goals(results)
    results["seconds"] = watch.seconds()
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short run with small models (CI)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--sections", type=lambda s: s.split(","), default=list(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")  # fmt: skip
    parser.add_argument("--workdir", type=Path, help="keep models and logs here (default: a temp dir)")
    add_record_flag(parser)
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--payload-bytes", type=int, nargs="+", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Every process of the benchmark (ours and the baselines alike) runs with the malloc settings the
    # encoder server sets for itself and docs/prefill-side.md recommends for a receiver's process.
    tune_malloc()
    os.environ.setdefault(
        "GLOG_minloglevel", "2"
    )  # Mooncake's glog: errors only, in every process of the run
    if args.role:
        ROLES[args.role](args)
        return
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible to torch")
    profile = profile_for(args.device, args.quick)
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="encoder-bench-"))
        )
        workdir.mkdir(parents=True, exist_ok=True)
        load = MachineLoad()
        results = asyncio.run(run_benchmark(args, profile, workdir))
        load = load.summary()
    print(table(results))
    if args.json:
        write_json(args.json, results)
        print(f"wrote {args.json}")
    if args.record:
        record_sections(args.record, results, load)


def record_sections(directory: Path, results: dict, load: dict) -> None:
    """One result file per section run: its figures, the run's profile, and the goals it decides."""
    prefix = "bench_gpu" if results["profile"]["device"] == "cuda" else "bench"
    for section in SECTIONS:
        if section not in results:
            continue
        figures = {
            "section": results[section],
            "profile": results["profile"],
            "quick": results["quick"],
            "data_plane": {
                "chunk_bytes": results["machine"]["chunk_bytes"],
                "gpu": results["machine"]["gpu"],
            },
            "goals": [goal for goal in results["goals"] if goal["section"] == section],
        }
        print(
            f"wrote {record_result(f'{prefix}_{section}', figures, directory, load=load, command=results['command'])}"
        )


if __name__ == "__main__":
    main()
