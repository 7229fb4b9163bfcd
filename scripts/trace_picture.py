"""docs/tracing.md's picture of one trace, drawn from a real exported one.

`--record` first runs one chat request with four images through encoder-gateway into vLLM (from
.venv-engines, `--otlp-traces-endpoint`), the images encoded on two encoder-server processes, every one of
them exporting over OTLP/gRPC to an endpoint of this script's own (testkit/otlp_collector.py), and writes
that trace's spans as JSON. Then each span is drawn as a bar on a timeline, in tree order, coloured by
service, with its events as marks (needs matplotlib: `pip install 'encoder-service[docs]'`).

    python scripts/trace_picture.py --record docs/figures/trace.json docs/figures/trace.png
    python scripts/trace_picture.py docs/figures/trace.json docs/figures/trace.png   # draw again
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # this checkout's packages, not an installed copy

from testkit.otlp_collector import ExportedSpan, OtlpCollector, load

SIZES = [(448, 336), (224, 224), (336, 448), (112, 224)]


async def record(path: Path) -> None:
    """One chat request through the gateway, vLLM and two encoders, all traced; its spans into `path`."""
    import aiohttp

    from encoder_common import tracing
    from gateway.app import start
    from gateway.config import GatewayConfig
    from testkit.chat import chat_request, image_part
    from testkit.default_model import write_default_model
    from testkit.images import image_bytes
    from testkit.launcher import launch_server
    from testkit.vllm_server import launch_vllm

    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="trace-picture-")))
        collector = stack.enter_context(OtlpCollector())
        model = write_default_model(work / "model")
        quick_export = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
        flags = ("--dtype", "float32", "--otlp-traces-endpoint", collector.endpoint)
        encoders = [
            stack.enter_context(
                launch_server(model, *flags, log_dir=work, env={"OTEL_SERVICE_NAME": name, **quick_export})
            )
            for name in ("encoder-server-a", "encoder-server-b")
        ]
        vllm = stack.enter_context(
            launch_vllm(
                model,
                log_path=work / "vllm.log",
                extra_args=("--otlp-traces-endpoint", collector.grpc_endpoint),  # vLLM's default: OTLP/gRPC
                extra_env={"OTEL_SERVICE_NAME": "vllm", **quick_export},
            )
        )
        os.environ.update(quick_export)
        tracing.configure("encoder-gateway", collector.endpoint)
        config = GatewayConfig(
            engine_url=vllm.url, encoders=tuple(e.url for e in encoders), host="127.0.0.1", port=0
        )
        runner, port = await start(config)
        try:
            parts = [image_part(image_bytes(w, h, seed=i)) for i, (w, h) in enumerate(SIZES)]
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                async with session.post(url, json=chat_request(str(model), parts)) as reply:
                    assert reply.status == 200, await reply.text()
        finally:
            await runner.cleanup()
            tracing.shutdown()

        def whole(spans: list[ExportedSpan]) -> bool:
            """vLLM's span (the last to end) is in, and so are the spans of every service."""
            engine = [span for span in spans if span.name == "llm_request"]
            return bool(engine) and len({s.service for s in spans if s.trace_id == engine[0].trace_id}) == 4

        exported = collector.wait_for(whole, timeout=60)
        spans = collector.trace(next(span.trace_id for span in exported if span.name == "llm_request"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(span) for span in spans], indent=1))
    print(f"wrote {path}: {len(spans)} spans from {sorted({s.service for s in spans})}")


def tree_order(spans: list[ExportedSpan]) -> list[tuple[int, ExportedSpan]]:
    """(depth, span) depth first from the root, children by start time."""
    ids = {span.span_id for span in spans}
    by_parent: dict[str, list[ExportedSpan]] = {}
    for span in sorted(spans, key=lambda s: s.start_ns):
        by_parent.setdefault(span.parent_id if span.parent_id in ids else "", []).append(span)
    ordered: list[tuple[int, ExportedSpan]] = []

    def visit(parent_id: str, depth: int) -> None:
        for span in by_parent.get(parent_id, []):
            ordered.append((depth, span))
            visit(span.span_id, depth + 1)

    visit("", 0)
    return ordered


def draw(spans: list[ExportedSpan], path: Path) -> None:
    """Two panels on one time axis each: the whole request, and its encode (up to the engine call)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = tree_order(spans)
    start = min(span.start_ns for span in spans)
    engine_call = min((s.start_ns for s in spans if s.kind == "CLIENT" and s.name == "POST"), default=None)
    services = sorted({span.service for span in spans})
    colours = dict(zip(services, plt.get_cmap("tab10").colors))
    fig, axes = plt.subplots(
        1, 2, figsize=(14, 0.3 * len(rows) + 1.4), sharey=True, gridspec_kw={"width_ratios": [1, 2]}
    )
    for ax in axes:
        for y, (_, span) in enumerate(rows):
            left, width = (span.start_ns - start) / 1e6, (span.end_ns - span.start_ns) / 1e6
            ax.barh(
                y, max(width, 0.2), left=left, color=colours[span.service], edgecolor="black", linewidth=0.3
            )
            for _, at_ns, _attributes in span.events:
                ax.plot((at_ns - start) / 1e6, y, marker="|", color="black", markersize=9)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.grid(axis="x", linewidth=0.3)
    whole, encode = axes
    whole.set_yticks(
        range(len(rows)), [_label(depth, span) for depth, span in rows], fontsize=7, family="monospace"
    )
    for tick in whole.get_yticklabels():
        tick.set_horizontalalignment("left")
    whole.tick_params(axis="y", pad=230)
    whole.set_title("the whole request", fontsize=9)
    whole.set_xlabel("ms since the gateway received it")
    if engine_call is not None:
        encode.set_xlim(0, (engine_call - start) / 1e6 * 1.1)
    encode.set_title("its encode, up to the engine call (|: an event, e.g. an item sent)", fontsize=9)
    encode.set_xlabel("ms since the gateway received it")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[s]) for s in services]
    fig.legend(handles, services, loc="lower center", ncol=len(services), fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def _label(depth: int, span: ExportedSpan) -> str:
    index = span.attributes.get("encoder.item.index")
    item = f" [item {index}]" if index is not None else ""
    return "  " * depth + span.name + item + (" ERROR" if span.status == "ERROR" else "")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("spans", type=Path, help="the trace's spans as JSON (written with --record)")
    parser.add_argument("picture", type=Path, help="the PNG to draw")
    parser.add_argument("--record", action="store_true", help="record the trace first (needs .venv-engines)")
    args = parser.parse_args()
    if args.record:
        asyncio.run(record(args.spans))
    draw(load(args.spans), args.picture)


if __name__ == "__main__":
    main()
