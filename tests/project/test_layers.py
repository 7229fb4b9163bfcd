"""The import graph of the product packages: packages on floors with no import upward, the receiver's
parts as layers, and no import cycle between modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protos", "encoder_common", "encoder_server", "receiver", "precompute", "gateway")

# What each package may import of the others (its floor and those below).
MAY_IMPORT = {
    "protos": set(),
    "encoder_common": {"protos"},
    "encoder_server": {"protos", "encoder_common"},
    "receiver": {"protos", "encoder_common"},
    "precompute": {"protos", "encoder_common", "encoder_server", "receiver"},
    "gateway": {"protos", "encoder_common", "receiver"},
}

# The receiver's layers, top first: a module imports its own part or the layers below it, never above.
# Parts on one layer do not import each other.
RECEIVER_LAYERS = (
    ("receiver.vllm",),
    ("receiver.client", "receiver.cli"),
    ("receiver.items",),
    ("receiver.fleet",),
    ("receiver.embeddings", "receiver.config"),
    ("receiver.transports",),
    ("receiver.errors", "receiver.metrics", "receiver.urls", "receiver.buffers"),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def type_checking_blocks(tree: ast.Module) -> set[ast.AST]:
    """The statements under `if TYPE_CHECKING:`: names for annotations, not imports that run."""
    blocks = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            blocks.update(child for statement in node.body for child in ast.walk(statement))
    return blocks


def imported_modules(path: Path) -> set[str]:
    """Every project module `path` imports when it runs, anywhere in the file, relative imports resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    annotations_only = type_checking_blocks(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if node in annotations_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            found.add(stem)
            found.update(f"{stem}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return {m for m in found if m.split(".")[0] in PACKAGES}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    # Names that are attributes rather than modules (`from receiver.config import ReceiverConfig`) drop out.
    return {name: {m for m in imported_modules(path) if m in modules and m != name} for name, path in modules.items()}


def test_no_package_imports_a_package_above_it(graph: dict[str, set[str]]) -> None:
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if target.split(".")[0] != module.split(".")[0]
        and target.split(".")[0] not in MAY_IMPORT[module.split(".")[0]]
    )
    assert not upward, "\n".join(upward)


def layer_of(module: str) -> tuple[int, str]:
    for rank, parts in enumerate(RECEIVER_LAYERS):
        for part in parts:
            if module == part or module.startswith(part + "."):
                return rank, part
    raise AssertionError(f"{module} is on none of the receiver's layers: add it to RECEIVER_LAYERS")


def test_the_receivers_parts_import_only_their_own_part_or_the_layers_below(graph: dict[str, set[str]]) -> None:
    wrong = []
    for module, targets in graph.items():
        if not module.startswith("receiver.") or module == "receiver":
            continue
        rank, part = layer_of(module)
        for target in targets:
            if target == "receiver" or not target.startswith("receiver."):
                continue
            target_rank, target_part = layer_of(target)
            if target_part != part and target_rank <= rank:
                wrong.append(f"{module} ({part}) imports {target} ({target_part})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_module_import_cycle(graph: dict[str, set[str]]) -> None:
    # Tarjan's strongly connected components over the module graph; a package's __init__ that imports its
    # own modules lazily counts as an edge like any other.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not cycles, cycles
