"""Hostile and broken input, one test each: a clear INVALID_ARGUMENT naming the item and the reason
(or a correct embedding where the input is odd but valid), and the server keeps serving."""

from __future__ import annotations

import asyncio
import functools
import http.server
import io
import random
import re
import struct
import threading
import time
import zlib
from collections.abc import Sequence

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from encoder_common.sources import SourcePolicy
from protos import encoder_pb2 as pb
from receiver import EncodeFailedError, EncoderReceiver, InvalidItemError, UnsupportedModalityError
from testkit import REPO_ROOT
from testkit.images import image_bytes
from testkit.servers import running_server

MAX_PIXELS = 4096 * 4096
MAX_ITEMS = 8
MAX_REQUEST_BYTES = 1 << 20
FETCH_LIMIT = 64 << 10


@pytest.fixture(scope="module")
def allowed_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("allowed")


@pytest.fixture(scope="module")
async def server(default_model_dir, allowed_dir):
    """Small limits so every limit is cheap to cross; file:// enabled below `allowed_dir`."""
    async with running_server(
        default_model_dir,
        max_image_pixels=MAX_PIXELS,
        max_items_per_request=MAX_ITEMS,
        max_request_bytes=MAX_REQUEST_BYTES,
        sources=SourcePolicy(file_roots=(allowed_dir,), max_fetch_bytes=FETCH_LIMIT),
    ) as s:
        yield s


@pytest.fixture(scope="module")
async def plain_server(default_model_dir):
    """Default source policy: only inline bytes and data: URIs."""
    async with running_server(default_model_dir) as s:
        yield s


@pytest.fixture(scope="module")
async def channel(server):
    async with grpc.aio.insecure_channel(server.url.removeprefix("grpc://")) as ch:
        yield ch


class Reply:
    def __init__(self, code: grpc.StatusCode, details: str, messages: list[pb.EncodeResponse]):
        self.code, self.details, self.messages = code, details, messages

    @property
    def headers(self) -> list[pb.ItemHeader]:
        return [m.header for m in self.messages if m.WhichOneof("kind") == "header"]


async def call_encode(channel: grpc.aio.Channel, request: pb.EncodeRequest | bytes, timeout: float = 30.0) -> Reply:
    """One Encode call with the raw request bytes given; the status and every message back."""
    encode = channel.unary_stream(
        "/encoder.v1.EncoderService/Encode",
        request_serializer=lambda r: r if isinstance(r, bytes) else r.SerializeToString(),
        response_deserializer=pb.EncodeResponse.FromString,
    )
    call = encode(request, timeout=timeout)
    messages = []
    try:
        async for message in call:
            messages.append(message)
    except grpc.aio.AioRpcError as exc:
        return Reply(exc.code(), exc.details() or "", messages)
    return Reply(grpc.StatusCode.OK, "", messages)


def item(data: bytes | None = None, *, index: int = 0, url: str | None = None, modality=pb.IMAGE) -> pb.ImageItem:
    return pb.ImageItem(index=index, modality=modality, data=data) if url is None else pb.ImageItem(
        index=index, modality=modality, url=url
    )


def assert_clean(details: str) -> None:
    """Client-facing messages carry no stack trace and no server file path."""
    for leak in ("Traceback", 'File "', ".py", str(REPO_ROOT), "site-packages", "/tmp/", "/usr/"):
        assert leak not in details, f"{leak!r} leaked in {details!r}"


async def still_serving(channel: grpc.aio.Channel) -> None:
    reply = await call_encode(channel, pb.EncodeRequest(request_id="ok", items=[item(image_bytes(56, 56))]))
    assert reply.code == grpc.StatusCode.OK and reply.headers[0].num_tokens == 4


async def expect_invalid(channel: grpc.aio.Channel, items: Sequence[pb.ImageItem], *fragments: str) -> str:
    reply = await call_encode(channel, pb.EncodeRequest(request_id="hostile", items=list(items)))
    assert reply.code == grpc.StatusCode.INVALID_ARGUMENT, (reply.code, reply.details)
    for fragment in fragments:
        assert fragment in reply.details, (fragment, reply.details)
    # The caller's own URLs may come back; nothing else of the server's file system may.
    assert_clean(functools.reduce(lambda text, i: text.replace(i.url, "<url>") if i.url else text, items, reply.details))
    await still_serving(channel)
    return reply.details


async def embeddings(server, images: Sequence[bytes]) -> list[torch.Tensor]:
    async with EncoderReceiver([server.url]) as rx:
        result = await rx.encode("ok", [{"data": d} for d in images], num_items_assigned=[len(images)])
    return [i.embedding for i in result.items]


