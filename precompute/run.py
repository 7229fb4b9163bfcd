"""One encoder-precompute run: the images collected, deduplicated by content, the existing outputs
checked against the model's stamp, and the missing ones encoded in batches by concurrent workers."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import SafetensorError
from tqdm import tqdm

from encoder_common.env_flags import flag, section
from encoder_common.errors import EncoderError, InvalidItemError
from encoder_server.config import dtype_flag
from receiver.config import ReceiverConfig
from receiver.embeddings.precomputed_files import content_key, output_path, read_metadata

from .backends import InProcessBackend, ServerBackend
from .files import ModelStamp, write_embedding

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


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
    # How the servers are reached (their flags are encoder-client's); a longer deadline than a prefill's.
    receiver: ReceiverConfig = field(
        default_factory=functools.partial(ReceiverConfig, timeout=600.0), metadata=section(settings=ReceiverConfig)
    )
    progress: bool = field(default=True, metadata=flag("no progress bar"))


async def precompute(
    backend: ServerBackend | InProcessBackend, files: Sequence[Path], settings: PrecomputeSettings
) -> Summary:
    """Encodes every file whose output is missing into `settings.out`; existing outputs must carry
    the backend's stamp."""
    summary = Summary()
    by_key = _by_content(files, summary)
    stamp = await backend.stamp()
    settings.out.mkdir(parents=True, exist_ok=True)
    pending = _pending(by_key, settings.out, stamp, summary)
    bar = tqdm(
        total=len(by_key), initial=summary.skipped, unit="img", desc="precompute", disable=not settings.progress
    )
    try:
        await _encode_pending(backend, by_key, pending, stamp, settings, summary, bar)
    finally:
        bar.close()
    return summary


def _by_content(files: Sequence[Path], summary: Summary) -> dict[str, Path]:
    """The files by content key, the first of each content only; unreadable files counted as failed."""
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
    return by_key


def _pending(by_key: dict[str, Path], out_dir: Path, stamp: ModelStamp, summary: Summary) -> list[str]:
    """The keys whose output is missing or unreadable; raises when an output was made by another model."""
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
    return pending


async def _encode_pending(
    backend: ServerBackend | InProcessBackend,
    by_key: dict[str, Path],
    pending: list[str],
    stamp: ModelStamp,
    settings: PrecomputeSettings,
    summary: Summary,
    bar: tqdm,
) -> None:
    """Encodes `pending` in batches of `settings.batch_size`, `settings.concurrency` batches at a time."""
    size = settings.batch_size
    batches = iter(enumerate(pending[i : i + size] for i in range(0, len(pending), size)))

    async def worker() -> None:
        for number, keys in batches:
            images = await asyncio.to_thread(_read_all, [by_key[k] for k in keys])
            outputs = await backend.encode(f"precompute-{number}", images)
            for key, out in zip(keys, outputs):
                if isinstance(out, InvalidItemError):
                    summary.failed[str(by_key[key])] = str(out)
                else:
                    path = output_path(settings.out, key)
                    await asyncio.to_thread(write_embedding, path, out, stamp, by_key[key].name)
                    summary.encoded += 1
            bar.update(len(keys))

    workers = [asyncio.create_task(worker()) for _ in range(max(1, settings.concurrency))]
    try:
        await asyncio.gather(*workers)
    finally:
        for task in workers:
            task.cancel()


def _read_all(paths: Sequence[Path]) -> list[bytes]:
    return [path.read_bytes() for path in paths]


