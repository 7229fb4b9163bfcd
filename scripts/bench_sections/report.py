"""The benchmark's goals (each a ratio of the run against a target, with its ceiling where the run's
baselines set one) and the table it prints."""

from __future__ import annotations

from collections.abc import Sequence

from testkit.bench_harness import aligned_table

from .profile import MiB
from .transport_items import IN_FLIGHT, SERVED_SIZE

TRANSPORT_GOALS = [  # per item size: (name, path in the size's results, target, at least (True) or at most,
    # the key of its ceiling in this run, when `ceilings` knows one)
    *[(f"stream cached {mode} / bare grpcio {mode}", ("stream_vs_bare_same_mode", f"stream_cached_{mode}"), 0.9, True,
       None) for mode in ("seq", "x4")],
    *[(f"stream cached {mode} / bare grpcio {mode} with the same request",
       ("stream_vs_bare_same_request", f"stream_cached_{mode}"), 0.9, True, None) for mode in ("seq", "x4")],
    *[(f"stream {mode.replace('_', ' ')} / best bare grpcio", ("stream_vs_best_bare", f"stream_{mode}"), 0.9, True,
       None if mode == "cached_x4" else f"stream_{mode}") for mode in ("cached_seq", "cached_x4", "computed_seq", "computed_x4")],
    ("shared memory seq / zmq", ("shm_vs_zmq",), 2.0, True, "shm_seq_vs_zmq"),
    ("shared memory seq / memcpy", ("shm_vs_memcpy",), 0.3, True, None),
    ("shared memory seq / memcpy", ("shm_vs_memcpy",), 0.1, True, None),
    (f"shared memory x{IN_FLIGHT} / zmq", ("shm_x4_vs_zmq",), 2.0, True, None),
    (f"shared memory x{IN_FLIGHT} / memcpy", ("shm_x4_vs_memcpy",), 0.3, True, None),
    ("shared memory / stream one-item latency", ("shm_latency_vs_stream",), 0.5, False, None),
]  # fmt: skip
SERVED_GOALS = [  # the goals above, for the server users run (its size only)
    *[(f"the server users run: stream cached {mode} / bare grpcio {mode}",
       ("served", "vs_bare_same_mode", f"served_cached_{mode}"), 0.9, True) for mode in ("seq", "x4")],
    ("the server users run: shared memory seq / zmq", ("served", "shm_vs_zmq"), 2.0, True),
    (f"the server users run: shared memory x{IN_FLIGHT} / zmq", ("served", "shm_x4_vs_zmq"), 2.0, True),
]  # fmt: skip
GOALS = [
    # (name, section, path to the ratio, target, at least (True) or at most (False), path to its ceiling)
    *[(f"transport {size // MiB} MiB: {name}", "transport", (f"{size // MiB}MiB", *path), target, at_least,
       (f"{size // MiB}MiB", "ceilings", ceiling) if ceiling else None)
      for size in (7 * MiB, 32 * MiB) for name, path, target, at_least, ceiling in TRANSPORT_GOALS],
    *[(f"transport {SERVED_SIZE // MiB} MiB: {name}", "transport", (f"{SERVED_SIZE // MiB}MiB", *path), target, at_least,
       None) for name, path, target, at_least in SERVED_GOALS],
    ("transport 64 tokens: one-item latency / bare grpcio", "transport", ("small", "ours_vs_bare_latency"), 1.3, False,
     None),
    ("serving: server / in-process", "serving", ("ratio",), 0.9, True, None),
    ("batching: on / off", "batching", ("ratio",), 1.5, True, None),
    ("scale-out: 2 processes / 1", "scale_out", ("ratio",), 1.7, True, None),
    ("cache: miss / hit latency", "cache", ("speedup",), 20.0, True, None),
    *[(f"tracing {size}: on (every request sampled) / off", "tracing", (size, "on_vs_off"), 1.03, False,
       None)
      for size in ("7MiB", "small")],
]  # fmt: skip
# The transfer engine (transport_engine.py), a cached 7 MiB item: its rate against the stream's, and the
# receiver's CPU per GB against the stream's; a declined offer against no offer at all.
GOALS += [
    *[(f"transport 7 MiB: transfer engine {mode} / stream {mode}", "transport", ("engine", "7MiB", f"engine_vs_stream_{mode}"),
       1.8, True, ("engine", "7MiB", "ceilings", f"engine_vs_stream_{mode}")) for mode in ("seq", "x4")],
    *[(f"transport 7 MiB: transfer engine {mode} receiver CPU per GB / stream's", "transport",
       ("engine", "7MiB", f"receiver_cpu_engine_vs_stream_{mode}"), 0.5, False, None) for mode in ("seq", "x4")],
    ("transport 7 MiB: auto with its offer declined / grpc", "transport", ("engine", "declined_offer", "auto_vs_grpc"),
     0.95, True, None),
]  # fmt: skip


