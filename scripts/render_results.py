"""Draws the docs' measured tables and plots from the result files in benchmarks/results/ (written by the
benchmarks' `--record`): each table between `<!-- results:NAME -->` and `<!-- /results:NAME -->` in
README.md and docs/*.md, each plot to docs/figures/NAME.svg. A table or plot whose result file is
missing is an error, so no page can show a figure that no result file holds.

    python scripts/render_results.py            # rewrite the tables and plots
    python scripts/render_results.py --check    # exit 1 when a page's tables differ from the result files
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path("benchmarks/results")
FIGURES = Path("docs/figures")
BLOCK = re.compile(r"(<!-- results:([\w-]+) -->\n)(.*?)(<!-- /results:\2 -->)", re.DOTALL)


class MissingResult(LookupError):
    """A table or plot asked for a result file that benchmarks/results/ does not hold."""


class Results:
    """The result files of one checkout, by name (the file name without `.json`)."""

    def __init__(self, root: Path):
        self.dir = root / RESULTS
        self.files = {path.stem: json.loads(path.read_text()) for path in sorted(self.dir.glob("*.json"))}

    def __getitem__(self, name: str) -> dict:
        if name not in self.files:
            raise MissingResult(f"no result file {RESULTS / name}.json: run the benchmark with --record")
        return self.files[name]

    def has(self, *names: str) -> bool:
        return all(name in self.files for name in names)


# Formatting.


def num(value: float, digits: int = 2) -> str:
    return f"{value:,.{digits}f}"


def ratio(value: float) -> str:
    return f"{value:.2f}x"


def markdown(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def machine(doc: dict) -> str:
    m = doc["machine"]
    gpu = doc["result"].get("data_plane", {}).get("gpu") if isinstance(doc["result"], dict) else None
    return f"{m['cores']}-core {m['cpu']}, {m['memory_gib']:.0f} GiB" + (f", {gpu}" if gpu else "")


def load(doc: dict) -> str:
    load = doc["load"]
    text = f"load average {load['load_average_after'][0]:.1f} after"
    if "load_average_before" in load:
        text = f"load average {load['load_average_before'][0]:.1f} before, {load['load_average_after'][0]:.1f} after"
    if "others_cores_mean" in load:
        text += f", other processes {load['others_cores_mean']:.1f} cores"
    return text


def caption(page: Path, root: Path, docs: Sequence[dict], names: Sequence[str]) -> str:
    """Where a table's figures come from: machine, date, load, command, and links to the result files."""
    links = ", ".join(
        f"[{name}.json]({Path('../' * (len(page.relative_to(root).parts) - 1)) / RESULTS / name}.json)"
        for name in names
    )
    runs = []
    for doc in docs:
        run = f"{machine(doc)}, {doc['date']} ({load(doc)}): `{doc['command']}`"
        if run not in runs:
            runs.append(run)
    return f"Measured on {'; and on '.join(runs)}. Data: {links}."


# Tables. Each takes the result files and returns (the table's lines, the names of the files it read).

Table = Callable[[Results], tuple[list[str], list[str]]]
TABLES: dict[str, Table] = {}


def table(name: str) -> Callable[[Table], Table]:
    def register(render: Table) -> Table:
        TABLES[name] = render
        return render

    return register


def goal_cells(goal: dict) -> list[str]:
    sign = ">=" if goal["at_least"] else "<="
    verdict = "yes" if goal["met"] else "no"
    if "ceiling" in goal:
        verdict += f" (ceiling {goal['ceiling']:.2f}{'' if goal['reachable'] else ', out of reach'})"
    return [goal["goal"], f"{sign} {goal['target']:g}", f"{goal['measured']:.2f}", verdict]


def goal_cell(goals: list[dict]) -> str:
    return ", ".join(
        f"{'>=' if g['at_least'] else '<='} {g['target']:g}: {'met' if g['met'] else 'not met'}"
        for g in goals
    )


