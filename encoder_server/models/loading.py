"""Reads only the vision (and projector) tensors of a checkpoint, single-file or sharded, each from the
memory-mapped file: the language model's tensors are never materialized."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers.initialization import no_init_weights

from encoder_common.errors import EncoderError

# A checkpoint directory holding this file has random weights (the built-in default model, test
# checkpoints): the server logs a warning and reports it in GetModelInfo.
RANDOM_WEIGHTS_MARKER = "RANDOM_WEIGHTS"


def has_random_weights(model_dir: str | Path) -> bool:
    return (Path(model_dir) / RANDOM_WEIGHTS_MARKER).exists()


class CheckpointError(EncoderError):
    """The checkpoint directory cannot serve this model: missing files or tensors."""


def _weight_files(model_dir: Path) -> dict[str, list[str]]:
    """Maps each safetensors file of the checkpoint to the tensor names it holds."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files: dict[str, list[str]] = {}
        for name, file in json.loads(index.read_text())["weight_map"].items():
            files.setdefault(file, []).append(name)
        absent = sorted(file for file in files if not (model_dir / file).exists())
        if absent:
            raise CheckpointError(f"{index} names shards that are not in {model_dir}: {', '.join(absent)}")
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
    fingerprint over the module names and stored bytes of exactly those tensors: the same weights
    give the same fingerprint whether stored in one file or in shards, under any of the prefixes.
    """
    ordered = dict(sorted(prefixes.items(), key=lambda kv: -len(kv[0])))
    selected: dict[str, tuple[str, str]] = {}  # module key -> (file, checkpoint name)
    for file, names in _weight_files(model_dir).items():
        for name in names:
            key = _module_key(name, ordered)
            if key is None:
                continue
            if key in selected:
                raise CheckpointError(
                    f"{model_dir}: tensors {selected[key][1]} and {name} both load into {key}; "
                    "the checkpoint stores the vision weights twice under different prefixes"
                )
            selected[key] = (file, name)
    if not selected:
        raise CheckpointError(f"{model_dir} holds no tensors under any of the prefixes {sorted(prefixes)}")
    tensors: dict[str, torch.Tensor] = {}
    digests: dict[str, str] = {}  # per tensor, so that the shard layout does not change the result
    by_file: dict[str, list[tuple[str, str]]] = {}
    for key, (file, name) in sorted(selected.items()):
        by_file.setdefault(file, []).append((key, name))
    for file, entries in sorted(by_file.items()):
        with safe_open(str(model_dir / file), framework="pt") as f:
            for key, name in entries:
                stored = f.get_tensor(name)
                data = stored.reshape(-1).contiguous().view(torch.uint8).numpy().data
                digests[key] = f"{stored.dtype} {list(stored.shape)} {hashlib.sha256(data).hexdigest()}"
                tensors[key] = stored.to(dtype) if stored.is_floating_point() else stored
    fingerprint = hashlib.sha256("".join(f"{key} {digests[key]}\n" for key in sorted(digests)).encode())
    return tensors, fingerprint.hexdigest()


def load_strict(
    module: nn.Module, tensors: dict[str, torch.Tensor], model_dir: Path, prefixes: Mapping[str, str]
) -> None:
    """Loads `tensors` into `module`, failing with the names of missing or mismatched tensors."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        where = ", ".join(sorted(prefixes))
        raise CheckpointError(
            f"{model_dir}: missing vision tensors (looked for under {where}): {_names(missing)}"
        )
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{model_dir}: unexpected vision tensors: {_names(unexpected)}")
    for key, value in tensors.items():
        if value.shape != expected[key].shape:
            raise CheckpointError(
                f"{model_dir}: tensor {key} has shape {tuple(value.shape)}, "
                f"the config expects {tuple(expected[key].shape)}"
            )
    module.load_state_dict(tensors, strict=True, assign=True)


def _names(names: list[str], shown: int = 10) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def load_vision_module(
    build: Callable[[], nn.Module],
    model_dir: Path,
    prefixes: Mapping[str, str],
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[nn.Module, str]:
    """Builds a module without initializing it, fills it from the checkpoint, returns it with its fingerprint.

    `build` must create the module in `dtype` the way transformers' from_pretrained does (buffers
    such as rotary frequencies keep the dtype their module gives them), so the served forward is
    the model's own; the module is only moved to `device` here, never cast.
    """
    with no_init_weights():
        module = build()
    tensors, fingerprint = read_vision_tensors(model_dir, prefixes, dtype)
    load_strict(module, tensors, model_dir, prefixes)
    return module.to(device=device).eval(), fingerprint


def settings_fingerprint(weights_fingerprint: str, settings: Mapping[str, object]) -> str:
    """Folds the config settings that change the output (e.g. the feature layer) into the fingerprint."""
    canonical = json.dumps(dict(settings), sort_keys=True, default=str)
    return hashlib.sha256(f"{weights_fingerprint}\n{canonical}".encode()).hexdigest()