def encode_as(image: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **options)
    return buf.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with a few bytes of pixel data: a decompression bomb."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 4096)) + chunk(b"IEND", b"")


# --- one test per hostile input ---------------------------------------------------------------


async def test_empty_bytes(channel):
    await expect_invalid(channel, [item(image_bytes(8, 8)), item(b"", index=1)], "item 1:", "empty image bytes")


async def test_truncated_jpeg(channel):
    jpeg = image_bytes(64, 64, fmt="JPEG")
    await expect_invalid(channel, [item(jpeg[: len(jpeg) // 2], index=3)], "item 3:", "could not be decoded", "truncated")


async def test_png_claiming_100000x100000_is_refused_before_decoding(channel):
    started = time.perf_counter()
    await expect_invalid(channel, [item(png_claiming(100_000, 100_000), index=2)], "item 2:", f"over the limit of {MAX_PIXELS}")
    assert time.perf_counter() - started < 60  # 10^10 pixels were never decoded (that would take many minutes)
    # Under Pillow's own threshold the configured limit decides, and the message gives the size.
    await expect_invalid(channel, [item(png_claiming(5000, 5000))], "5000x5000 = 25000000 pixels", f"limit of {MAX_PIXELS}")


async def test_1x1_image_encodes(server):
    (embedding,) = await embeddings(server, [image_bytes(1, 1)])
    assert embedding.shape == (4, 2048)  # resized up to the processor's minimum of 56x56


async def test_1x100000_strip_is_refused_and_a_1x150_strip_encodes(server, channel):
    strip = encode_as(Image.new("RGB", (1, 100_000), (200, 10, 10)), "PNG")
    await expect_invalid(channel, [item(strip, index=4)], "item 4:", "1x100000", "aspect ratio of 100000:1", "limit of 200:1")
    (embedding,) = await embeddings(server, [encode_as(Image.new("RGB", (1, 150), (200, 10, 10)), "PNG")])
    assert embedding.shape[0] == 25  # 1x150 -> 28x700 pixels -> 2x50 patches -> 25 tokens


async def test_cmyk_jpeg_encodes_as_its_rgb_conversion(server):
    rgb = np.random.RandomState(1).randint(0, 256, (48, 64, 3), dtype=np.uint8)
    cmyk_jpeg = encode_as(Image.fromarray(rgb).convert("CMYK"), "JPEG", quality=95)
    as_rgb = encode_as(Image.open(io.BytesIO(cmyk_jpeg)).convert("RGB"), "PNG")
    got, want = await embeddings(server, [cmyk_jpeg, as_rgb])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


async def test_16_bit_png_encodes_as_the_models_own_pipeline_encodes_it(server, default_model_dir):
    """Parity for the same bytes: Pillow opens the file, the checkpoint's processor converts it."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    levels = np.random.RandomState(2).randint(0, 65536, (40, 56)).astype(np.uint16)
    levels[:, :8] = np.arange(8 * 40).reshape(40, 8) % 256  # some levels under 256 too
    sixteen = encode_as(Image.fromarray(levels), "PNG")
    assert Image.open(io.BytesIO(sixteen)).mode == "I;16"
    (got,) = await embeddings(server, [sixteen])
    model = AutoModelForImageTextToText.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    processor = AutoImageProcessor.from_pretrained(str(default_model_dir))
    with torch.inference_mode():
        inputs = processor(images=[Image.open(io.BytesIO(sixteen))], return_tensors="pt")
        (want,) = model.get_image_features(**inputs).pooler_output
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P with alpha", "P", "L"])
async def test_rgba_palette_and_grayscale_encode_as_their_rgb_rendering(server, mode):
    rgba = Image.fromarray(np.random.RandomState(3).randint(0, 256, (36, 44, 4), dtype=np.uint8), "RGBA")
    source = rgba.convert(mode.split()[0]) if mode != "P" else rgba.convert("RGB").convert("P")
    data = encode_as(source, "PNG")
    # Transparent pixels show the white a viewer puts under them; opaque images are unchanged by it.
    white = Image.new("RGBA", source.size, (255, 255, 255, 255))
    expected = Image.alpha_composite(white, source.convert("RGBA")).convert("RGB")
    got, want = await embeddings(server, [data, encode_as(expected, "PNG")])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


async def test_animated_gif_encodes_its_first_frame(server):
    frames = [Image.new("RGB", (56, 56), color) for color in ((250, 0, 0), (0, 250, 0), (0, 0, 250))]
    animated = encode_as(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    assert Image.open(io.BytesIO(animated)).n_frames == 3
    first, second = encode_as(frames[0], "GIF"), encode_as(frames[1], "GIF")
    got, want_first, want_second = await embeddings(server, [animated, first, second])
    torch.testing.assert_close(got, want_first, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, want_second)


async def test_non_image_file(channel):
    await expect_invalid(channel, [item(b"%PDF-1.7\n1 0 obj << >> endobj\n", index=1)], "item 1:", "not an image file")


async def test_data_uri_with_bad_base64_on_server_and_receiver(channel, server):
    bad = "data:image/png;base64,iVBORw0KGgo!!!notbase64"
    await expect_invalid(channel, [item(url=bad, index=6)], "item 6:", "invalid base64")
    async with EncoderReceiver([server.url]) as rx:
        with pytest.raises(InvalidItemError, match="item 0: data: URI has invalid base64"):
            await rx.encode("r", [{"url": bad}])


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "gopher://x/1", "javascript:alert(1)", "s3://bucket/a.png", "a.png"])
async def test_unsupported_url_schemes_on_server_and_receiver(channel, server, url):
    scheme = url.split(":", 1)[0] if ":" in url else "(none)"
    await expect_invalid(channel, [item(url=url, index=2)], "item 2:", f"unsupported URL scheme {scheme!r}")
    async with EncoderReceiver([server.url]) as rx:
        with pytest.raises(InvalidItemError, match=re.escape(f"item 0: unsupported URL scheme {scheme!r}")):
            await rx.encode("r", [{"url": url}])


async def test_file_urls_outside_the_allowed_directory(server, plain_server, channel, allowed_dir, tmp_path):
    inside = allowed_dir / "inside.png"
    inside.write_bytes(image_bytes(56, 112, seed=5))
    outside = tmp_path / "outside.png"
    outside.write_bytes(image_bytes(56, 112, seed=5))
    escape = allowed_dir / "escape.png"
    escape.symlink_to(outside)

    # Receiver: its file_roots confine what it reads.
    async with EncoderReceiver([server.url], file_roots=[allowed_dir]) as rx:
        result = await rx.encode("in", [{"url": inside.as_uri()}])
        assert result.items[0].num_tokens == 8
        for url in (outside.as_uri(), escape.as_uri(), f"file://{allowed_dir}/../{outside.parent.name}/outside.png"):
            with pytest.raises(InvalidItemError, match="outside the allowed directories"):
                await rx.encode("out", [{"url": url}])

    # Server, by default: file:// refused whatever the path.
    async with grpc.aio.insecure_channel(plain_server.url.removeprefix("grpc://")) as plain:
        await expect_invalid(plain, [item(url=inside.as_uri())], "item 0:", "file:// URLs are disabled")

    # Server with a file root: inside works, outside, symlinked out or '..' out is refused, and the
    # message gives the caller's URL back, never where it resolved to.
    reply = await call_encode(channel, pb.EncodeRequest(request_id="in", items=[item(url=inside.as_uri())]))
    assert reply.code == grpc.StatusCode.OK and reply.headers[0].num_tokens == 8
    for url in (outside.as_uri(), escape.as_uri(), f"file://{allowed_dir}/../{outside.parent.name}/outside.png"):
        details = await expect_invalid(channel, [item(url=url, index=1)], "item 1:", "outside the allowed directories")
        assert details.count(str(outside)) == (1 if url == outside.as_uri() else 0)
    missing = await expect_invalid(channel, [item(url=(allowed_dir / "nope.png").as_uri())], "No such file")
    assert "nope.png" in missing


class _Handler(http.server.BaseHTTPRequestHandler):
    png = image_bytes(112, 56, seed=9)
    slow_release = threading.Event()  # /slow.png sends its body only once the test sets it

    def do_GET(self):
        body = {"/ok.png": self.png, "/big.png": b"\0" * (FETCH_LIMIT + 1), "/big-unsized": b"\0" * (4 * FETCH_LIMIT)}.get(
            self.path
        )
        if self.path == "/slow.png":
            self.send_response(200)
            self.end_headers()
            self.slow_release.wait(120)
            self.wfile.write(self.png)
        elif self.path == "/to-file":
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd")
            self.end_headers()
        elif body is None:
            self.send_error(404)
        else:
            self.send_response(200)
            if self.path != "/big-unsized":
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def http_origin():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    _Handler.slow_release.set()
    httpd.shutdown()
    httpd.server_close()


async def test_http_urls_are_off_by_default_and_bounded_when_enabled(default_model_dir, channel, http_origin):
    await expect_invalid(channel, [item(url=f"{http_origin}/ok.png")], "item 0:", "http:// URLs are disabled")
    await expect_invalid(channel, [item(url="https://example.com/a.png")], "https:// URLs are disabled")

    # Public only, http(s) still cannot reach this loopback origin (tests/encoder_common/test_fetch_internal.py counts
    # that no connection is made).
    async with running_server(default_model_dir, sources=SourcePolicy(http_urls="public")) as public_only:
        async with grpc.aio.insecure_channel(public_only.url.removeprefix("grpc://")) as ch:
            await expect_invalid(ch, [item(url=f"{http_origin}/ok.png")], "127.0.0.1 is a loopback address")
            by_name = http_origin.replace("127.0.0.1", "localhost")
            refused = ("localhost resolves to", "a loopback address")
            await expect_invalid(ch, [item(url=f"{by_name}/ok.png")], *refused)
    policy = SourcePolicy(http_urls="any", max_fetch_bytes=FETCH_LIMIT, fetch_timeout_s=0.5)
    async with running_server(default_model_dir, sources=policy) as fetching:
        async with grpc.aio.insecure_channel(fetching.url.removeprefix("grpc://")) as ch:
            reply = await call_encode(ch, pb.EncodeRequest(request_id="ok", items=[item(url=f"{http_origin}/ok.png")]))
            assert reply.code == grpc.StatusCode.OK and reply.headers[0].num_tokens == 8
            await expect_invalid(ch, [item(url=f"{http_origin}/big.png", index=1)], "item 1:", f"over the limit of {FETCH_LIMIT}")
            await expect_invalid(ch, [item(url=f"{http_origin}/big-unsized")], f"over the limit of {FETCH_LIMIT} bytes")
            # The origin holds the body until released below: only the 0.5 s fetch timeout ends this.
            await expect_invalid(ch, [item(url=f"{http_origin}/slow.png")], "took over 0.5 s")
            _Handler.slow_release.set()
            await expect_invalid(ch, [item(url=f"{http_origin}/to-file")], "redirected to a file: URL")
            await expect_invalid(ch, [item(url=f"{http_origin}/missing.png")], "failed: HTTP 404")


async def test_item_count_over_the_limit(channel):
    items = [item(image_bytes(8, 8), index=i) for i in range(MAX_ITEMS + 1)]
    await expect_invalid(channel, items, f"request has {MAX_ITEMS + 1} items, over the limit of {MAX_ITEMS}")


async def test_request_bytes_over_the_limit(channel, server):
    # A little over: the servicer's own check, naming the limit.
    filler = b"\0" * (MAX_REQUEST_BYTES // 2)
    await expect_invalid(channel, [item(filler, index=0), item(filler, index=1)], f"over the limit of {MAX_REQUEST_BYTES}")
    # Far over: gRPC refuses it with RESOURCE_EXHAUSTED; the receiver takes that as the caller's
    # fault, not as an overload: no retry, INVALID_ARGUMENT.
    async with EncoderReceiver([server.url, server.url.replace("127.0.0.1", "localhost")]) as rx:
        with pytest.raises(EncodeFailedError) as raised:
            await rx.encode("huge", [{"data": b"\0" * (3 * MAX_REQUEST_BYTES)}])
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    (attempt,) = raised.value.attempts[0]
    assert attempt.status == "RESOURCE_EXHAUSTED" and "larger than max" in attempt.message
    await still_serving(channel)


async def test_modality_other_than_image(channel, server):
    for modality, name in ((pb.AUDIO, "audio"), (pb.MODALITY_UNSPECIFIED, "modality_unspecified")):
        await expect_invalid(channel, [item(b"RIFF", modality=modality)], f"only supports IMAGE modality, got: ['{name}']")
    async with EncoderReceiver([server.url]) as rx:
        with pytest.raises(UnsupportedModalityError):
            await rx.encode("r", [{"modality": "video", "data": b"x"}])


async def test_unknown_request_field_on_server_and_unknown_item_key_on_receiver(channel, server):
    good = pb.EncodeRequest(request_id="u", items=[item(image_bytes(8, 8), index=7)])
    field_99 = bytes([0x98, 0x06, 0x01])  # field 99, varint 1
    reply = await call_encode(channel, good.SerializeToString() + field_99)
    assert reply.code == grpc.StatusCode.INVALID_ARGUMENT and "fields unknown to this server: numbers [99]" in reply.details
    item_bytes_ = item(b"x", index=7).SerializeToString() + field_99  # under 128 bytes: a one-byte length
    nested = pb.EncodeRequest(request_id="u").SerializeToString() + b"\x12" + bytes([len(item_bytes_)]) + item_bytes_
    reply = await call_encode(channel, nested)
    assert reply.code == grpc.StatusCode.INVALID_ARGUMENT and reply.details.startswith("item 7: fields unknown")
    async with EncoderReceiver([server.url]) as rx:
        with pytest.raises(InvalidItemError, match=r"item 1: unknown keys \['resize'\]"):
            await rx.encode("r", [{"data": image_bytes(8, 8)}, {"data": image_bytes(8, 8), "resize": 2}])
        with pytest.raises(InvalidItemError, match="item 0: has both 'data' and 'url'"):
            await rx.encode("r", [{"data": image_bytes(8, 8), "url": "data:,x"}])
        with pytest.raises(InvalidItemError, match="item 0: must be a mapping"):
            await rx.encode("r", [image_bytes(8, 8)])  # type: ignore[list-item]
    await still_serving(channel)


async def test_content_sha256_mismatch(channel):
    bad = pb.ImageItem(index=1, modality=pb.IMAGE, data=image_bytes(8, 8), content_sha256=b"\0" * 32)
    await expect_invalid(channel, [bad], "item 1:", "content_sha256 does not match")


async def test_undecodable_request_bytes(channel):
    reply = await call_encode(channel, b"\x12\xff\xff\xff\xff\x0f")  # field 2 claiming a 4 GiB item
    assert reply.code == grpc.StatusCode.INVALID_ARGUMENT
    assert reply.details == "request is not a valid encoder.v1.EncodeRequest message"
    await still_serving(channel)


def _mutate(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        choice = rng.random()
        if choice < 0.5 and data:  # flip bytes
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif choice < 0.7:  # truncate
            del data[rng.randrange(len(data) + 1) :]
        elif choice < 0.85 and data:  # duplicate a run
            start = rng.randrange(len(data))
            data[start:start] = data[start : start + rng.randint(1, 64)]
        else:  # insert random bytes
            at = rng.randrange(len(data) + 1)
            data[at:at] = rng.randbytes(rng.randint(1, 32))
    return bytes(data)


async def test_fuzz_random_and_mutated_bytes_get_clean_statuses(server, channel):
    """For a bounded time: random requests, valid requests with random or mutated image bytes, and
    mutated request bytes. Every reply is OK or INVALID_ARGUMENT with a clean message."""
    seed = 20240607
    rng = random.Random(seed)
    pixels = Image.fromarray(np.random.RandomState(4).randint(0, 256, (24, 40, 3), dtype=np.uint8))
    seeds = [encode_as(pixels, fmt) for fmt in ("PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP")]
    seeds.append(encode_as(pixels.convert("P"), "PNG"))
    codes: dict[str, int] = {}
    cases = 0
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline and cases < 2000:
        kind = rng.randrange(4)
        if kind == 0:
            raw = rng.randbytes(rng.randint(0, 256))
        elif kind == 1:
            raw = pb.EncodeRequest(request_id="f", items=[item(rng.randbytes(rng.randint(0, 512)))]).SerializeToString()
        elif kind == 2:
            items = [item(_mutate(rng, rng.choice(seeds)), index=i) for i in range(rng.randint(1, 3))]
            raw = pb.EncodeRequest(request_id="f", items=items).SerializeToString()
        else:
            raw = _mutate(rng, pb.EncodeRequest(request_id="f", items=[item(rng.choice(seeds))]).SerializeToString())
        reply = await asyncio.wait_for(call_encode(channel, raw, timeout=20), 30)
        codes[reply.code.name] = codes.get(reply.code.name, 0) + 1
        assert reply.code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (seed, cases, reply.code, reply.details)
        assert_clean(reply.details)
        cases += 1
    print(f"fuzz: {cases} cases in 4 s, statuses {codes}")
    assert cases >= 50 and codes.get("INVALID_ARGUMENT", 0) > 0
    await still_serving(channel)
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    status = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="encoder.v1.EncoderService"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING


async def test_errors_of_a_receiver_name_item_and_reason_and_are_not_retried(server, channel):
    """A bad item is the caller's fault: one call, INVALID_ARGUMENT, the encoder stays healthy."""
    urls = [server.url, server.url.replace("127.0.0.1", "localhost")]
    async with EncoderReceiver(urls, seed=0) as rx:
        with pytest.raises(EncodeFailedError) as raised:
            await rx.encode("bad", [{"data": image_bytes(8, 8)}, {"data": b"GIF89a-not-really"}], num_items_assigned=[2, 0])
        assert rx.healthy_urls() == urls
    error = raised.value
    # Items stream in order: item 0 arrives whole, then item 1 fails the call.
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and error.item_indices == [1]
    assert [a.status for a in error.attempts[1]] == ["INVALID_ARGUMENT"]
    assert "item 1: bytes are not an image file" in str(error)
