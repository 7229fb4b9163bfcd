"""Writes the built-in default model (random weights, real Qwen2.5-VL checkpoint format)."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tooling

from testkit.default_model import DEFAULT_MODEL_DIR, write_default_model

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(DEFAULT_MODEL_DIR), help="output directory (default: %(default)s)")
    print(f"wrote {write_default_model(parser.parse_args().out)}")
