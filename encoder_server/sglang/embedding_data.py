"""The first ZMQ frame SGLang's receiver reads: a pickle, written opcode by opcode without importing
SGLang, that rebuilds SGLang's own `EmbeddingData`, in the layout of the receiving release (`LAYOUTS`)."""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EmbeddingDataLayout:
    """How the SGLang releases `first` to `last` (inclusive) name and fill `EmbeddingData`."""

    first: str
    last: str
    embedding_data: tuple[str, str]  # (module, class) of EmbeddingData, as its receiver unpickles it
    modality: tuple[str, str]  # (module, class) of the Modality enum, as that release's allowlist admits it
    attributes: tuple[str, ...]  # what EmbeddingData.__init__ sets, in its order

    def covers(self, version: str) -> bool:
        return _release(self.first) <= _release(version) <= _release(self.last)


_COMMON_HEAD = ("req_id", "num_parts", "part_idx", "grid_dim", "modality", "embedding", "send_time", "dtype")
_COMMON_TAIL = ("error_msg", "error_code", "shape")

# The pickle names SGLang's classes by module and name (all on the allowlist of SGLang's `safe_pickle_loads`)
# and carries the object's state as a plain dict, exactly the attributes SGLang's encoder server sends for
# a part of a Qwen-VL request. Those module paths and attributes moved between releases: each layout was
# read in that release's wheel and is checked against its own unpickler (scripts/check_sglang_releases.py).
# Releases with safe_pickle_loads (0.5.13 on; older receivers used plain pickle.loads), newest first.
LAYOUTS = (
    EmbeddingDataLayout(
        "0.5.23", "0.5.23",
        ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData"),
        ("sglang.srt.multimodal.modality", "Modality"),  # moved here in 0.5.23; schedule_batch re-exports it
        (*_COMMON_HEAD, "_mr_ptr", *_COMMON_TAIL),
    ),
    EmbeddingDataLayout(
        "0.5.19", "0.5.22",
        ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData"),  # the encoder/ package from 0.5.19
        ("sglang.srt.managers.schedule_batch", "Modality"),
        (*_COMMON_HEAD, "_mr_ptr", *_COMMON_TAIL),
    ),
    EmbeddingDataLayout(
        "0.5.13", "0.5.18",
        ("sglang.srt.disaggregation.encode_receiver", "EmbeddingData"),
        ("sglang.srt.managers.schedule_batch", "Modality"),
        (*_COMMON_HEAD, "cached_embedding", *_COMMON_TAIL),
    ),
)  # fmt: skip

# The SGLang release whose receiver the SGLang service writes for; tests/engines/test_sglang.py unpickles it
# with that release's own code.
SGLANG_VERSION = "0.5.23"


def layout_for(version: str) -> EmbeddingDataLayout:
    """The layout SGLang `version` unpickles; ValueError naming the releases known when there is none."""
    for layout in LAYOUTS:
        if _release(version) is not None and layout.covers(version):
            return layout
    raise ValueError(
        f"no EmbeddingData layout for SGLang {version}: known are {LAYOUTS[-1].first} to {LAYOUTS[0].last}"
    )


def _release(version: str) -> tuple[int, ...] | None:
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return None if match is None else tuple(int(part) for part in match.groups())


MODALITY_IMAGE = 1  # Modality.IMAGE = auto(), in every release of LAYOUTS

_TORCH_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass(frozen=True, kw_only=True)
class PartMeta:
    """What SGLang's receiver needs of one encoded part: its place, item grids, and tensor layout."""

    req_id: str
    num_parts: int
    part_idx: int
    grid_thw: Sequence[Sequence[int]] | None = None  # one [t, h, w] per item of the part
    dtype: torch.dtype | None = None
    shape: Sequence[int] | None = None  # [tokens, width] of the part's tensor (frame 1)
    error_msg: str | None = None
    error_code: int | None = None


def embedding_data_pickle(meta: PartMeta, layout: EmbeddingDataLayout = layout_for(SGLANG_VERSION)) -> bytes:
    """Pickle bytes that SGLang's `safe_pickle_loads` turns into its `EmbeddingData` for `meta`.

    The attributes are those of `EmbeddingData.copy_without_embedding()` on SGLang's encoder of the
    layout's releases: for an embedding, with Qwen-VL's video metadata (None for images); for an
    error, as its `_stage_errors` builds it.
    """
    values = {
        "req_id": meta.req_id,
        "num_parts": meta.num_parts,
        "part_idx": meta.part_idx,
        "grid_dim": None if meta.grid_thw is None else [[int(v) for v in grid] for grid in meta.grid_thw],
        "modality": _Modality(MODALITY_IMAGE, layout.modality),
        "dtype": None if meta.dtype is None else _TorchDtype(meta.dtype),
        "shape": None if meta.shape is None else [int(v) for v in meta.shape],
        "error_msg": meta.error_msg,
        "error_code": None if meta.error_code is None else int(meta.error_code),
    }  # the rest (embedding, send_time, _mr_ptr or cached_embedding) are None on the wire
    state: list[tuple[str, object]] = [(name, values.get(name)) for name in layout.attributes]
    if meta.error_msg is None:  # SGLang's encoder adds Qwen-VL's video metadata to embeddings only
        state += [("video_timestamps", None), ("second_per_grid_ts", None)]
    out = bytearray(b"\x80\x02")  # PROTO 2
    out += _global(*layout.embedding_data) + b")\x81"  # cls.__new__(cls): EMPTY_TUPLE, NEWOBJ
    out += b"}("  # EMPTY_DICT, MARK
    for key, value in state:
        _write(out, key)
        _write(out, value)
    out += b"ub."  # SETITEMS, BUILD (instance __dict__ from the dict), STOP
    return bytes(out)


@dataclass(frozen=True)
class _Modality:
    value: int
    where: tuple[str, str]  # (module, class) of the enum


@dataclass(frozen=True)
class _TorchDtype:
    dtype: torch.dtype


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _write(out: bytearray, value: object) -> None:
    if value is None:
        out += b"N"
    elif isinstance(value, bool):
        out += b"\x88" if value else b"\x89"
    elif isinstance(value, int):
        if -(2**31) <= value < 2**31:
            out += b"J" + struct.pack("<i", value)  # BININT
        else:
            raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            out += b"\x8a" + bytes([len(raw)]) + raw  # LONG1
    elif isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        out += b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE
    elif isinstance(value, list):
        out += b"]"  # EMPTY_LIST
        if value:
            out += b"("
            for element in value:
                _write(out, element)
            out += b"e"  # APPENDS
    elif isinstance(value, _Modality):  # an Enum member pickles as Modality(value)
        out += _global(*value.where)
        _write(out, value.value)
        out += b"\x85R"  # TUPLE1, REDUCE
    elif isinstance(value, _TorchDtype):  # a torch.dtype pickles as the module global torch.<name>
        out += _global("torch", _TORCH_DTYPE_NAMES[value.dtype])
    else:
        raise TypeError(f"cannot write {type(value).__name__} into an EmbeddingData pickle")