@table("bench-serving")
def bench_serving(results: Results) -> tuple[list[str], list[str]]:
    """The encoder server against its baselines: serving, batching, scale-out, cache, image sizes."""
    names = ["bench_serving", "bench_batching", "bench_scale_out", "bench_cache", "bench_image_sizes"]
    s = {name.removeprefix("bench_"): results[name]["result"]["section"] for name in names}
    goals = {name.removeprefix("bench_"): results[name]["result"]["goals"] for name in names}

    def rate(r: dict, side: str) -> str:
        return f"{r[f'{side}_images_per_s']['median']:.1f} img/s"

    cores = s["scale_out"]["encoder_cores_used"]
    rows = [
        [f"serving, {s['serving']['image']}", f"server {rate(s['serving'], 'server')}",
         f"in-process {rate(s['serving'], 'in_process')}", ratio(s["serving"]["ratio"]), goal_cell(goals["serving"])],
        [f"batching, {s['batching']['clients']} clients", f"on {rate(s['batching'], 'on')}",
         f"off {rate(s['batching'], 'off')}", ratio(s["batching"]["ratio"]), goal_cell(goals["batching"])],
        [f"scale-out, {s['scale_out']['image']} (cores used {cores['two']:.2f} vs {cores['one']:.2f})",
         f"2 processes {rate(s['scale_out'], 'two')}", f"1 process {rate(s['scale_out'], 'one')}",
         ratio(s["scale_out"]["ratio"]), goal_cell(goals["scale_out"])],
        [f"cache, {s['cache']['image']}", f"hit {s['cache']['hit_ms']['median']:.2f} ms",
         f"miss {s['cache']['miss_ms']['median']:.1f} ms", f"{s['cache']['speedup']:.0f}x faster",
         goal_cell(goals["cache"])],
    ]  # fmt: skip
    for size, r in s["image_sizes"]["sizes"].items():
        rows.append(
            [f"images {size}", f"{r['images_per_s']:.1f} img/s", f"{r['tokens_per_image']} tokens", "", ""]
        )
    return markdown(["figure", "ours", "baseline (same run)", "ratio", "goal"], rows), names


TRANSPORT_LABELS = {  # gbps key -> what a reader calls it
    "bare_seq": "bare grpcio, one at a time",
    "bare_x4": "bare grpcio, 4 in flight",
    "bare_named_seq": "bare grpcio with the image's sha256, one at a time",
    "bare_named_x4": "bare grpcio with the image's sha256, 4 in flight",
    "stream_cached_seq": "stream, cached, one at a time",
    "stream_cached_x4": "stream, cached, 4 in flight",
    "stream_computed_seq": "stream, computed, one at a time",
    "stream_computed_x4": "stream, computed, 4 in flight",
    "shm": "shared memory, one at a time",
    "shm_x4": "shared memory, 4 in flight",
    "zmq": "zmq raw frames",
    "memcpy": "memcpy (cache-resident)",
    "memcpy_threads": "memcpy, split across threads",
    "memcpy_cold": "memcpy from memory",
}


def transport_sizes(section: dict) -> list[str]:
    return [size for size, value in section.items() if isinstance(value, dict) and "gbps" in value]


@table("transport-rates")
def transport_rates(results: Results) -> tuple[list[str], list[str]]:
    """GB/s of every path at each item size."""
    section = results["bench_transport"]["result"]["section"]
    sizes = transport_sizes(section)
    keys = list(dict.fromkeys(key for size in sizes for key in section[size]["gbps"]))
    rows = [
        [TRANSPORT_LABELS.get(key, key.replace("_", " "))]
        + [num(section[size]["gbps"][key]) if key in section[size]["gbps"] else "" for size in sizes]
        for key in keys
    ]
    if any("mooncake_gbps" in section[size] for size in sizes):
        rows.append(
            ["mooncake transfer engine, TCP"] + [num(section[size].get("mooncake_gbps", 0)) for size in sizes]
        )
    lines = markdown(["path", *(f"{size.removesuffix('MiB')} MiB, GB/s" for size in sizes)], rows)
    small = section.get("small")
    if small:
        lines += [
            "",
            *markdown(
                ["one cached item of " + f"{small['tokens']} tokens", "ours", "bare grpcio", "ratio"],
                [
                    [
                        "latency",
                        f"{small['ours_ms']['median']:.2f} ms",
                        f"{small['bare_ms']['median']:.2f} ms",
                        ratio(small["ours_vs_bare_latency"]),
                    ]
                ],
            ),
        ]
    return lines, ["bench_transport"]


