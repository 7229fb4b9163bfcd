"""Writes the built-in default model: a small Qwen2.5-VL checkpoint with deterministic random weights.

It has the real checkpoint layout (config.json, model.safetensors, preprocessor_config.json) and
the real embedding width of Qwen2.5-VL-3B (2048), so payload sizes are realistic, but its
embeddings are random-weight outputs with no meaning. A RANDOM_WEIGHTS marker file says so, and
the server logs and reports it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from encoder_server.models.loading import RANDOM_WEIGHTS_MARKER
from testkit.checkpoints import mark_random_weights, qwen_processor
from testkit.engine_files import write_engine_files

DEFAULT_MODEL_DIR = Path("models/default-qwen2_5_vl")
SEED = 0
# The default model's Qwen2.5-VL vision tower: 4 blocks of width 128.
TINY_TOWER = dict(
    depth=4, hidden_size=128, intermediate_size=256, num_heads=4, fullatt_block_indexes=[1, 3], window_size=112
)
# Special token ids of the tiny vocabulary, shared by the language model's config and the VLM's.
SPECIAL_TOKENS = dict(bos_token_id=1004, eos_token_id=1005, pad_token_id=1006)


def write_default_model(
    out_dir: str | Path = DEFAULT_MODEL_DIR, *, hidden_size: int = 2048, vision_config: dict | None = None
) -> Path:
    """Builds the full tiny VLM (language model included), saves it in bf16 with what an engine needs to
    serve it, returns the directory. `vision_config` replaces the tiny tower (its `out_hidden_size` is the
    language model's `hidden_size`)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    out_dir = Path(out_dir)
    config = Qwen2_5_VLConfig(
        vision_config=vision_config or TINY_TOWER | {"out_hidden_size": hidden_size},
        text_config=dict(
            hidden_size=hidden_size,
            intermediate_size=256,
            num_hidden_layers=1,
            num_attention_heads=hidden_size // 128,  # head size 128, which vLLM's CPU attention runs
            num_key_value_heads=2,
            vocab_size=1024,
            **SPECIAL_TOKENS,
            rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6},
        ),
        image_token_id=1000,
        video_token_id=1001,
        vision_start_token_id=1002,
        vision_end_token_id=1003,
        **SPECIAL_TOKENS,
    )
    torch.manual_seed(SEED)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16).eval()
    model.save_pretrained(out_dir)
    qwen_processor(14).save_pretrained(out_dir)  # the real Qwen2-VL checkpoints' limits: 4 to 16384 tokens
    mark_random_weights(out_dir, SEED)
    write_engine_files(out_dir)  # tokenizer, chat template, processor config: what vLLM needs to serve it
    return out_dir


def ensure_default_model(out_dir: str | Path = DEFAULT_MODEL_DIR) -> Path:
    """The default model's directory, written first if it is not there yet."""
    out_dir = Path(out_dir)
    if not (out_dir / RANDOM_WEIGHTS_MARKER).exists():
        write_default_model(out_dir)
    return out_dir
