"""Writes the built-in default model (random weights, real Qwen2.5-VL checkpoint format)."""

import argparse

from encoder_server.default_model import DEFAULT_MODEL_DIR, write_default_model

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(DEFAULT_MODEL_DIR), help="output directory (default: %(default)s)")
    print(f"wrote {write_default_model(parser.parse_args().out)}")
