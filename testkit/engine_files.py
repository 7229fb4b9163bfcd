"""Writes what an inference engine needs beside a tiny Qwen-VL checkpoint to serve it: a byte-level BPE
tokenizer with the Qwen special tokens at the ids config.json names, a chat template, the processor config.
"""

from __future__ import annotations

import json
from pathlib import Path

# The Qwen chat format: each message between <|im_start|>role and <|im_end|>, each image (raw or an
# embedding part, which vLLM renders as an image) as one <|image_pad|> inside the vision markers.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url', 'image_embeds') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] in ('video', 'video_url') %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def special_token_ids(config: dict) -> dict[str, int]:
    """The Qwen special tokens and the ids the checkpoint's config gives them."""
    text = config.get("text_config", {})

    def token_id(key: str) -> int:
        value = config.get(key, text.get(key))
        if value is None:
            raise ValueError(f"config.json names no {key}")
        return int(value)

    return {
        "<|image_pad|>": token_id("image_token_id"),
        "<|video_pad|>": token_id("video_token_id"),
        "<|vision_start|>": token_id("vision_start_token_id"),
        "<|vision_end|>": token_id("vision_end_token_id"),
        "<|im_start|>": token_id("bos_token_id"),
        "<|im_end|>": token_id("eos_token_id"),  # instruct checkpoints stop at the end of the turn
        "<|endoftext|>": token_id("pad_token_id"),
    }


def write_engine_files(model_dir: str | Path) -> Path:
    """Adds tokenizer.json, tokenizer_config.json, chat_template.jinja and processor_config.json.

    Every id below the language model's vocab_size decodes: the 256 byte tokens take the ids the
    special tokens leave free, and reserved special tokens fill the rest, as in Qwen's own vocab.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    vocab_size = int(config.get("text_config", {}).get("vocab_size", config.get("vocab_size", 0)))
    specials = special_token_ids(config)
    if len(set(specials.values())) != len(specials):
        raise ValueError(f"config.json gives two special tokens one id: {specials}")
    if vocab_size < 256 + len(specials) or max(specials.values()) >= vocab_size:
        raise ValueError(f"vocab_size {vocab_size} cannot hold 256 byte tokens and the specials {specials}")
    free_ids = iter(i for i in range(vocab_size) if i not in specials.values())
    # alphabet() comes in no fixed order: sorted, the same checkpoint gets the same ids every time.
    vocab = {char: next(free_ids) for char in sorted(pre_tokenizers.ByteLevel.alphabet())}
    reserved = {f"<|reserved_{n}|>": i for n, i in enumerate(free_ids)}
    vocab.update(specials)
    vocab.update(reserved)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # Listed in id order: the tokenizer keeps the vocab's ids for tokens it already has.
    added = sorted({**specials, **reserved}.items(), key=lambda kv: kv[1])
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token, _ in added])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 32768,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (model_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    # The processor class transformers' AutoProcessor pairs with the model type.
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    processor_class = PROCESSOR_MAPPING_NAMES.get(config.get("model_type", ""))
    if processor_class is None:
        raise ValueError(f"no processor class known for model_type {config.get('model_type')!r}")
    (model_dir / "processor_config.json").write_text(
        json.dumps({"processor_class": processor_class}, indent=2) + "\n"
    )
    return model_dir
