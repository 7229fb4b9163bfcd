"""The tokenizer, chat template and processor config written beside tiny checkpoints for the engines:
Qwen special tokens at the ids config.json names, every id decodable, the same files every time."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from testkit.engine_files import special_token_ids, write_engine_files


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
    assert prompt == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n<|im_start|>assistant\n"
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
