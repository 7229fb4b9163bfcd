"""Writes what an inference engine needs beside a tiny checkpoint to serve it: a byte-level BPE tokenizer with
the family's special tokens at the ids config.json names, a chat template, the processor config.

Each family's chat format is one `ChatFormat` entry in `CHAT_FORMATS` (keyed by the family of
encoder_common/families.py): its special tokens, what the template writes per image part, eos and pad.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ChatFormat:
    """One family's chat format as a tokenizer and template see it.

    `specials`: each special token -> the config.json key naming its id (looked up at the top level, then in
    `text_config`), or None for a token the config gives no id (it takes the lowest id left free).
    `image` / `video`: what the template writes for one image (raw or an `image_embeds` part, which vLLM
    renders as an image) / one video part. `turn`: the markers around each message, the role after the first.
    `named`: the tokenizer's own names for some specials (tokenizer_config's `extra_special_tokens`, read by
    processors as e.g. `tokenizer.start_image_token`).
    `processor`: config.json -> the processor_config.json entries besides `processor_class` (e.g. a token
    count the processor cannot read from the image processor).
    """

    specials: Mapping[str, str | None]
    image: str
    eos: str
    pad: str
    video: str | None = None
    turn: tuple[str, str] = ("<|im_start|>", "<|im_end|>")
    named: Mapping[str, str] = field(default_factory=dict)
    processor: Callable[[dict], dict] = field(default=lambda config: {})


# Qwen: each image inside the vision markers; the turn markers double as bos (the config's) and eos, as
# instruct checkpoints stop at the end of the turn.
QWEN = ChatFormat(
    specials={
        "<|image_pad|>": "image_token_id",
        "<|video_pad|>": "video_token_id",
        "<|vision_start|>": "vision_start_token_id",
        "<|vision_end|>": "vision_end_token_id",
        "<|im_start|>": "bos_token_id",
        "<|im_end|>": "eos_token_id",
        "<|endoftext|>": "pad_token_id",
    },
    image="<|vision_start|><|image_pad|><|vision_end|>",
    video="<|vision_start|><|video_pad|><|vision_end|>",
    eos="<|im_end|>",
    pad="<|endoftext|>",
)

# The Qwen2 language model's turn markers and pad, which InternVL 3/3.5 and LLaVA-OneVision keep.
QWEN2_TEXT = {"<|im_start|>": "bos_token_id", "<|im_end|>": "eos_token_id", "<|endoftext|>": "pad_token_id"}

# InternVL (Hugging Face format): `<IMG_CONTEXT>` per image, which the processor expands to
# `<img>` + one `<IMG_CONTEXT>` per token + `</img>`; the processor finds the three by the tokenizer's names.
INTERNVL = ChatFormat(
    specials={
        "<IMG_CONTEXT>": "image_token_id",
        "<img>": None,
        "</img>": None,
        "<video>": None,
        **QWEN2_TEXT,
    },
    image="<IMG_CONTEXT>\n",
    eos="<|im_end|>",
    pad="<|endoftext|>",
    named={
        "context_image_token": "<IMG_CONTEXT>",
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "video_token": "<video>",
    },
    # tokens per tile: the tile's patch grid after the pixel shuffle
    processor=lambda config: {"image_seq_length": config["image_seq_length"]},
)

# LLaVA-NeXT: `<image>` per image, expanded by the processor to the AnyRes count, which it computes from
# the patch size, the feature strategy and the CLS token CLIP adds.
LLAVA_NEXT = ChatFormat(
    specials={
        "<image>": "image_token_index",
        "<s>": "bos_token_id",
        "</s>": "eos_token_id",
        "<pad>": "pad_token_id",
    },
    image="<image>\n",
    eos="</s>",
    pad="<pad>",
    turn=("<s>", "</s>"),
    processor=lambda config: {
        "patch_size": config["vision_config"]["patch_size"],
        "vision_feature_select_strategy": config["vision_feature_select_strategy"],
        "num_additional_image_tokens": 1,
    },
)

# LLaVA-OneVision: as LLaVA-NeXT on a Qwen2 language model; its processor counts from the tokens of one
# tile (SigLIP: no CLS token).
LLAVA_ONEVISION = ChatFormat(
    specials={"<image>": "image_token_index", "<video>": "video_token_index", **QWEN2_TEXT},
    image="<image>\n",
    video="<video>\n",
    eos="<|im_end|>",
    pad="<|endoftext|>",
    processor=lambda config: {
        "num_image_tokens": (config["vision_config"]["image_size"] // config["vision_config"]["patch_size"])
        ** 2,
        "vision_feature_select_strategy": config["vision_feature_select_strategy"],
        "vision_aspect_ratio": config["vision_aspect_ratio"],
    },
)

# GLM-4.1V / 4.5V: each image inside its begin/end markers. The roles stay text (GLM writes them as tokens,
# <|user|>, <|assistant|>): a turn opens with <sop> (the config's bos) and ends where the next user turn
# would begin, at <|user|>, where GLM's checkpoints stop (the config's eos).
GLM4V = ChatFormat(
    specials={
        "<|image|>": "image_token_id",
        "<|video|>": "video_token_id",
        "<|begin_of_image|>": "image_start_token_id",
        "<|end_of_image|>": "image_end_token_id",
        "<|begin_of_video|>": "video_start_token_id",
        "<|end_of_video|>": "video_end_token_id",
        "<sop>": "bos_token_id",
        "<|user|>": "eos_token_id",
        "<|endoftext|>": "pad_token_id",
    },
    image="<|begin_of_image|><|image|><|end_of_image|>",
    video="<|begin_of_video|><|video|><|end_of_video|>",
    eos="<|user|>",
    pad="<|endoftext|>",
    turn=("<sop>", "<|user|>"),
)

# MiniCPM-V 4.6: the Qwen turn markers and pad (its language model is Qwen3.5's); one <|image_pad|> per image,
# which the processor expands into the overview and the slices, each between markers the config gives no id
# (the processor reads them by name).
MINICPMV4_6 = ChatFormat(
    specials={
        "<|image_pad|>": "image_token_id",
        "<|video_pad|>": "video_token_id",
        **QWEN2_TEXT,
        "<image>": None,
        "</image>": None,
        "<slice>": None,
        "</slice>": None,
        "<image_id>": None,
        "</image_id>": None,
    },
    image="<|image_pad|>",
    video="<|video_pad|>",
    eos="<|im_end|>",
    pad="<|endoftext|>",
    named={
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "image_start_token": "<image>",
        "image_end_token": "</image>",
        "slice_start_token": "<slice>",
        "slice_end_token": "</slice>",
        "image_id_start_token": "<image_id>",
        "image_id_end_token": "</image_id>",
    },
)

# Gemma 3: each image as its begin-of-image token, which the processor expands into the image's blocks between
# "\n\n"s; vLLM's Gemma 3 processor looks up the runs of 1 to 4 newlines by their text (Gemma's vocab has each
# as one token), so they are tokens here too.
GEMMA3 = ChatFormat(
    specials={
        "<image_soft_token>": "image_token_index",
        "<start_of_image>": "boi_token_index",
        "<end_of_image>": "eoi_token_index",
        "<bos>": "bos_token_id",
        "<end_of_turn>": "eos_token_id",
        "<pad>": "pad_token_id",
        "<start_of_turn>": None,
        **{"\n" * n: None for n in range(1, 5)},
    },
    image="<start_of_image>",
    eos="<end_of_turn>",
    pad="<pad>",
    turn=("<start_of_turn>", "<end_of_turn>"),
    named={
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    },
    processor=lambda config: {"image_seq_length": config["mm_tokens_per_image"]},
)

# Mistral 3 (Pixtral): each image as one [IMG], which the processor expands into rows of [IMG] ended by
# [IMG_BREAK], the last by [IMG_END]; the processor needs the tower's patch size and the merge.
MISTRAL3 = ChatFormat(
    specials={
        "[IMG]": "image_token_index",
        "<s>": "bos_token_id",
        "</s>": "eos_token_id",
        "<pad>": "pad_token_id",
        "[IMG_BREAK]": None,
        "[IMG_END]": None,
        "[INST]": None,
        "[/INST]": None,
    },
    image="[IMG]",
    eos="</s>",
    pad="<pad>",
    turn=("[INST]", "[/INST]"),
    processor=lambda config: {
        "patch_size": config["vision_config"]["patch_size"],
        "spatial_merge_size": config["spatial_merge_size"],
    },
)

# Idefics 3 / SmolVLM: each image as one <image>, which the processor expands into its tiles, each behind
# <fake_token_around_image> and its <row_i_col_j> (the whole image behind <global-img>), image_seq_len
# <image> tokens a tile.
IDEFICS3 = ChatFormat(
    specials={
        "<image>": "image_token_id",
        "<|im_start|>": "bos_token_id",
        "<end_of_utterance>": "eos_token_id",
        "<|endoftext|>": "pad_token_id",
        "<fake_token_around_image>": None,
        "<global-img>": None,
        **{f"<row_{row}_col_{column}>": None for row in range(1, 7) for column in range(1, 7)},
    },
    image="<image>",
    eos="<end_of_utterance>",
    pad="<|endoftext|>",
    turn=("<|im_start|>", "<end_of_utterance>"),
    processor=lambda config: {
        "image_seq_len": (config["vision_config"]["image_size"] // config["vision_config"]["patch_size"]) ** 2
        // config["scale_factor"] ** 2
    },
)

# family (encoder_common/families.py) -> its chat format
CHAT_FORMATS: dict[str, ChatFormat] = {
    "qwen2_vl": QWEN,
    "qwen2_5_vl": QWEN,
    "qwen3_vl": QWEN,
    "qwen3_5": QWEN,
    "glm4v": GLM4V,
    "minicpmv4_6": MINICPMV4_6,
    "internvl": INTERNVL,
    "llava_next": LLAVA_NEXT,
    "llava_onevision": LLAVA_ONEVISION,
    "gemma3": GEMMA3,
    "mistral3": MISTRAL3,
    "idefics3": IDEFICS3,
}


def chat_format(config: dict) -> ChatFormat:
    """The chat format of the checkpoint's family."""
    from encoder_common.families import BY_MODEL_TYPE

    model_type = config.get("model_type", "")
    family = BY_MODEL_TYPE.get(model_type)
    if family is None or family.name not in CHAT_FORMATS:
        raise ValueError(f"no chat format for model_type {model_type!r}: add one to CHAT_FORMATS")
    return CHAT_FORMATS[family.name]