def _lookup(results: dict, section: str, path: Sequence[str]):
    value = results.get(section)
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def goals(results: dict) -> list[dict]:
    """Each goal's measured ratio, whether it is met, and, where one is known, the most any server
    could reach in this run (`ceilings`): a goal whose target lies past its ceiling is out of reach here."""
    out = []
    for name, section, path, target, at_least, ceiling_path in GOALS:
        value = _lookup(results, section, path)
        if value is None:
            continue
        met = value >= target if at_least else value <= target
        goal = {"goal": name, "section": section, "target": target, "at_least": at_least, "measured": value}
        goal["met"] = met
        if ceiling_path is not None:
            goal["ceiling"] = _lookup(results, section, ceiling_path)
            goal["reachable"] = goal["ceiling"] >= target
        out.append(goal)
    return out


Row = tuple[str, str, str, str]  # figure, ours, baseline (same run), ratio

RATE_ROWS = [  # section, figure, (key, label) of ours, (key, label) of the baseline
    ("serving", "serving {image}", ("server", "server"), ("in_process", "in-process")),
    ("batching", "batching {clients} clients {image}", ("on", "on"), ("off", "off")),
    (
        "scale_out",
        "scale-out {image} (encoder cores used: {encoder_cores_used[two]:.2f} vs {encoder_cores_used[one]:.2f})",
        ("two", "2 processes"),
        ("one", "1 process"),
    ),
]