@table("profile-dataplane")
def profile_dataplane(results: Results) -> tuple[list[str], list[str]]:
    names = sorted(n for n in results.files if n.startswith("profile_dataplane_"))
    if not names:
        raise MissingResult("no result file benchmarks/results/profile_dataplane_*.json")
    rows = []
    for name in names:
        r = results[name]["result"]
        case = f"{r['payload_bytes'] / 2**20:.0f} MiB, {r['in_flight']} in flight"
        for row, f in r["rows"].items():
            rows.append(
                [
                    case,
                    row,
                    f"{f['wall_ms']:.2f}",
                    f"{f['server_cpu_ms']:.2f}",
                    f"{f['client_cpu_ms']:.2f}",
                    f"{f['loop_turns']:.1f}",
                ]
            )
    header = ["calls", "path", "wall ms", "server CPU ms", "client CPU ms", "loop turns"]
    return markdown(header, rows), names


@table("precomputed")
def precomputed(results: Results) -> tuple[list[str], list[str]]:
    r = results["precomputed"]["result"]
    base = r["request_ms"]["all raw"]
    rows = [[name, f"{ms:.1f} ms", ratio(ms / base)] for name, ms in r["request_ms"].items()]
    title = f"request of {r['items']} images {r['image']} ({r['tokens']} tokens, {r['dtype']})"
    lines = markdown([title, "median", "of all raw"], rows)
    b = r["batch_embedding"]
    lines += [
        "",
        (
            f"A chunked-prefill window (`window_rows`, {r['items']} items) took {r['window_rows_us']:.1f} us; "
            f"`batch_embedding` of 3 requests ({b['mib']:.0f} MiB) {b['ms']:.1f} ms, "
            f"{ratio(b['ms'] / b['torch_cat_ms'])} one `torch.cat` of the same rows."
        ),
    ]
    return lines, ["precomputed"]


@table("metrics-overhead")
def metrics_overhead(results: Results) -> tuple[list[str], list[str]]:
    r = results["metrics_overhead"]["result"]
    mib = r["payload_bytes"] / 2**20
    rows = [
        [f"framing a {mib:.0f} MiB item into chunk messages", f"{r['framing_us']:.0f} us"],
        ["the per-call accounting of one item sent", f"{r['accounting_us']:.1f} us ({ratio(r['ratio'])})"],
    ]
    return markdown(["work, per call", f"time (mean of {r['rounds']})"], rows), ["metrics_overhead"]


@table("affinity")
def affinity(results: Results) -> tuple[list[str], list[str]]:
    """Placement modes by workload: forwards, their ratio to distinct images, hit rate, throughput, latency."""
    r = results["affinity"]["result"]
    rows = []
    for m in r["results"]:
        rows.append(
            [
                m["workload"],
                m["mode"],
                f"{m['forwards']:,}",
                f"{m['forwards'] / m['distinct_images']:.2f}",
                f"{m['fleet_hit_rate']:.0%}",
                f"{m['receiver_cache_hits']:,}",
                f"{m['throughput_rps']:.1f}"
                if "light" not in m["workload"] and "80%" not in m["workload"]
                else "",
                f"{m['p50_ms']:.0f}",
                f"{m['p99_ms']:.0f}",
            ]
        )
    header = ["workload", "mode", "forwards", "per distinct image", "fleet hit rate", "no RPC", "req/s"]
    a = r["args"]
    workloads = (
        f"{a['encoders']} encoder processes per mode. Zipf: {a['requests']:,} requests of 1-4 images from "
        f"{a['images']} PNGs, Zipf({a['zipf']}) popularity, {a['concurrency']} in flight; no repeats: "
        f"{a['no_repeat_requests']:,} requests; light and 80%: {a['latency_requests']} requests each, one at a "
        f"time and as a Poisson process; hot image: {a['hot_requests']} requests."
    )
    lines = [workloads, "", *markdown([*header, "p50 ms", "p99 ms"], rows)]
    if "membership" in r:
        m = r["membership"]
        lines += [
            "",
            (
                f"One of 5 encoders leaving moved {m['moved']} of the {m['lived_on_the_other_four']} images "
                "that lived on the other four."
            ),
        ]
    if "slow" in r:
        before, slowed = r["slow"]["before"]["share_of_new_work"], r["slow"]["slowed"]["share_of_new_work"]
        lines += [
            "",
            (
                f"Two receivers sharing 4 encoders: the encoder made slow took {before:.1%} of the new work "
                f"before and {slowed:.1%} while slow."
            ),
        ]
    return lines, ["affinity"]


