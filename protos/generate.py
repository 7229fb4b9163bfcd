"""Regenerates the Python code for the .proto files in protos/: `python -m protos.generate [--check]`."""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# encoder.proto is this project's contract; sglang_encoder.proto is SGLang's, served beside it.
PROTOS = ("protos/encoder.proto", "protos/sglang_encoder.proto")
GENERATED = tuple(
    Path(proto).stem + suffix for proto in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
)


def generate(out_dir: Path) -> None:
    """Runs protoc on each .proto, writing protos/<name>_pb2*.py under out_dir."""
    from grpc_tools import protoc

    include = str(resources.files("grpc_tools") / "_proto")
    args = [
        "protoc",
        f"-I{REPO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(REPO_ROOT / proto) for proto in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTOS}")


def stale_files() -> list[str]:
    """Names of the committed generated files that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        return [
            name
            for name in GENERATED
            if not (REPO_ROOT / "protos" / name).exists()
            or not filecmp.cmp(Path(tmp) / "protos" / name, REPO_ROOT / "protos" / name, shallow=False)
        ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated code: {stale}; run `python -m protos.generate`", file=sys.stderr)
            return 1
        print("generated code is up to date")
        return 0
    generate(REPO_ROOT)
    print(f"wrote {', '.join('protos/' + n for n in GENERATED)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