def transport_size_rows(size: str, r: dict) -> list[Row]:
    """The rows of one item size: the stream's four modes, shared memory, one-item latency, ceilings."""
    g, c = r["gbps"], r["ceilings"]
    best_bare = f"bare grpcio {max(g['bare_seq'], g['bare_x4']):.2f} GB/s (seq {g['bare_seq']:.2f}, x{IN_FLIGHT} {g['bare_x4']:.2f})"
    rows: list[Row] = [
        (f"stream {size} {mode.replace('_', ' ')}", f"ours {g[f'stream_{mode}']:.2f} GB/s", best_bare,
         (f"{r['stream_vs_best_bare'][f'stream_{mode}']:.2f}x ({r['stream_vs_bare_same_mode'][f'stream_{mode}']:.2f}x "
          f"of bare {mode.split('_')[1]})"))
        for mode in ("cached_seq", "cached_x4", "computed_seq", "computed_x4")
    ]  # fmt: skip
    rows += [
        (f"  cached {mode}, same request", f"ours {g[f'stream_cached_{mode}']:.2f} GB/s",
         f"bare grpcio with the image's sha256 {g[f'bare_named_{mode}']:.2f} GB/s",
         f"{r['stream_vs_bare_same_request'][f'stream_cached_{mode}']:.2f}x")
        for mode in ("seq", "x4")
    ]  # fmt: skip
    baselines = (f"zmq {g['zmq']:.2f} / memcpy {g['memcpy']:.1f} (threads {g['memcpy_threads']:.1f}, "
                 f"from memory {g['memcpy_cold']:.1f}) GB/s")
    rows += [
        (f"shared memory {size} seq", f"ours {g['shm']:.2f} GB/s", baselines,
         f"{r['shm_vs_zmq']:.2f}x / {r['shm_vs_memcpy']:.2f}x ({r['shm_vs_memcpy_cold']:.2f}x)"),
        (f"shared memory {size} x{IN_FLIGHT}", f"ours {g['shm_x4']:.2f} GB/s", baselines,
         f"{r['shm_x4_vs_zmq']:.2f}x / {r['shm_x4_vs_memcpy']:.2f}x ({r['shm_x4_vs_memcpy_cold']:.2f}x)"),
        (f"  one item {size}", f"shared memory {r['shm_latency_ms']:.2f} ms", f"stream {r['stream_latency_ms']:.2f} ms",
         f"{r['shm_latency_vs_stream']:.2f}x"),
        (f"  ceilings {size}", (f"stream seq {c['stream_cached_seq']:.2f}x, computed seq / x{IN_FLIGHT} "
                                f"{c['stream_computed_seq']:.2f}x / {c['stream_computed_x4']:.2f}x"),
         f"shm seq {c['shm_seq_vs_zmq']:.2f}x zmq", ""),
    ]  # fmt: skip
    if "served" in r:
        served = r["served"]
        rows += [
            (f"  the server users run, {label}", f"ours {g[kind]:.2f} GB/s", f"stand-in {g[standin]:.2f} GB/s",
             f"{served['vs_standin'][kind]:.2f}x")
            for kind, standin, label in (("served_cached_seq", "stream_cached_seq", "stream cached seq"),
                                         ("served_cached_x4", "stream_cached_x4", f"stream cached x{IN_FLIGHT}"),
                                         ("served_shm", "shm", "shared memory seq"),
                                         ("served_shm_x4", "shm_x4", f"shared memory x{IN_FLIGHT}"))
        ]  # fmt: skip
    if "mooncake_gbps" in r:
        rows.append((f"  mooncake tcp {size}", f"stream {g['stream_cached_seq']:.2f} GB/s",
                     f"mooncake {r['mooncake_gbps']:.2f} GB/s", f"{r['stream_vs_mooncake']:.2f}x"))  # fmt: skip
    return rows


def engine_rows(e: dict) -> list[Row]:
    """The transfer engine's rows: each size and mode against the stream, bare grpcio and memcpy, with
    both sides' CPU seconds per GB; then the declined offer."""
    rows: list[Row] = []
    for size in (key for key in e if key.endswith("MiB")):
        r = e[size]
        g, cpu = r["gbps"], r["cpu_s_per_gb"]
        for mode in ("seq", "x4"):
            engine, stream, raw = cpu[f"engine_{mode}"], cpu[f"stream_cached_{mode}"], cpu[f"raw_{mode}"]
            rows.append((
                f"transfer engine {size} {mode}",
                f"ours {g[f'engine_{mode}']:.2f} GB/s (CPU s/GB receiver {engine['receiver']:.2f}, server {engine['server']:.2f})",
                (f"stream {g[f'stream_cached_{mode}']:.2f} GB/s (receiver {stream['receiver']:.2f}, server {stream['server']:.2f}) / "
                 f"bare grpcio {g[f'bare_{mode}']:.2f} / memcpy {g['memcpy']:.1f} GB/s"),
                (f"{r[f'engine_vs_stream_{mode}']:.2f}x / {r[f'engine_vs_bare_{mode}']:.2f}x / "
                 f"{r[f'engine_vs_memcpy_{mode}']:.2f}x; receiver CPU {r[f'receiver_cpu_engine_vs_stream_{mode}']:.2f}x"),
            ))
            rows.append((
                f"  engine alone {size} {mode}",
                f"{g[f'raw_{mode}']:.2f} GB/s (CPU s/GB writer {raw['receiver']:.2f}, target {raw['server']:.2f})",
                f"ceiling of ours / stream {r['ceilings'][f'engine_vs_stream_{mode}']:.2f}x",
                f"ours {r[f'engine_vs_raw_{mode}']:.2f}x of it",
            ))  # fmt: skip
    d = e["declined_offer"]
    rows.append(("  7MiB seq, offer declined", f"auto {d['auto_gbps']:.2f} GB/s", f"grpc {d['grpc_gbps']:.2f} GB/s",
                 f"{d['auto_vs_grpc']:.2f}x"))  # fmt: skip
    return rows