@table("connector-handoff")
def connector_handoff(results: Results) -> tuple[list[str], list[str]]:
    r = results["connector_handoff"]["result"]
    ms = {name: value * 1000 for name, value in r["median_s"].items()}
    rows = [
        ["connector, gRPC stream", f"{ms['grpc']:.1f} ms", "1.00x"],
        [
            "connector, shared memory (encoder on the engine's host)",
            f"{ms['shm']:.1f} ms",
            ratio(ms["shm"] / ms["grpc"]),
        ],
        [
            (
                f"JSON embeddings ({ms['to_gateway']:.1f} to the gateway + {ms['json_write']:.1f} writing + "
                f"{ms['json_read']:.1f} parsing)"
            ),
            f"{ms['json']:.1f} ms",
            ratio(ms["json"] / ms["grpc"]),
        ],
    ]
    mib = r["payload_bytes"] / 2**20
    return markdown(
        [f"hand-off of one {mib:.0f} MiB item", f"median of {r['rounds']}", "vs connector over gRPC"], rows
    ), ["connector_handoff"]


@table("encode-stage")
def encode_stage(results: Results) -> tuple[list[str], list[str]]:
    names = [
        n
        for n in ("encode_stage_transformers_default_cpu", "encode_stage_vllm_default_cpu")
        if results.has(n)
    ]
    if not names:
        raise MissingResult(
            "no result file benchmarks/results/encode_stage_*.json: run bench_encode_stage.py --record"
        )
    rows = []
    for name in names:
        r = results[name]["result"]
        for image, f in r["images"].items():
            ours, theirs = f["ours_ms"], f["vllm_ms"]
            diff = f["largest_embedding_difference"]
            rows.append(
                [
                    r["backend"],
                    f"{image} ({f['tokens']} tokens)",
                    f"{ours['total']:.1f} (forward {ours['forward']:.1f})",
                    f"{theirs['total']:.1f} (tower {theirs['tower']:.1f})",
                    ratio(f["ratio"]),
                    ("0" if diff == 0 else f"{diff:.0e}") if isinstance(diff, float) else str(diff),
                ]
            )
    header = ["our backend", "image", "ours ms", "vLLM ms", "ours / vLLM", "max diff"]
    return markdown(header, rows), names


@table("stalled-clients")
def stalled_clients(results: Results) -> tuple[list[str], list[str]]:
    names = sorted(n for n in results.files if n.startswith("stalled_clients_"))
    if not names:
        raise MissingResult("no result file benchmarks/results/stalled_clients_*.json")
    rows = []
    for name in names:
        r = results[name]["result"]
        began = r["stalled_began"]
        admitted = began.get("header", 0) + began.get("chunk", 0)
        shape = "on one connection" if r["shape"] == "one-connection" else "each on its own connection"
        rows.append(
            [
                f"{r['clients']:,} {shape} ({r['encoder']} encoder)",
                f"{admitted} / {r['clients'] - admitted}",
                f"{r['rss_growth_mib']:,} MiB",
                f"{r['fresh_served']} served, {len(r['fresh_failed'])} failed, slowest {r['fresh_slowest_s']:.2f} s",
                f"{r['reader_served']} served, {len(r['reader_failed'])} failed, slowest {r['reader_slowest_s']:.2f} s",
                f"{r['health_probes'] - len(r['health_not_serving'])} of {r['health_probes']} SERVING",
            ]
        )
    header = [
        "stalled clients",
        "admitted / refused",
        "RSS growth",
        "fresh clients",
        "reader",
        "health probes",
    ]
    return markdown(header, rows), names


