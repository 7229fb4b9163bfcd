"""The configurations scripts/bench_peers.py compares, each a context manager that starts its processes on
this machine, yields where clients send their chat requests, and stops them: vLLM alone, vLLM's own EPD
(an `ec_producer` and an `ec_consumer` with `ECExampleConnector`, behind testkit/epd_proxy.py), our encoder
server + encoder-gateway + vLLM (inline and connector hand-offs), SGLang alone, SGLang's own EPD, and our
encoder server behind SGLang's `--language-only` server. Each runs one encoder (or none: the engines alone).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from testkit import REPO_ROOT
from testkit.launcher import launch_server, side_by_side
from testkit.sglang_server import language_only_args, launch_sglang
from testkit.vllm_server import connector_transfer_config, free_port, launch_vllm, serving

MODEL = "tiny"  # every configuration's served model name
MAX_IMAGES = 4
# The processor cache stays on: with it and prefix caching both off, vLLM names each image by a per-instance
# request counter instead of its content (renderers/base.py::_process_mm_uuids), and an EPD encoder and
# consumer would then key the same image differently.
VLLM_FLAGS = ("--served-model-name", MODEL, "--no-enable-prefix-caching")
SGLANG_FLAGS = ("--served-model-name", MODEL)
PEERS = ("vllm-alone", "vllm-epd", "sglang-alone", "sglang-epd")  # the engines' own configurations


@dataclass
class Running:
    """A started configuration: the URL clients send to, and the count of images its encode stage has
    encoded so far (None where the tower runs inside the engine)."""

    url: str
    images_encoded: Callable[[], int] | None = None


@dataclass
class Context:
    model_dir: Path
    work: Path
    device: str
    dtype: str

    def log(self, name: str) -> Path:
        return self.work / "logs" / f"{name}.log"

    @property
    def vllm_flags(self) -> list[str]:
        return [*VLLM_FLAGS, *self._served_as]

    @property
    def sglang_flags(self) -> list[str]:
        return [*SGLANG_FLAGS, *self._served_as]

    @property
    def _served_as(self) -> list[str]:
        """Every engine's dtype and device flags (both take the same)."""
        return ["--dtype", self.dtype, *(["--device", "cuda"] if self.device == "cuda" else [])]


# ------------------------------------------------------------------------------------------- configurations


@contextlib.contextmanager
def _process(argv: list[str], url: str, log: Path, name: str) -> Iterator[None]:
    """A helper process (proxy, gateway) of this checkout, until its /health answers; stopped on exit."""
    with log.open("w") as out:
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True
        )
    with serving(process, url, log, timeout=120, name=name):
        yield


@contextlib.contextmanager
def _our_encoder(ctx: Context) -> Iterator[tuple[str, Callable[[], int]]]:
    """One encoder-server process of this checkout: its URL, and the images it has encoded (its metrics)."""
    metrics_port = free_port()
    flags = ("--dtype", ctx.dtype, "--device", ctx.device, "--metrics-port", str(metrics_port))

    def encoded() -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
            lines = reply.read().decode().splitlines()
        return sum(
            int(float(line.split()[-1])) for line in lines if line.startswith("encoder_batch_items_sum")
        )

    with launch_server(ctx.model_dir, *flags, log_dir=ctx.work / "logs", timeout=600) as encoder:
        yield encoder.url, encoded


@contextlib.contextmanager
def vllm_alone(ctx: Context) -> Iterator[Running]:
    with launch_vllm(
        ctx.model_dir, log_path=ctx.log("vllm"), max_images=MAX_IMAGES, extra_args=ctx.vllm_flags
    ) as engine:
        yield Running(engine.url)


