"""encoder-precompute's output files: one safetensors file per image content hash, holding "embedding"
(and "deepstack" where the model has deepstack layers) and metadata naming the model that made it
(`receiver.embeddings.precomputed_files` reads them back)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from protos import encoder_pb2 as pb
from protos import wire
from receiver.embeddings.precomputed_files import FORMAT
from receiver.embeddings.result import ItemResult


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
            dtype_name(wire.TORCH_DTYPES[info.dtype]),
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


def dtype_name(dtype: torch.dtype) -> str:
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