@table("fuzz")
def fuzz(results: Results) -> tuple[list[str], list[str]]:
    r = results["fuzz"]["result"]
    rows = [
        [name, f"{t['inputs']:,}", str(len(t["findings"])), f"{t['seconds']:.0f} s"]
        for name, t in r["targets"].items()
    ]
    return markdown(["target", "inputs", "findings", "time"], rows), ["fuzz"]


@table("gateway-latency")
def gateway_latency(results: Results) -> tuple[list[str], list[str]]:
    r = results["gateway_latency"]["result"]
    ms, base = r["median_ms"], r["median_ms"]["direct"]
    rows = [
        ["vLLM alone, raw image (its own tower)", f"{base:.1f}", "1.00x"],
        ["gateway -> vLLM", f"{ms['through']:.1f}", ratio(ms["through"] / base)],
        ["of which: encode through the receiver", f"{ms['encode']:.1f}", ratio(ms["encode"] / base)],
        ["of which: hand-off (serialize the part)", f"{ms['handoff']:.1f}", ratio(ms["handoff"] / base)],
        ["of which: vLLM on the embedding part", f"{ms['engine']:.1f}", ratio(ms["engine"] / base)],
    ]
    s = r["serialization"]
    lines = markdown(
        [f"one request, one {r['image']} image (median of {r['repeats']})", "ms", "vs vLLM alone"], rows
    )
    lines += [
        "",
        (
            f"Serializing one {s['tokens']} x {s['hidden']} bf16 item: {s['tensor_bytes']:,} tensor bytes become "
            f"{s['base64_bytes']:,} bytes of base64(torch.save), {s['serialize_ms']:.1f} ms to write and "
            f"{s['load_ms']:.1f} ms for vLLM to load."
        ),
    ]
    return lines, ["gateway_latency"]


GATEWAY_PATHS = {
    "vllm": "vLLM alone (its own tower)",
    "inline": "gateway, inline",
    "connector": "gateway, connector",
}


@table("gateway-load")
def gateway_load(results: Results) -> tuple[list[str], list[str]]:
    paths = results["gateway_load"]["result"]["paths"]
    base = paths["vllm"]["request_throughput"]
    rows = [
        [
            GATEWAY_PATHS.get(path, path),
            f"{p['request_throughput']:.2f}",
            ratio(p["request_throughput"] / base),
            f"{p['p50_ttft_ms']:.0f} / {p['p99_ttft_ms']:.0f}",
            f"{p['p50_e2el_ms']:.0f} / {p['p99_e2el_ms']:.0f}",
            f"{p['failed']} of {p['requests']}",
            f"{p['same_token_ids_as_vllm']} of {p['requests']}",
        ]
        for path, p in paths.items()
    ]
    header = [
        "path",
        "req/s",
        "vs vLLM alone",
        "TTFT p50 / p99 ms",
        "E2E p50 / p99 ms",
        "failed",
        "vLLM's token ids",
    ]
    return markdown(header, rows), ["gateway_load"]


@table("demo")
def demo(results: Results) -> tuple[list[str], list[str]]:
    return ["```", *results["demo"]["result"]["output"], "```"], ["demo"]


# Plots. Each draws one figure from the result files, or raises MissingResult.

Plot = Callable[[Results, "object"], None]
PLOTS: dict[str, Plot] = {}


def plot(name: str) -> Callable[[Plot], Plot]:
    def register(draw: Plot) -> Plot:
        PLOTS[name] = draw
        return draw

    return register


