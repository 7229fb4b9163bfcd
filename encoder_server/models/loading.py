"""Reads only the vision (and projector) tensors of a checkpoint, single-file or sharded.

Each tensor is read from the memory-mapped safetensors file, cast to the served dtype and kept;
the language model's tensors are never materialized, so peak memory stays near the size of the
vision weights.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from protos.errors import EncoderError


class CheckpointError(EncoderError):
    """The checkpoint directory cannot serve this model: missing files or tensors."""


def _weight_files(model_dir: Path) -> dict[str, list[str]]:
    """Maps each safetensors file of the checkpoint to the tensor names it holds."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files: dict[str, list[str]] = {}
        for name, file in json.loads(index.read_text())["weight_map"].items():
            files.setdefault(file, []).append(name)
        return files
    files = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            files[path.name] = list(f.keys())
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {model_dir}")
    return files


def _module_key(name: str, prefixes: Mapping[str, str]) -> str | None:
    for checkpoint_prefix, module_prefix in prefixes.items():
        if name.startswith(checkpoint_prefix):
            return module_prefix + name[len(checkpoint_prefix) :]
    return None


def read_vision_tensors(
    model_dir: Path, prefixes: Mapping[str, str], dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], str]:
    """Reads the tensors whose names start with a key of `prefixes`, renamed to the module's names.

    `prefixes` maps checkpoint prefixes to module prefixes, longest first wins (e.g.
    {"model.visual.": "", "visual.": ""}). Returns the tensors cast to `dtype`, and a sha256
    fingerprint over the names and stored bytes of exactly those tensors.
    """
    ordered = dict(sorted(prefixes.items(), key=lambda kv: -len(kv[0])))
    selected: dict[str, tuple[str, str]] = {}  # module key -> (file, checkpoint name)
    for file, names in _weight_files(model_dir).items():
        for name in names:
            key = _module_key(name, ordered)
            if key is not None:
                selected[key] = (file, name)
    if not selected:
        raise CheckpointError(
            f"{model_dir} holds no tensors under any of the prefixes {sorted(prefixes)}"
        )
    digest = hashlib.sha256()
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[tuple[str, str]]] = {}
    for key, (file, name) in sorted(selected.items()):
        by_file.setdefault(file, []).append((key, name))
    for file, entries in sorted(by_file.items()):
        with safe_open(str(model_dir / file), framework="pt") as f:
            for key, name in entries:
                stored = f.get_tensor(name)
                digest.update(name.encode())
                digest.update(stored.contiguous().view(torch.uint8).reshape(-1).numpy().data)
                tensors[key] = stored.to(dtype) if stored.is_floating_point() else stored
    return tensors, digest.hexdigest()


def load_strict(module: nn.Module, tensors: dict[str, torch.Tensor], model_dir: Path) -> None:
    """Loads `tensors` into `module`, failing with the names of missing or mismatched tensors."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"{model_dir}: missing vision tensors: {', '.join(missing[:10])}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{model_dir}: unexpected vision tensors: {', '.join(unexpected[:10])}")
    for key, value in tensors.items():
        if value.shape != expected[key].shape:
            raise CheckpointError(
                f"{model_dir}: tensor {key} has shape {tuple(value.shape)}, "
                f"the config expects {tuple(expected[key].shape)}"
            )
    module.load_state_dict(tensors, strict=True, assign=True)
