"""A fuzzing campaign, with hypothesis, on every input the services parse: the Encode, Fetch and SGLang
Encode requests as bytes off the wire, image bytes through each preprocessing profile's loader, data:
and file:// URLs, the gateway's chat requests, the chunk codec the receiver reads responses with, and
shared-memory segment names.

Each target is seeded from real inputs (requests this project's clients send, real PNG/JPEG/GIF/WebP
files, real chat bodies) and mutated (bytes flipped, cut, spliced, inserted), beside inputs drawn from
scratch. A target holds when every input either parses or raises one of the documented errors
(`EncoderError` subclasses, which the servers map to their status codes), within `--deadline-ms`
and without the process's address space passing `--memory-limit-gib` (set as RLIMIT_AS, so an
unbounded allocation shows as MemoryError). Anything else is a finding: hypothesis shrinks it and
the campaign prints it.

    .venv/bin/python scripts/fuzz.py --examples 20000            # the long campaign
    .venv/bin/python scripts/fuzz.py --examples 300 --targets encode_request,image_bytes

Prints one JSON line: per target, inputs tried and findings; exits 1 on any finding.
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from PIL import Image  # noqa: E402

from encoder_common.errors import EncoderError  # noqa: E402
from protos import encoder_pb2 as pb  # noqa: E402
from protos import wire  # noqa: E402
from testkit.bench_harness import MachineLoad, Stopwatch, add_record_flag, print_json, record_result  # noqa: E402

MAX_ITEMS = 64
MAX_REQUEST_BYTES = 64 << 20


def mutated(seeds: list[bytes]) -> st.SearchStrategy[bytes]:
    """A seed changed a few ways at random positions: bytes flipped, the tail cut, bytes inserted, a
    piece of another seed spliced in."""

    @st.composite
    def mutate(draw) -> bytes:
        data = bytearray(draw(st.sampled_from(seeds)))
        for _ in range(draw(st.integers(0, 4))):
            op = draw(st.sampled_from(["flip", "cut", "insert", "splice"]))
            at = draw(st.integers(0, len(data)))
            if op == "flip" and data:
                data[min(at, len(data) - 1)] = draw(st.integers(0, 255))
            elif op == "cut":
                del data[at:]
            elif op == "insert":
                data[at:at] = draw(st.binary(max_size=16))
            else:
                other = draw(st.sampled_from(seeds))
                start = draw(st.integers(0, len(other)))
                data[at:] = other[start:]
        return bytes(data)

    return mutate()


def wire_bytes(seeds: list[bytes]) -> st.SearchStrategy[bytes]:
    return st.one_of(mutated(seeds), st.binary(max_size=512))


def image_files() -> list[bytes]:
    """Real encoded images of the formats the loaders open, and some they refuse."""
    from testkit.images import image_bytes

    files = [image_bytes(32, 24, fmt=fmt) for fmt in ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")]
    files += [image_bytes(16, 16, mode="RGBA"), image_bytes(40, 8, mode="L", fmt="PNG")]
    frames = [Image.new("RGB", (12, 12), (i * 40, 0, 0)) for i in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    return files + [buf.getvalue()]


def encode_requests() -> list[bytes]:
    image = image_bytes_small()
    item = pb.ImageItem(index=0, modality=pb.IMAGE, data=image, content_sha256=b"\x01" * 32)
    url_item = pb.ImageItem(index=1, modality=pb.IMAGE, url="data:image/png;base64,iVBORw0KGgo=")
    requests = [
        pb.EncodeRequest(request_id="r", items=[item]),
        pb.EncodeRequest(request_id="r2", items=[item, url_item], lease=pb.Lease(ttl_ms=1000)),
        pb.EncodeRequest(request_id="r3", items=[url_item]),
    ]
    raw = [r.SerializeToString() for r in requests]
    # An item whose image comes twice and one whose url follows its image: protobuf keeps the last of each.
    twice = pb.ImageItem(index=2, data=b"first").SerializeToString() + pb.ImageItem(data=image).SerializeToString()
    replaced = twice + pb.ImageItem(url="data:,x").SerializeToString()
    raw += [b"".join((bytes((0x12,)), wire._varint(len(item)), item)) for item in (twice, replaced)]
    # As EncoderReceiver frames them: the image bytes appended to a request serialized without them.
    raw.append(wire.encode_request(pb.EncodeRequest(request_id="w"), [(pb.ImageItem(index=0, modality=pb.IMAGE), image)]))
    # A repeated image named by its sha256 beside one sent with its bytes (revision 3).
    named = pb.ImageItem(index=0, modality=pb.IMAGE, content_sha256=bytes(range(32)))
    raw.append(wire.encode_request(pb.EncodeRequest(request_id="n"), [(named, None), (pb.ImageItem(index=1), image)]))
    return raw


def image_bytes_small() -> bytes:
    from testkit.images import image_bytes

    return image_bytes(8, 8)


# The targets: each returns (seeds strategy, the check of one input).


def target_encode_request():
    from encoder_server.request_parsing import check_encode_request, parse_encode_request

    def check(raw: bytes) -> None:
        call = parse_encode_request(raw, MAX_REQUEST_BYTES)
        # The images read where they arrived must be what protobuf itself reads from the same bytes.
        whole = pb.EncodeRequest.FromString(raw)
        for item, image, expected in zip(call.request.items, call.images, whole.items):
            data = item.data if image is None else bytes(image)
            assert (item.WhichOneof("source"), data) == (expected.WhichOneof("source"), expected.data), item.index
        check_encode_request(call.request, MAX_ITEMS)

    return wire_bytes(encode_requests()), check


def target_fetch_request():
    from encoder_server.request_parsing import parse_fetch_request

    seeds = [pb.FetchRequest(keys=[bytes(range(32))] * n).SerializeToString() for n in (1, 3)]
    return wire_bytes(seeds), lambda raw: parse_fetch_request(raw, MAX_ITEMS)


def target_sglang_encode_request():
    from encoder_server.request_parsing import check_sglang_encode_request, parse_message
    from protos import sglang_encoder_pb2 as sglang_pb

    seeds = [
        sglang_pb.EncodeRequest(mm_items=["data:image/png;base64,iVBORw0KGgo=", "/tmp/x.png"], req_id="s",
                                num_parts=2, part_idx=1, prefill_host="127.0.0.1",
                                embedding_port=[5000, 5001]).SerializeToString(),  # fmt: skip
        sglang_pb.EncodeRequest(mm_items=["http://example.invalid/a.png"], req_id="t").SerializeToString(),
    ]

    def check(raw: bytes) -> None:
        request = parse_message(raw, sglang_pb.EncodeRequest, refuse_unknown=False)
        check_sglang_encode_request(request, MAX_ITEMS)

    return wire_bytes(seeds), check


def target_image_bytes():
    from encoder_server.profiles import PROFILES

    def check(data: bytes) -> None:
        for profile in PROFILES.values():
            try:
                profile.decode(data, max_pixels=1 << 20, max_aspect_ratio=200.0)
            except EncoderError:
                pass

    return st.one_of(mutated(image_files()), st.binary(max_size=256)), check


def target_data_url():
    import base64

    from encoder_common.data_uri import decode_data_uri

    png = image_bytes_small()
    seeds = [f"data:image/png;base64,{base64.b64encode(png).decode()}", "data:,hello%20world", "data:text/plain;base64,"]
    strategy = st.one_of(
        mutated([s.encode() for s in seeds]).map(lambda b: b.decode("utf-8", "replace")),
        st.text(max_size=64).map(lambda t: "data:" + t),
    )
    return strategy, decode_data_uri


def target_file_url():
    from encoder_common.file_url import read_file_url

    root = Path(tempfile.mkdtemp(prefix="fuzz-files-")).resolve()
    (root / "a.png").write_bytes(image_bytes_small())
    (root / "sub").mkdir()
    seeds = [f"file://{root}/a.png", f"file://localhost{root}/sub/../a.png", f"file://{root}/sub", "file:///dev/zero"]
    strategy = st.one_of(
        mutated([s.encode() for s in seeds]).map(lambda b: b.decode("utf-8", "replace")),
        st.text(max_size=64).map(lambda t: "file://" + t),
    )
    return strategy, lambda url: read_file_url(url, [root], max_bytes=1 << 20)


def target_gateway_chat():
    from gateway.protocol import image_parts

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
        max_leaves=20,
    )
    part = st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_image", "text", "input_audio", "video_url"]),
                               "image_url": st.one_of(st.fixed_dictionaries({"url": st.text(max_size=40)}), json_values)}),  # fmt: skip
        json_values,
    )
    message = st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.one_of(st.lists(part, max_size=4), json_values)}),
        json_values,
    )
    body = st.one_of(st.fixed_dictionaries({"messages": st.lists(message, max_size=4)}), st.dictionaries(st.text(max_size=10), json_values, max_size=3))

    def check(value: dict) -> None:
        # The body as the gateway gets it: JSON text parsed, then walked for image parts.
        image_parts(json.loads(json.dumps(value)))
        image_parts(json.loads(json.dumps(value)), pass_non_image=True)

    return body, check


def target_chunk_codec():
    header = pb.EncodeResponse(header=pb.ItemHeader(index=0, num_tokens=4, hidden_size=8, payload_bytes=64)).SerializeToString()
    chunks = list(wire.chunk_messages(memoryview(bytes(range(200))), 64))

    def check(raw: bytes) -> None:
        try:
            wire.parse_response(raw)
        except ValueError:
            pass  # a response that is neither a header nor a chunk: the call fails, as gRPC fails a bad message
        except Exception as exc:
            from google.protobuf.message import DecodeError

            if not isinstance(exc, DecodeError):
                raise

    return wire_bytes([header, *chunks]), check


def target_shm_segment_name():
    from protos.shm import is_probe_name, is_segment_name

    def check(name: str) -> None:
        is_segment_name(name)
        is_probe_name(name)

    return st.text(max_size=120), check


TARGETS: dict[str, Callable] = {
    "encode_request": target_encode_request,
    "fetch_request": target_fetch_request,
    "sglang_encode_request": target_sglang_encode_request,
    "image_bytes": target_image_bytes,
    "data_url": target_data_url,
    "file_url": target_file_url,
    "gateway_chat": target_gateway_chat,
    "chunk_codec": target_chunk_codec,
    "shm_segment_name": target_shm_segment_name,
}


def run_target(name: str, examples: int, deadline_ms: int, seed: int) -> dict:
    strategy, check = TARGETS[name]()
    tried = 0

    @settings(max_examples=examples, deadline=deadline_ms, database=None, derandomize=False, print_blob=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(strategy)
    def fuzz(value) -> None:
        nonlocal tried
        tried += 1
        try:
            check(value)
        except EncoderError:
            pass  # a documented refusal

    fuzz = _seeded(fuzz, seed)
    watch = Stopwatch()
    findings = []
    try:
        fuzz()
    except Exception as exc:  # noqa: BLE001 - a finding, shrunk by hypothesis
        findings.append(f"{type(exc).__name__}: {exc}"[:2000])
    return {"inputs": tried, "findings": findings, "seconds": round(watch.seconds(), 1)}


def _seeded(test, seed: int):
    from hypothesis import seed as hypothesis_seed

    return hypothesis_seed(seed)(test)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=300, help="inputs per target")
    p.add_argument("--targets", type=lambda s: s.split(","), default=list(TARGETS))
    p.add_argument("--deadline-ms", type=int, default=2000, help="one input taking longer is a finding (a hang)")
    p.add_argument("--memory-limit-gib", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    add_record_flag(p)
    args = p.parse_args()
    load = MachineLoad()
    unknown = set(args.targets) - set(TARGETS)
    if unknown:
        p.error(f"unknown targets {sorted(unknown)}; known: {', '.join(TARGETS)}")
    limit = int(args.memory_limit_gib * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    results = {name: run_target(name, args.examples, args.deadline_ms, args.seed) for name in args.targets}
    report = {"examples": args.examples, "seed": args.seed, "deadline_ms": args.deadline_ms, "targets": results}
    print_json(report)
    if args.record:
        print(f"wrote {record_result('fuzz', report, args.record, load=load)}")
    sys.exit(1 if any(r["findings"] for r in results.values()) else 0)


if __name__ == "__main__":
    main()