def chat_template(form: ChatFormat) -> str:
    start, end = form.turn
    video = "" if form.video is None else f"{{% elif part['type'] in ('video', 'video_url') %}}{form.video}"
    return (
        "{% for message in messages %}"
        f"{start}{{{{ message['role'] }}}}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] in ('image', 'image_url', 'image_embeds') %}}{form.image}"
        f"{video}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        f"{{% endfor %}}{{% endif %}}{end}\n"
        "{% endfor %}"
        f"{{% if add_generation_prompt %}}{start}assistant\n{{% endif %}}"
    )


def special_token_ids(config: dict) -> dict[str, int]:
    """The family's special tokens and their ids: the ones the checkpoint's config gives, the others the
    lowest ids left free, in the order the format lists them."""
    text = config.get("text_config", {})
    form = chat_format(config)

    def token_id(key: str) -> int:
        value = config.get(key, text.get(key))
        if value is None:
            raise ValueError(f"config.json names no {key}")
        return int(value)

    given = {token: token_id(key) for token, key in form.specials.items() if key is not None}
    free = (i for i in range(1 << 30) if i not in given.values())
    ids = {token: given[token] if key is not None else next(free) for token, key in form.specials.items()}
    return dict(sorted(ids.items(), key=lambda kv: kv[1]))


def write_engine_files(model_dir: str | Path) -> Path:
    """Adds tokenizer.json, tokenizer_config.json, chat_template.jinja and processor_config.json.

    Every id below the language model's vocab_size decodes: the 256 byte tokens take the ids the
    special tokens leave free, and reserved special tokens fill the rest, as in Qwen's own vocab.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    form = chat_format(config)
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
    template = chat_template(form)
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 32768,
                "eos_token": form.eos,
                "pad_token": form.pad,
                "bos_token": None,
                "add_bos_token": False,
                "chat_template": template,
                **({"extra_special_tokens": dict(form.named)} if form.named else {}),
            },
            indent=2,
        )
    )
    (model_dir / "chat_template.jinja").write_text(template)
    # The processor class transformers' AutoProcessor pairs with the model type.
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    processor_class = PROCESSOR_MAPPING_NAMES.get(config.get("model_type", ""))
    if processor_class is None:
        raise ValueError(f"no processor class known for model_type {config.get('model_type')!r}")
    (model_dir / "processor_config.json").write_text(
        json.dumps({"processor_class": processor_class, **form.processor(config)}, indent=2) + "\n"
    )
    return model_dir
