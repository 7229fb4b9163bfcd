"""Runs an SGLang release's own `SafeUnpickler` (its source, read from its wheel or install) on the
`EmbeddingData` pickles we send, without installing that release: the classes its allowlist admits
resolve to stand-ins, so only its allowlist decides, and the rebuilt object's attributes are
compared with what that release's `EmbeddingData.__init__` sets. Wheels are downloaded once into
$SGLANG_WHEEL_DIR (default ~/.cache/encoder-server/sglang-wheels).
"""

from __future__ import annotations

import ast
import enum
import io
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import torch

from encoder_server.sglang.embedding_data import EmbeddingDataLayout, PartMeta, embedding_data_pickle

COMMON = "sglang/srt/utils/common.py"
RECEIVERS = ("sglang/srt/disaggregation/encoder/receiver.py", "sglang/srt/disaggregation/encode_receiver.py")
WHEEL_DIR = Path(os.environ.get("SGLANG_WHEEL_DIR", Path.home() / ".cache" / "encoder-server" / "sglang-wheels"))


def release_wheel(version: str, directory: Path = WHEEL_DIR) -> Path:
    """The release's wheel in `directory`, downloaded there first (pip download --no-deps) if missing."""
    found = sorted(directory.glob(f"sglang-{version}-*.whl"))
    if not found:
        directory.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"sglang=={version}", "-d", str(directory)],
            check=True,
        )
        found = sorted(directory.glob(f"sglang-{version}-*.whl"))
    return found[0]


def read_sources(location: Path) -> dict[str, str]:
    """The files this check reads, from a wheel (.whl) or an installed site-packages directory."""
    wanted = (COMMON, *RECEIVERS)
    if location.suffix == ".whl":
        with zipfile.ZipFile(location) as wheel:
            names = set(wheel.namelist())
            return {name: wheel.read(name).decode() for name in wanted if name in names}
    return {name: (location / name).read_text() for name in wanted if (location / name).exists()}


def _class_source(source: str, name: str) -> str:
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return ast.get_source_segment(source, node)
    raise LookupError(f"no class {name}")


def embedding_data_attributes(sources: dict[str, str]) -> tuple[str, list[str]]:
    """(module, attributes EmbeddingData.__init__ sets on self) of the release's receiver."""
    path = next(p for p in RECEIVERS if p in sources)
    cls = ast.parse(_class_source(sources[path], "EmbeddingData")).body[0]
    init = next(node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    attributes: list[str] = []
    for node in ast.walk(init):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if isinstance(target, ast.Attribute) and getattr(target.value, "id", None) == "self":
                if target.attr not in attributes:
                    attributes.append(target.attr)
    return path.removesuffix(".py").replace("/", "."), attributes


class _StandIn:
    """What an admitted SGLang class resolves to: a plain object whose state the pickle sets."""


_Modality = enum.Enum("Modality", "IMAGE VIDEO AUDIO")  # auto() from 1, as in each release


def release_unpickler(sources: dict[str, str]) -> type[pickle.Unpickler]:
    """The release's own SafeUnpickler class, built from its source over a base that resolves the SGLang
    classes it admits to stand-ins (everything else, torch included, resolves for real)."""

    class Resolver(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if module.startswith("sglang."):
                return _Modality if name == "Modality" else type(name, (_StandIn,), {"__module__": module})
            return super().find_class(module, name)

    namespace = {"pickle": SimpleNamespace(Unpickler=Resolver), "_safe_load_torch_storage": None}
    exec(_class_source(sources[COMMON], "SafeUnpickler"), namespace)  # noqa: S102  (the release's own code)
    return namespace["SafeUnpickler"]


def check_release(sources: dict[str, str], layout: EmbeddingDataLayout) -> list[str]:
    """Problems of `layout`'s pickles (an embedding and an error) under this release's unpickler: refused
    globals, another class path, or attributes other than its EmbeddingData sets. Empty when it accepts."""
    module, attributes = embedding_data_attributes(sources)
    unpickler = release_unpickler(sources)
    problems = []
    if (module, "EmbeddingData") != layout.embedding_data:
        problems.append(f"EmbeddingData is {module}.EmbeddingData here, the layout names {layout.embedding_data}")
    if sorted(attributes) != sorted(layout.attributes):
        problems.append(f"EmbeddingData sets {attributes}, the layout writes {list(layout.attributes)}")
    metas = (
        PartMeta(req_id="r", num_parts=2, part_idx=1, grid_thw=[[1, 4, 6]], dtype=torch.bfloat16, shape=[6, 8]),
        PartMeta(req_id="r", num_parts=1, part_idx=0, error_msg="bad image", error_code=400),
    )
    for meta in metas:
        try:
            rebuilt = unpickler(io.BytesIO(embedding_data_pickle(meta, layout))).load()
        except Exception as exc:  # the release's refusal, as its receiver would raise it
            problems.append(f"refused: {exc}")
            continue
        missing = [name for name in attributes if name not in vars(rebuilt)]
        if missing or rebuilt.modality is not _Modality.IMAGE:
            problems.append(f"rebuilt without {missing} or with modality {rebuilt.modality}")
    return problems
