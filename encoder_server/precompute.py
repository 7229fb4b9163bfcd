"""`encoder-precompute`: encodes images offline into one safetensors file per image content hash,
through running encoder servers or an in-process model; `receiver.precomputed_files` loads them back.

A file `<sha256 of the image bytes>.safetensors` holds "embedding" (and "deepstack" where the model
has deepstack layers) and metadata naming the model that made it. One output directory holds one
model's embeddings: a rerun skips images whose file exists and refuses files of another model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from tqdm import tqdm

from protos import encoder_pb2 as pb
from protos import wire
from encoder_common.env_flags import EnvDefaultsParser, add_config_flags, config_from_args, flag
from encoder_common.errors import EncoderError, InvalidItemError

from receiver.client import EncoderReceiver
from receiver.errors import ShardError
from receiver.precomputed_files import FORMAT, content_key, output_path, read_metadata
from receiver.result import ItemResult

from .config import dtype_flag

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


@dataclass(frozen=True)
class ModelStamp:
    """What made a file; every file of one output directory carries the same stamp."""

    model_type: str
    weights_fingerprint: str
    dtype: str
    hidden_size: int

    @classmethod
    def of_info(cls, info: pb.ModelInfo) -> ModelStamp:
        return cls(
            info.model_type,
            info.weights_fingerprint,
            _dtype_name(wire.TORCH_DTYPES[info.dtype]),
            info.hidden_size,
        )

    @classmethod
    def of_metadata(cls, metadata: dict[str, str]) -> ModelStamp:
        return cls(
            metadata["model_type"],
            metadata["weights_fingerprint"],
            metadata["dtype"],
            int(metadata["hidden_size"]),
        )

    def __str__(self) -> str:
        weights = self.weights_fingerprint[:12]
        return f"{self.model_type} {self.dtype} hidden {self.hidden_size} weights {weights}"

    def metadata(self) -> dict[str, str]:
        return {
            "model_type": self.model_type,
            "weights_fingerprint": self.weights_fingerprint,
            "dtype": self.dtype,
            "hidden_size": str(self.hidden_size),
        }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_embedding(path: Path, item: ItemResult, stamp: ModelStamp, source: str) -> None:
    """Writes one file atomically: a crash leaves either no file or a complete one."""
    tensors = {"embedding": item.embedding.contiguous()}
    if item.deepstack is not None:
        tensors["deepstack"] = item.deepstack.contiguous()
    metadata = {
        "format": FORMAT,
        "grid_thw": json.dumps(list(item.grid_thw)),
        "source": source,
        **stamp.metadata(),
    }
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        save_file(tensors, str(partial), metadata)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


class ServerBackend:
    """Encodes through running encoder servers, sharded by an EncoderReceiver."""

    def __init__(self, urls: Sequence[str], timeout: float):
        self.receiver = EncoderReceiver(urls, timeout=timeout)

    async def stamp(self) -> ModelStamp:
        served = await self.receiver.served_model()
        fingerprints = {info.weights_fingerprint for info in (await self.receiver.model_info()).values()}
        if len(fingerprints) > 1:
            raise EncoderError(
                f"the encoders serve {len(fingerprints)} different weights; one directory holds one model's"
            )
        return ModelStamp.of_info(served)

    async def encode(self, request_id: str, images: Sequence[bytes]) -> list[ItemResult | InvalidItemError]:
        try:
            result = await self.receiver.encode(
                request_id, [{"modality": "image", "data": d} for d in images]
            )
        except ShardError as exc:
            if not issubclass(exc.cause_class, InvalidItemError):
                raise
            if len(images) == 1:
                return [InvalidItemError(str(exc))]
            # Find the bad images one by one, so one broken file does not cost its neighbours.
            return [
                out for i, data in enumerate(images) for out in await self.encode(f"{request_id}.{i}", [data])
            ]
        return result.items

    async def close(self) -> None:
        await self.receiver.close()


class InProcessBackend:
    """Encodes with the vision tower loaded in this process (needs transformers)."""

    def __init__(self, model_dir: str, device: str | None, dtype: torch.dtype):
        from encoder_server.models import load_vision_encoder

        self.encoder = load_vision_encoder(model_dir, device, dtype)

    async def stamp(self) -> ModelStamp:
        spec = self.encoder.spec
        return ModelStamp(
            spec.model_type, spec.weights_fingerprint, _dtype_name(spec.dtype), spec.hidden_size
        )

    async def encode(self, request_id: str, images: Sequence[bytes]) -> list[ItemResult | InvalidItemError]:
        return await asyncio.to_thread(self._encode, images)

    def _encode(self, images: Sequence[bytes]) -> list[ItemResult | InvalidItemError]:
        from encoder_server.images import DEFAULT_MAX_ASPECT_RATIO
        from encoder_server.profiles import DEFAULT_PROFILE, PROFILES

        profile = PROFILES[DEFAULT_PROFILE]  # as a server with default flags encodes the bytes
        outputs: list[ItemResult | InvalidItemError | None] = [None] * len(images)
        prepared = {}
        for i, data in enumerate(images):
            try:
                image = profile.decode(data, max_pixels=None, max_aspect_ratio=DEFAULT_MAX_ASPECT_RATIO)
                prepared[i] = self.encoder.preprocess(image, profile)
            except InvalidItemError as exc:
                outputs[i] = exc
        if prepared:
            for (i, prep), out in zip(prepared.items(), self.encoder.encode(list(prepared.values()))):
                outputs[i] = ItemResult(i, out.embedding, prep.grid_thw, encoder_url=None, deepstack=out.deepstack)
        return outputs  # type: ignore[return-value]

    async def close(self) -> None:
        pass


def collect_images(paths: Sequence[str | Path]) -> list[Path]:
    """Image files named directly, plus those with an image suffix anywhere under named folders."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")
    return list(dict.fromkeys(files))


