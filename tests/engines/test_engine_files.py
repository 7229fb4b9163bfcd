"""The tokenizer, chat template and processor config written beside tiny checkpoints for the engines:
each family's special tokens at the ids config.json names, every id decodable, the same files every time,
and a processor that expands an image to as many tokens as our encoder gives it rows."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoProcessor, AutoTokenizer

from encoder_server.images import decode_image
from encoder_server.models import load_vision_encoder
from testkit.checkpoints import write_checkpoint
from testkit.engine_files import special_token_ids, write_engine_files
from testkit.images import image_bytes


def test_special_tokens_at_the_config_ids_and_every_id_decodes(default_model_dir):
    config = json.loads((default_model_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    for token, token_id in special_token_ids(config).items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
    vocab_size = config["text_config"]["vocab_size"]
    assert len(tokenizer) == vocab_size
    assert all(tokenizer.convert_ids_to_tokens(i) is not None for i in range(vocab_size))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert (
        prompt
        == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(prompt)["input_ids"]
    assert ids[0] == config["bos_token_id"] and config["image_token_id"] in ids
    assert tokenizer.decode(ids) == prompt
    processor = json.loads((default_model_dir / "processor_config.json").read_text())
    assert processor == {"processor_class": "Qwen2_5_VLProcessor"}


def test_written_the_same_every_time(default_model_dir, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text((default_model_dir / "config.json").read_text())
    write_engine_files(copy)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "processor_config.json"):
        assert (copy / name).read_bytes() == (default_model_dir / name).read_bytes(), name


@pytest.mark.parametrize("model_type", ["internvl", "llava_next", "llava_onevision", "gemma3"])
def test_the_processor_vllm_calls_expands_each_image_to_our_encoders_rows(model_type, tmp_path):
    """Another family's format: its specials at the config's ids or the ids left free, every id decodes, and
    the processor engines call (loaded from the written files) gives an image as many image tokens as our
    encoder gives it rows, off the tile grid."""
    model_dir = write_engine_files(write_checkpoint(model_type, tmp_path / model_type, vocab_size=320))
    config = json.loads((model_dir / "config.json").read_text())
    processor = AutoProcessor.from_pretrained(model_dir)
    tokenizer = processor.tokenizer
    for token, token_id in special_token_ids(config).items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
    assert len(tokenizer) == 320
    assert all(tokenizer.convert_ids_to_tokens(i) is not None for i in range(320))
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    png = image_bytes(333, 250, seed=3)
    ids = processor(images=[decode_image(png)], text=[prompt])["input_ids"][0]
    image_token_id = config.get("image_token_id", config.get("image_token_index"))
    encoder = load_vision_encoder(model_dir, "cpu", torch.float32)
    (output,) = encoder.encode([encoder.preprocess(decode_image(png))])
    assert list(ids).count(image_token_id) == output.embedding.shape[0]