@plot("transport-goals")
def transport_goals_plot(results: Results, ax) -> None:
    """Each transport goal as measured / target (past 1: met), with the run's ceiling where it has one."""
    goals = results["bench_transport"]["result"]["goals"]
    labels = [
        g["goal"].removeprefix("transport ") + f" {'>=' if g['at_least'] else '<='} {g['target']:g}"
        for g in goals
    ]

    def score(goal: dict, value: float) -> float:
        return value / goal["target"] if goal["at_least"] else goal["target"] / value

    ys = range(len(goals))
    ax.barh(
        ys,
        [score(g, g["measured"]) for g in goals],
        color=["tab:green" if g["met"] else "tab:red" for g in goals],
    )
    ceilings = [(y, score(g, g["ceiling"])) for y, g in zip(ys, goals) if "ceiling" in g]
    ax.scatter(
        [c for _, c in ceilings], [y for y, _ in ceilings], marker="|", s=120, color="black", label="ceiling"
    )
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(list(ys), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("measured / target (log; past 1 is met: green met, red not)")
    ax.set_title("data-plane goals of scripts/bench.py")
    ax.legend(loc="lower right")
    ax.figure.set_size_inches(10, 0.22 * len(goals) + 1.4)


@plot("cache-hit-miss")
def cache_hit_miss(results: Results, ax) -> None:
    r = results["bench_cache"]["result"]["section"]
    images = range(1, len(r["miss_ms"]["runs"]) + 1)
    for key, label in (("miss_ms", "miss (decode, preprocess, forward)"), ("hit_ms", "hit (cache)")):
        ax.plot(images, r[key]["runs"], marker="o", label=label)
    ax.set_xticks(list(images))
    ax.set_yscale("log")
    ax.set_xlabel("image (each encoded, then asked for again)")
    ax.set_ylabel("latency, ms (log)")
    ax.set_title(f"embedding cache, {r['image']}: miss vs hit")
    ax.legend()


@plot("transport-rates")
def transport_rates_plot(results: Results, ax) -> None:
    section = results["bench_transport"]["result"]["section"]
    sizes = transport_sizes(section)
    keys = [
        k
        for k in TRANSPORT_LABELS
        if all(k in section[s]["gbps"] for s in sizes) and not k.startswith("bare_named")
    ]
    width = 0.8 / len(sizes)
    for i, size in enumerate(sizes):
        ax.barh(
            [y + i * width for y in range(len(keys))],
            [section[size]["gbps"][k] for k in keys],
            height=width,
            label=f"{size.removesuffix('MiB')} MiB item",
        )
    ax.set_yticks(
        [y + width * (len(sizes) - 1) / 2 for y in range(len(keys))], [TRANSPORT_LABELS[k] for k in keys]
    )
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("GB/s (log)")
    ax.set_title("data plane: rate by path and item size")
    ax.legend()
    ax.figure.set_size_inches(8, 0.35 * len(keys) + 1.5)


@plot("affinity-forwards")
def affinity_forwards(results: Results, ax) -> None:
    runs = [
        m
        for m in results["affinity"]["result"]["results"]
        if m["workload"] in ("zipf", "no-repeat", "hot image")
    ]
    workloads = list(dict.fromkeys(m["workload"] for m in runs))
    modes = list(dict.fromkeys(m["mode"] for m in runs))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        values = {m["workload"]: m["forwards"] / m["distinct_images"] for m in runs if m["mode"] == mode}
        ax.bar(
            [x + i * width for x in range(len(workloads))],
            [values.get(w, 0) for w in workloads],
            width,
            label=mode,
        )
    ax.set_xticks([x + width * (len(modes) - 1) / 2 for x in range(len(workloads))], workloads)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("forwards per distinct image")
    ax.set_title("how often the fleet encodes each image, by placement")
    ax.legend()


@plot("affinity-receivers")
def affinity_receivers(results: Results, ax) -> None:
    runs = results["affinity"]["result"].get("shared")
    if not runs:
        raise MissingResult("affinity.json has no shared-fleet scenario")
    for fleet in dict.fromkeys(r["fleet"] for r in runs):
        points = sorted((r["receivers"], r["x_distinct"]) for r in runs if r["fleet"] == fleet)
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=fleet)
    ax.set_xticks(sorted({r["receivers"] for r in runs}))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("receivers (prefill nodes) sharing 4 encoders")
    ax.set_ylabel("forwards per distinct image")
    ax.set_title("how often the fleet encodes each image as prefill nodes are added")
    ax.legend()