@dataclass
class Summary:
    encoded: int = 0
    skipped: int = 0  # outputs already present
    duplicates: int = 0  # files whose content another file already has
    failed: dict[str, str] = field(default_factory=dict)  # path -> reason

    def line(self, out_dir: Path) -> str:
        return (
            f"{self.encoded} encoded, {self.skipped} already present, {self.duplicates} duplicates, "
            f"{len(self.failed)} failed; outputs in {out_dir}"
        )


@dataclass(frozen=True, kw_only=True)
class PrecomputeSettings:
    """Where a run's embeddings come from and go; the command's flags are built from these fields."""

    out: Path = field(metadata=flag("output directory (one model per directory)", type=Path))
    encoder_url: str | None = field(
        default=None, metadata=flag("running encoder servers, comma-separated grpc://host:port (or --model)")
    )
    model: str | None = field(
        default=None, metadata=flag("checkpoint directory to load in-process instead (needs transformers)")
    )
    device: str | None = field(default=None, metadata=flag("with --model: cuda when present, else cpu"))
    dtype: str = field(default="bfloat16", metadata=dtype_flag("with --model: served dtype"))
    batch_size: int = field(default=8, metadata=flag("images per Encode request or forward"))
    concurrency: int = field(default=4, metadata=flag("requests in flight (servers only)"))
    timeout: float = field(default=600.0, metadata=flag("deadline of one request, seconds"))
    progress: bool = field(default=True, metadata=flag("no progress bar"))


async def precompute(
    backend: ServerBackend | InProcessBackend, files: Sequence[Path], settings: PrecomputeSettings
) -> Summary:
    """Encodes every file whose output is missing into `settings.out`; existing outputs must carry
    the backend's stamp."""
    out_dir, batch_size = settings.out, settings.batch_size
    summary = Summary()
    by_key: dict[str, Path] = {}
    for path in files:
        try:
            key = content_key(path.read_bytes())
        except OSError as exc:
            summary.failed[str(path)] = os.strerror(exc.errno) if exc.errno else str(exc)
            continue
        if key in by_key:
            summary.duplicates += 1
        else:
            by_key[key] = path
    stamp = await backend.stamp()
    out_dir.mkdir(parents=True, exist_ok=True)
    pending = []
    for key in by_key:
        existing = output_path(out_dir, key)
        if not existing.exists():
            pending.append(key)
            continue
        try:
            found = ModelStamp.of_metadata(read_metadata(existing))
        except (SafetensorError, InvalidItemError, KeyError, ValueError):
            pending.append(key)  # unreadable: encode it again
            continue
        if found != stamp:
            raise EncoderError(
                f"{existing} was made by {found}, not by the model now encoding ({stamp}); "
                "use another output directory for another model"
            )
        summary.skipped += 1

    batches = iter(enumerate(pending[i : i + batch_size] for i in range(0, len(pending), batch_size)))
    bar = tqdm(
        total=len(by_key), initial=summary.skipped, unit="img", desc="precompute", disable=not settings.progress
    )

    async def worker() -> None:
        for number, keys in batches:
            images = await asyncio.to_thread(_read_all, [by_key[k] for k in keys])
            outputs = await backend.encode(f"precompute-{number}", images)
            for key, out in zip(keys, outputs):
                if isinstance(out, InvalidItemError):
                    summary.failed[str(by_key[key])] = str(out)
                else:
                    await asyncio.to_thread(
                        write_embedding, output_path(out_dir, key), out, stamp, by_key[key].name
                    )
                    summary.encoded += 1
            bar.update(len(keys))

    workers = [asyncio.create_task(worker()) for _ in range(max(1, settings.concurrency))]
    try:
        await asyncio.gather(*workers)
    finally:
        for task in workers:
            task.cancel()
        bar.close()
    return summary


def _read_all(paths: Sequence[Path]) -> list[bytes]:
    return [path.read_bytes() for path in paths]


def build_parser() -> argparse.ArgumentParser:
    p = EnvDefaultsParser(
        prog="encoder-precompute",
        env_prefix="ENCODER_PRECOMPUTE_",
        description="Encode images offline into <sha256>.safetensors files that EncoderReceiver accepts "
        "as precomputed items.",
        fromfile_prefix_chars="@",
    )
    p.add_argument(
        "paths", nargs="+", help="image files and folders (searched recursively); @FILE reads paths from FILE"
    )
    add_config_flags(p, PrecomputeSettings)
    return p


async def _run(paths: Sequence[str], settings: PrecomputeSettings) -> Summary:
    files = collect_images(paths)
    if settings.model:
        backend: ServerBackend | InProcessBackend = await asyncio.to_thread(
            InProcessBackend, settings.model, settings.device, wire.DTYPE_NAMES[settings.dtype]
        )
        settings = replace(settings, concurrency=1)  # one forward at a time
    else:
        urls = [url.strip() for url in settings.encoder_url.split(",") if url.strip()]
        backend = ServerBackend(urls, settings.timeout)
    try:
        return await precompute(backend, files, settings)
    finally:
        await backend.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.encoder_url is None) == (args.model is None):
        parser.error("give exactly one of --encoder-url and --model")
    try:
        summary = asyncio.run(_run(args.paths, config_from_args(PrecomputeSettings, args)))
    except (EncoderError, FileNotFoundError) as exc:
        print(f"encoder-precompute: error: {exc}", file=sys.stderr)
        return 2
    for path, reason in summary.failed.items():
        print(f"failed: {path}: {reason}", file=sys.stderr)
    print(summary.line(args.out))
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