@contextlib.contextmanager
def vllm_epd(ctx: Context) -> Iterator[Running]:
    storage = ctx.work / "ec-storage"
    storage.mkdir(exist_ok=True)

    def instance(role: str):
        transfer = {"ec_connector": "ECExampleConnector", "ec_role": role,
                    "ec_connector_extra_config": {"shared_storage_path": str(storage)}}  # fmt: skip
        flags = [*ctx.vllm_flags, "--ec-transfer-config", json.dumps(transfer)]
        return launch_vllm(
            ctx.model_dir, log_path=ctx.log(f"vllm-{role}"), max_images=MAX_IMAGES, extra_args=flags
        )

    with side_by_side(instance("ec_producer"), instance("ec_consumer")) as (producer, consumer):
        url = f"http://127.0.0.1:{free_port()}"
        argv = [sys.executable, str(REPO_ROOT / "testkit" / "epd_proxy.py"), "--port", url.rsplit(":", 1)[1],
                "--encoder", producer.url, "--engine", consumer.url]  # fmt: skip
        with _process(argv, url, ctx.log("epd-proxy"), "EPD proxy"):
            yield Running(url, lambda: sum(1 for _ in storage.rglob("*.safetensors")))


def ours_vllm(handoff: str) -> Callable:
    @contextlib.contextmanager
    def start(ctx: Context) -> Iterator[Running]:
        with _our_encoder(ctx) as (encoder, encoded):
            flags = [*ctx.vllm_flags, "--ec-transfer-config", connector_transfer_config([encoder])]
            log = ctx.log(f"vllm-{handoff}")
            with launch_vllm(ctx.model_dir, log_path=log, max_images=MAX_IMAGES, extra_args=flags) as engine:
                url = f"http://127.0.0.1:{free_port()}"
                argv = [sys.executable, "-m", "gateway", "--engine-url", engine.url, "--encoders", encoder,
                        "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1], "--handoff", handoff]  # fmt: skip
                with _process(argv, url, ctx.log(f"gateway-{handoff}"), "encoder-gateway"):
                    yield Running(url, encoded)

    return start


@contextlib.contextmanager
def sglang_alone(ctx: Context) -> Iterator[Running]:
    with launch_sglang(ctx.model_dir, log_path=ctx.log("sglang"), extra_args=ctx.sglang_flags) as url:
        yield Running(url)


@contextlib.contextmanager
def sglang_epd(ctx: Context) -> Iterator[Running]:
    """SGLang's encoder server in its HTTP mode: in its gRPC mode SGLang 0.5.23's health probe (an HTTP GET on
    the grpc:// URL) evicts the encoder (testkit/sglang_server.py)."""
    encoder_flags = [*ctx.sglang_flags, "--encoder-only"]
    with launch_sglang(
        ctx.model_dir, log_path=ctx.log("sglang-encoder"), extra_args=encoder_flags
    ) as encoder:
        flags = [*ctx.sglang_flags, "--language-only", "--encoder-urls", encoder,
                 "--encoder-bootstrap-port", str(free_port())]  # fmt: skip
        with launch_sglang(ctx.model_dir, log_path=ctx.log("sglang-language"), extra_args=flags) as url:
            yield Running(url)


@contextlib.contextmanager
def ours_sglang(ctx: Context) -> Iterator[Running]:
    with _our_encoder(ctx) as (encoder, encoded):
        args, env = language_only_args([encoder])
        log = ctx.log("sglang-language-ours")
        with launch_sglang(
            ctx.model_dir, log_path=log, extra_args=[*ctx.sglang_flags, *args], extra_env=env
        ) as url:
            yield Running(url, encoded)


# name -> (the configuration whose answers are the reference: its engine alone, how it starts)
CONFIGURATIONS: dict[str, tuple[str, Callable]] = {
    "vllm-alone": ("vllm-alone", vllm_alone),
    "vllm-epd": ("vllm-alone", vllm_epd),
    "ours-inline": ("vllm-alone", ours_vllm("inline")),
    "ours-connector": ("vllm-alone", ours_vllm("connector")),
    "sglang-alone": ("sglang-alone", sglang_alone),
    "sglang-epd": ("sglang-alone", sglang_epd),
    "ours-sglang": ("sglang-alone", ours_sglang),
}
