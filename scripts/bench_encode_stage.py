"""The encode stage against vLLM's own: bytes to embedding in the encoder server's code and in vLLM 0.32's,
same checkpoint, same image, same torch thread count, timed per stage in alternating rounds.

    .venv/bin/python scripts/bench_encode_stage.py [--family F] [--threads 1] [--rounds 12] [--device cpu|cuda]
        [--json F]
    .venv-engines/bin/python scripts/bench_encode_stage.py --backend vllm [...]   (the checkout on PYTHONPATH)

The checkpoint is the built-in default model (Qwen2.5-VL), or with `--family F` the tiny test checkpoint of
that family or model type (`testkit.checkpoints.write_checkpoint` plus `testkit.engine_files`, as the engine
tests serve it), written for the run. Both sides run it in float32, except where vLLM's CPU path takes the
checkpoint in bfloat16 only (`engine_dtype`).

Ours runs in this process, with the server's own functions (`decode_image`, the encoder's `preprocess` and
`encode`), on the server's tower backend that `--backend` names: `transformers` (the default), or `vllm`
(encoder_server/models/vllm_backend.py: vLLM's processor and model in this process, so this process must
be the engine venv's python; images are then loaded by the `vllm` profile's loader, as the server's Encode
loads them). vLLM runs in a worker process of `--engine-python` (its own venv): its image loader
(`ImageMediaIO.load_bytes`), its multimodal processor (`renderer._process_multimodal`: the checkpoint's HF
processor plus vLLM's hashing and prompt updates) and its vision tower (`embed_multimodal`, through
`LLM.apply_model`). The two sides take turns, never run at once; the ratio ours/vLLM is the median over
rounds of the two totals measured in the same round, the stage figures medians over rounds. The largest
difference between the two embeddings is reported where they have the same shape; where they do not (a
family whose vLLM output keeps another layout), the row says so.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it runs: --help and the worker's start stay light
    import torch

    from encoder_server.models.base import ImageEmbedding

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tooling

from encoder_common.families import BY_MODEL_TYPE, family_of
from testkit.bench_harness import (
    MachineLoad,
    Stopwatch,
    add_record_flag,
    median,
    record_result,
    stage_medians,
    write_json,
)
from testkit.engine_files import CHAT_FORMATS
from testkit.vllm_server import ENGINES_PYTHON, engines_env

# name -> (width, height): on the 28 px grid, a phone-photo size, and one off the grid.
IMAGE_SIZES = {"448x448": (448, 448), "1024x768": (1024, 768), "333x250": (333, 250)}
OUR_STAGES = ("decode", "preprocess", "forward")
VLLM_STAGES = ("load", "processor", "tower")
RESULT_PREFIX = "BENCH-RESULT "
DEFAULT_MODEL = "models/default-qwen2_5_vl"
# --family: the model types whose test checkpoint testkit writes with what an engine needs (a chat format)
ENGINE_MODEL_TYPES = [
    model_type for model_type, family in BY_MODEL_TYPE.items() if family.name in CHAT_FORMATS
]


def engine_dtype(model_dir: Path, device: str) -> str:
    """The dtype both sides run the checkpoint in: float32, except on CPU for a language model with Gated
    DeltaNet (linear-attention) layers, which vLLM 0.32's CPU kernel runs in bfloat16 only ("CPU GDN attention
    requires BF16.": Qwen3.5, and MiniCPM-V 4.6, whose language model is Qwen3.5's). vLLM's side loads the
    whole checkpoint, language model included, so the checkpoint decides."""
    config = json.loads((model_dir / "config.json").read_text())
    layer_types = config.get("text_config", config).get("layer_types") or ()
    return "bfloat16" if device == "cpu" and "linear_attention" in layer_types else "float32"


def make_jpeg(width: int, height: int, seed: int) -> bytes:
    """A photo-like JPEG: smooth gradients plus noise, so that it compresses as camera images do."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width * 255, y / height * 255, (x + y) / (width + height) * 255], axis=-1)
    pixels = np.clip(base + rng.normal(0, 24, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    return out.getvalue()


# ---------------------------------------------------------------- vLLM's side (runs in --engine-python)


def vllm_worker(model_dir: str, dtype: str) -> None:
    """Reads one JSON request a line on stdin ({"image": path}), answers one BENCH-RESULT line on stdout."""
    import torch
    from vllm import LLM
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.processing.processor import cached_encode
    from vllm.multimodal.utils import group_and_batch_mm_kwargs

    llm = LLM(
        model=model_dir,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=4096,  # as the engine tests serve the test checkpoints; no prompt is run here
        limit_mm_per_prompt={"image": 1},
        mm_processor_cache_gb=0,  # every round processes the image again, as a new image would be
    )
    # vLLM's CPU worker turns torch.set_num_threads into a no-op once it starts; the worker's thread
    # count is OMP_NUM_THREADS, which its processor uses too (set_default_torch_num_threads).
    renderer = llm.llm_engine.renderer
    # The prompt vLLM builds for one image of the family (its profiling input), whose placeholder its
    # prompt updates expand.
    dummy_text = renderer.get_mm_processor().dummy_inputs.get_dummy_text({"image": 1})
    prompt = cached_encode(renderer.get_tokenizer(), dummy_text, truncation=False)
    loader = ImageMediaIO(image_mode="RGB")

    def tower(item) -> tuple[float, list[torch.Tensor]]:
        def run(model):
            device_ = next(model.parameters()).device
            if device_.type == "cuda":
                torch.cuda.synchronize()
            watch = Stopwatch()
            # As vLLM's model runner feeds its encoder: the items grouped and stacked into the family's
            # own keyword arguments (pixel values, grids, image sizes, tile counts).
            outputs = []
            with torch.inference_mode():
                for _, _, kwargs in group_and_batch_mm_kwargs([("image", item)], device=device_):
                    outputs.extend(model.embed_multimodal(**kwargs))  # one tensor per item
            if device_.type == "cuda":
                torch.cuda.synchronize()
            return watch.ms(), [output.float().cpu() for output in outputs]

        return llm.apply_model(run)[0]

    print(RESULT_PREFIX + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        data = Path(request["image"]).read_bytes()
        watch = Stopwatch()
        image = loader.load_bytes(data)
        load_ms = watch.lap() * 1000
        inputs = renderer._process_multimodal(prompt, {"image": [image]}, None, None)
        processor_ms = watch.lap() * 1000
        (item,) = inputs["mm_kwargs"]["image"]
        tower_ms, outputs = tower(item)
        if "embedding_out" in request:
            torch.save(outputs, request["embedding_out"])
        threads = torch.get_num_threads()
        answer = {"load": load_ms, "processor": processor_ms, "tower": tower_ms, "threads": threads}
        print(RESULT_PREFIX + json.dumps(answer), flush=True)


class VllmWorker:
    """The vLLM side as a child process of the engine venv; one request at a time."""

    def __init__(self, engine_python: str, model_dir: Path, dtype: str, threads: int):
        env = engines_env(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",  # engine core in this process: apply_model is a call
            OMP_NUM_THREADS=str(threads),  # vLLM runs its processor with this many torch threads
        )
        argv = [engine_python, __file__, "--vllm-worker", "--model", str(model_dir), "--dtype", dtype]
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
        self.process = subprocess.Popen(argv, env=env, **pipes)
        self._read()  # ready

    def _read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(RESULT_PREFIX):
                return json.loads(line[len(RESULT_PREFIX) :])
        raise RuntimeError(f"the vLLM worker ended (exit status {self.process.wait()})")

    def run(self, image: Path, embedding_out: Path | None = None) -> dict:
        request = {"image": str(image)}
        if embedding_out is not None:
            request["embedding_out"] = str(embedding_out)
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# ---------------------------------------------------------------- our side (in this process)


class OurEncodeStage:
    """The server's own path from bytes to embedding: the functions its pipeline and batcher call."""

    def __init__(self, model_dir: Path, device: str, dtype: str, backend: str):
        import functools

        import torch

        from encoder_server.images import DEFAULT_MAX_ASPECT_RATIO, decode_image
        from encoder_server.profiles import DEFAULT_PROFILE, PROFILES
        from encoder_server.server import load_encoder

        self.encoder = load_encoder(model_dir, device, getattr(torch, dtype), backend)
        self.decode = decode_image
        if backend == "vllm":  # as the server's Encode decodes for it: the default profile's loader
            limits = {"max_pixels": None, "max_aspect_ratio": DEFAULT_MAX_ASPECT_RATIO}
            self.decode = functools.partial(PROFILES[DEFAULT_PROFILE].decode, **limits)

    def run(self, data: bytes) -> tuple[dict, ImageEmbedding]:
        watch = Stopwatch()
        image = self.decode(data)
        decode_ms = watch.lap() * 1000
        prepared = self.encoder.preprocess(image)
        preprocess_ms = watch.lap() * 1000
        (output,) = self.encoder.encode([prepared])  # copies to the CPU: a cuda forward has finished
        forward_ms = watch.lap() * 1000
        return {"decode": decode_ms, "preprocess": preprocess_ms, "forward": forward_ms}, output


def embedding_difference(ours: ImageEmbedding, theirs: list[torch.Tensor]) -> float | str:
    """The largest |ours - vLLM's| over the image's rows, or why the two cannot be compared row for row."""
    import torch

    rows = ours.embedding
    if ours.deepstack is not None:  # vLLM appends Qwen3-VL's deepstack levels along the hidden dimension
        rows = torch.cat([rows, *ours.deepstack], dim=-1)
    shapes = [list(output.shape) for output in theirs]
    if len(theirs) != 1 or theirs[0].shape != rows.shape:
        return f"not comparable: ours {list(rows.shape)}, vLLM {shapes}"
    return (rows.float() - theirs[0]).abs().max().item()


# ---------------------------------------------------------------- the run


def checkpoint(args: argparse.Namespace, tmp: Path) -> Path:
    """The built-in default model (--model), or the family's test checkpoint with what an engine needs."""
    if args.family is None:
        from testkit.default_model import ensure_default_model

        return ensure_default_model(args.model or DEFAULT_MODEL)
    from testkit.checkpoints import write_checkpoint
    from testkit.engine_files import write_engine_files

    # vocab 320: the 256 byte tokens beside the special tokens, as the engine tests write it
    return write_engine_files(write_checkpoint(args.family, tmp / args.family, vocab_size=320))


def bench(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = checkpoint(args, Path(tmp))
        dtype = engine_dtype(model_dir, args.device)
        ours = OurEncodeStage(model_dir, args.device, dtype, args.backend)
        vllm = VllmWorker(args.engine_python, model_dir, dtype, args.threads)
        try:
            for name in args.images:
                path = Path(tmp) / f"{name}.jpg"
                path.write_bytes(make_jpeg(*IMAGE_SIZES[name], seed=len(results)))
                data = path.read_bytes()
                # The first round of each side warms up (and checks that the two embeddings agree).
                warm = vllm.run(path, embedding_out=Path(tmp) / "vllm.pt")
                if warm["threads"] != torch.get_num_threads():
                    ours_threads = torch.get_num_threads()
                    raise RuntimeError(f"vLLM runs {warm['threads']} torch threads, ours {ours_threads}")
                _, embedding = ours.run(data)
                difference = embedding_difference(embedding, torch.load(Path(tmp) / "vllm.pt"))
                our_rounds, vllm_rounds = [], []
                for round_ in range(args.rounds):
                    # A round is one run of each side, back to back, the first side alternating: the
                    # shared host's drift hits both alike.
                    if round_ % 2:
                        vllm_rounds.append(vllm.run(path))
                        our_rounds.append(ours.run(data)[0])
                    else:
                        our_rounds.append(ours.run(data)[0])
                        vllm_rounds.append(vllm.run(path))
                our, their = stage_medians(our_rounds, OUR_STAGES), stage_medians(vllm_rounds, VLLM_STAGES)
                results[name] = {
                    "tokens": int(embedding.embedding.shape[0]),
                    "ours_ms": our,
                    "vllm_ms": their,
                    "ratio": median(
                        sum(o[s] for s in OUR_STAGES) / sum(v[s] for s in VLLM_STAGES)
                        for o, v in zip(our_rounds, vllm_rounds)
                    ),
                    "largest_embedding_difference": difference,
                }
                print(_row(name, results[name]), flush=True)
        finally:
            vllm.close()
    return {
        "machine": f"{os.cpu_count()}-core {os.uname().machine}",
        "model": args.family or "default (qwen2_5_vl)",
        "dtype": dtype,
        "backend": args.backend,
        "device": args.device,
        "threads": args.threads,
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "images": results,
        "worst_ratio": max(r["ratio"] for r in results.values()),
    }


def _row(name: str, result: dict) -> str:
    our, their = result["ours_ms"], result["vllm_ms"]
    ours = " + ".join(f"{stage} {our[stage]:.1f}" for stage in OUR_STAGES)
    theirs = " + ".join(f"{stage} {their[stage]:.1f}" for stage in VLLM_STAGES)
    difference = result["largest_embedding_difference"]
    difference = f"max |diff| {difference:.1e}" if isinstance(difference, float) else difference
    return (
        f"{name:>9} ({result['tokens']} tokens): ours {our['total']:.1f} ms ({ours}) | "
        f"vLLM {their['total']:.1f} ms ({theirs}) | ratio {result['ratio']:.2f}x | {difference}"
    )


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", help=f"the default model's checkpoint (written if absent; {DEFAULT_MODEL})")
    which.add_argument("--family", choices=ENGINE_MODEL_TYPES, help="a family's test checkpoint instead")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    parser.add_argument("--rounds", type=int, default=12, help="timed rounds per image and side")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--backend", default="transformers", choices=("transformers", "vllm"), help="our tower backend"
    )
    parser.add_argument("--images", nargs="+", default=list(IMAGE_SIZES), choices=list(IMAGE_SIZES))
    parser.add_argument("--engine-python", default=str(ENGINES_PYTHON), help="vLLM's venv's python")
    parser.add_argument("--json", help="also write the figures here")
    add_record_flag(parser)
    parser.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)  # the worker's: chosen by engine_dtype
    args = parser.parse_args()
    if args.vllm_worker:
        vllm_worker(args.model, args.dtype)
        return
    if args.family and args.backend == "transformers" and family_of(args.family).tower is None:
        parser.error(f"--family {args.family} has no transformers tower here: add --backend vllm")
    if args.backend == "vllm":
        # Our side's vLLM binds its torch threads to OMP_NUM_THREADS as the worker's does (and then ignores
        # torch.set_num_threads): set before torch is imported.
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    load = MachineLoad()
    report = bench(args)
    print(
        f"worst ratio ours/vLLM: {report['worst_ratio']:.2f}x "
        f"({report['model']}, {report['dtype']}, {args.backend} backend, {args.threads} threads, {args.device})"
    )
    if args.json:
        write_json(Path(args.json), report)
    if args.record:
        name = "_".join(["encode_stage", args.backend, args.family or "default", args.device])
        print(f"wrote {record_result(name, report, args.record, load=load)}")


if __name__ == "__main__":  # vLLM spawns processes that import this module
    main()