@plot("affinity-latency")
def affinity_latency(results: Results, ax) -> None:
    runs = [
        m
        for m in results["affinity"]["result"]["results"]
        if "light" in m["workload"] or "80%" in m["workload"]
    ]
    if not runs:
        raise MissingResult("affinity.json has no latency phase")
    workloads = list(dict.fromkeys(m["workload"] for m in runs))
    modes = list(dict.fromkeys(m["mode"] for m in runs))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        by = {m["workload"]: m for m in runs if m["mode"] == mode}
        xs = [x + i * width for x in range(len(workloads))]
        ax.bar(xs, [by[w]["p99_ms"] for w in workloads], width, alpha=0.35, color=f"C{i}")
        ax.bar(
            xs, [by[w]["p50_ms"] for w in workloads], width, color=f"C{i}", label=f"{mode} (p50; pale: p99)"
        )
    ax.set_xticks([x + width * (len(modes) - 1) / 2 for x in range(len(workloads))], workloads)
    ax.set_ylabel("request latency, ms")
    ax.set_title("latency at light load and at 80% of random placement's capacity")
    ax.legend()


@plot("gateway-load")
def gateway_load_plot(results: Results, ax) -> None:
    paths = results["gateway_load"]["result"]["paths"]
    names = list(paths)
    xs = range(len(names))
    for q, alpha in (("p99", 0.35), ("p50", 1.0)):
        ax.bar(xs, [paths[n][f"{q}_ttft_ms"] for n in names], 0.6, alpha=alpha, color="C0", label=f"TTFT {q}")
    ax.set_xticks(list(xs), [GATEWAY_PATHS.get(n, n) for n in names])
    ax.set_ylabel("time to first token, ms")
    twin = ax.twinx()
    twin.plot(
        list(xs),
        [paths[n]["request_throughput"] for n in names],
        "o",
        color="C3",
        markersize=9,
        label="requests/s",
    )
    twin.set_ylabel("requests/s")
    twin.set_ylim(bottom=0)
    ax.set_title("chat requests through the gateway against vLLM alone")
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper left")


def draw(results: Results, root: Path) -> list[Path]:
    """Every plot whose result files exist, as SVG under docs/figures/; other SVGs there are removed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.hashsalt": "render_results", "svg.fonttype": "none", "font.size": 9})
    out = root / FIGURES
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw_one in PLOTS.items():
        figure, ax = plt.subplots(figsize=(8, 4.5))
        try:
            draw_one(results, ax)
        except MissingResult:
            plt.close(figure)
            continue
        figure.tight_layout()
        path = out / f"{name}.svg"
        figure.savefig(path, format="svg", metadata={"Date": None})
        plt.close(figure)
        written.append(path)
    for stale in set(out.glob("*.svg")) - set(written):
        stale.unlink()
    return written


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def render_page(text: str, page: Path, root: Path, results: Results) -> str:
    def block(match: re.Match) -> str:
        name = match.group(2)
        if name not in TABLES:
            raise KeyError(f"{page.relative_to(root)}: no table named {name!r} in scripts/render_results.py")
        lines, names = TABLES[name](results)
        body = "\n".join([*lines, "", caption(page, root, [results[n] for n in names], names)])
        return f"{match.group(1)}{body}\n{match.group(4)}"

    return BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 when a page is out of date"
    )
    parser.add_argument(
        "--root", type=Path, default=REPO_ROOT, help="the checkout to render (default: this one)"
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    results = Results(root)
    stale = []
    for page in pages(root):
        text = page.read_text()
        rendered = render_page(text, page, root, results)
        if rendered != text:
            stale.append(page.relative_to(root))
            if not args.check:
                page.write_text(rendered)
    if args.check:
        for page in stale:
            print(f"{page} is out of date: run python scripts/render_results.py", file=sys.stderr)
        return 1 if stale else 0
    for path in draw(results, root):
        print(f"drew {path.relative_to(root)}")
    for page in stale:
        print(f"rewrote the tables of {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