def transport_rows(t: dict) -> list[Row]:
    """Every item size's rows, then the floors behind the ceilings and the small item's latency."""
    floor, small = t["floor_ms"], t["small"]
    return [
        *(row for size in t if size.endswith("MiB") for row in transport_size_rows(size, t[size])),
        *(engine_rows(t["engine"]) if "engine" in t else []),
        ("  floors (ceilings' inputs)", f"decode the JPEG {floor['jpeg_decode']:.2f} ms",
         f"bare call with the request {floor['request_ack']:.2f} ms", ""),
        (f"small item ({small['tokens']} tokens, cached)", f"ours {small['ours_ms']['median']:.2f} ms",
         f"bare grpcio {small['bare_ms']['median']:.2f} ms", f"{small['ours_vs_bare_latency']:.2f}x"),
    ]  # fmt: skip


def section_rows(results: dict) -> list[Row]:
    """The rows of every section the run has, in the order of the sections."""
    rows = transport_rows(results["transport"]) if "transport" in results else []
    for section, figure, (ours, ours_label), (base, base_label) in RATE_ROWS:
        if section in results:
            r = results[section]
            rows.append((figure.format(**r), f"{ours_label} {r[f'{ours}_images_per_s']['median']:.2f} img/s",
                         f"{base_label} {r[f'{base}_images_per_s']['median']:.2f} img/s", f"{r['ratio']:.2f}x"))  # fmt: skip
    if "cache" in results:
        r = results["cache"]
        rows.append((f"cache {r['image']}", f"hit {r['hit_ms']['median']:.2f} ms",
                     f"miss {r['miss_ms']['median']:.1f} ms", f"{r['speedup']:.0f}x faster"))  # fmt: skip
    if "tracing" in results:
        for size in ("7MiB", "small"):
            r = results["tracing"][size]
            cpu = r["cpu_us_per_call"]
            rows.append((f"tracing {size} cached, one call", f"on {r['on_ms']:.2f} ms", f"off {r['off_ms']:.2f} ms",
                         f"{r['on_vs_off']:.3f}x"))  # fmt: skip
            rows.append((f"  CPU per call {size} (both sides)", f"on {cpu['on']:.0f} us", f"off {cpu['off']:.0f} us",
                         f"+{cpu['on'] - cpu['off']:.0f} us"))  # fmt: skip
    if "image_sizes" in results:
        for size, r in results["image_sizes"]["sizes"].items():
            rows.append((f"images {size}", f"{r['images_per_s']:.2f} img/s",
                         f"{r['tokens_per_image']} tokens, {r['embedding_gbps']:.3f} GB/s of embeddings", ""))  # fmt: skip
    return rows


def goal_line(g: dict) -> str:
    sign = ">=" if g["at_least"] else "<="
    ceiling = (
        ""
        if "ceiling" not in g
        else (f" (ceiling {g['ceiling']:.2f}{'' if g['reachable'] else ': out of reach in this run'})")
    )
    return f"goal {g['goal']} {sign} {g['target']}: {g['measured']:.2f} {'met' if g['met'] else 'NOT met'}{ceiling}"


def table(results: dict) -> str:
    lines = aligned_table(("figure", "ours", "baseline (same run)", "ratio"), section_rows(results))
    load, profile = results["machine"], results["profile"]
    lines.append(f"ratios: median over rounds of pairs measured in the same round ({profile['transport_rounds']} rounds "
                 f"for the transport rows, {profile['rounds']} for the others); load average "
                 f"{load['load_average_before'][0]:.1f} before, {load['load_average_after'][0]:.1f} after")  # fmt: skip
    lines += [goal_line(g) for g in results.get("goals", [])]
    return "\n".join(lines)
