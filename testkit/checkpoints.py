"""The checkpoint writers of the tests, the benchmarks and the demo, built and saved by transformers.

Tiny full-VLM checkpoints of each served family: each builder makes the whole model (language model
included) from a small config with seeded random weights and writes it with `save_pretrained`,
beside the image processor the family's real checkpoints use, so loading goes through exactly what
a downloaded checkpoint would. `write_tower_checkpoint` writes a real-size Qwen2.5-VL tower alone,
and `testkit.default_model` the built-in default model, from the same pieces.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# Shared by every family's language model: small, but a real decoder the VLM class accepts.
TEXT_HIDDEN = 64
_TOKENS = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
_SPECIAL = dict(bos_token_id=254, eos_token_id=255, pad_token_id=0)
# GLM-4.xV names its video markers too (<|begin_of_video|>, <|end_of_video|>).
_GLM_VIDEO_MARKERS = (248, 249)


def _text_config(hidden_size: int, vocab_size: int, **extra) -> dict:
    return dict(
        dict(
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=vocab_size,
            **_SPECIAL,
        ),
        **extra,
    )


# Two heads of 32 for the language models vLLM serves in the engine tests: its CPU attention runs head size
# 32 and refuses the 16 of four heads ("Unsupported CPU attention configuration: head_dim=16").
_CPU_HEADS = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=TEXT_HIDDEN // 2)


def _mrope(hidden_size: int) -> dict:
    half = hidden_size // 4 // 2  # head_dim / 2 with 4 heads, split over t, h, w
    return {
        "rope_type": "default",
        "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
        "rope_theta": 1e6,
    }


def _vision_config(out_hidden_size: int, **extra) -> dict:
    """A 4-block Qwen2.5-VL / Qwen3-VL tower of width 32."""
    return dict(
        depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=out_hidden_size, **extra
    )


def qwen_processor(patch_size: int, mean_std: float | None = None):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    unit = patch_size * 2  # one merged token
    extra = {} if mean_std is None else dict(image_mean=[mean_std] * 3, image_std=[mean_std] * 3)
    # The real checkpoints' range: 4 to 16384 merged tokens per image.
    return Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        merge_size=2,
        min_pixels=4 * unit * unit,
        max_pixels=16384 * unit * unit,
        **extra,
    )


def qwen2_vl(vocab_size: int) -> tuple[torch.nn.Module, object]:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        vision_config=dict(depth=2, embed_dim=32, hidden_size=TEXT_HIDDEN, num_heads=2, mlp_ratio=2),
        text_config=_text_config(TEXT_HIDDEN, vocab_size, rope_parameters=_mrope(TEXT_HIDDEN)),
        **_TOKENS,
        **_SPECIAL,
    )
    return Qwen2VLForConditionalGeneration(config), qwen_processor(14)


def qwen2_5_vl(vocab_size: int) -> tuple[torch.nn.Module, object]:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        vision_config=_vision_config(TEXT_HIDDEN, fullatt_block_indexes=[1, 3], window_size=112),
        text_config=_text_config(TEXT_HIDDEN, vocab_size, rope_parameters=_mrope(TEXT_HIDDEN)),
        **_TOKENS,
        **_SPECIAL,
    )
    return Qwen2_5_VLForConditionalGeneration(config), qwen_processor(14)


def qwen3_vl(vocab_size: int, *, moe: bool = False) -> tuple[torch.nn.Module, object]:
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    # Wider than the others so that one item's embedding plus deepstack spans several wire chunks.
    hidden = 4 * TEXT_HIDDEN
    rope = _mrope(hidden) | {"mrope_interleaved": True}
    # Three language-model layers: the engines add deepstack level i to the image rows after layer i, so
    # with one layer the levels would change nothing a generated token sees.
    text = _text_config(hidden, vocab_size, head_dim=hidden // 4, rope_parameters=rope, num_hidden_layers=3)
    config_class, model_class = Qwen3VLConfig, Qwen3VLForConditionalGeneration
    if moe:  # Qwen3-VL-30B-A3B and its kin: the same tower before a mixture-of-experts language model
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        config_class, model_class = Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
    config = config_class(
        vision_config=_vision_config(hidden, num_position_embeddings=64, deepstack_visual_indexes=[0, 2]),
        text_config=text,
        **_TOKENS,
    )
    # Qwen3-VL normalizes with mean = std = 0.5 and patch 16.
    return model_class(config), qwen_processor(16, mean_std=0.5)


def _clip_tower(image_size: int, model_type: str = "clip_vision_model") -> dict:
    """A 3-layer CLIP or SigLIP vision model of width 32, patch 14 (SigLIP without its pooling head, which the
    VLMs' checkpoints leave out)."""
    config = dict(
        model_type=model_type,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        patch_size=14,
        image_size=image_size,
    )
    if model_type == "clip_vision_model":
        config["projection_dim"] = 32
    else:
        config["vision_use_head"] = False
    return config


def llava(
    vocab_size: int,
    *,
    vision_feature_layer: int | list[int] = -2,
    select_strategy: str = "default",
    image_size: int = 56,  # 4x4 patches of 14; CLIP-L/14-336 has 336, 24x24
):
    from transformers import LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    config = LlavaConfig(
        vision_config=_clip_tower(image_size),
        text_config=dict(model_type="llama", **_text_config(TEXT_HIDDEN, vocab_size)),
        image_token_index=_TOKENS["image_token_id"],
        image_seq_length=(image_size // 14) ** 2,
        vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy=select_strategy,
        **_SPECIAL,
    )
    processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    return LlavaForConditionalGeneration(config), processor


def _qwen3_5_text(vocab_size: int) -> dict:
    """Qwen3.5's language model, also MiniCPM-V 4.6's: a linear-attention (Gated DeltaNet) layer and a
    full-attention one, as the real models alternate them; head sizes vLLM's CPU attention runs (64)."""
    hidden = 4 * TEXT_HIDDEN
    return _text_config(
        hidden,
        vocab_size,
        num_hidden_layers=2,
        head_dim=hidden // 4,
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=128,  # the real models' (vLLM's CPU Gated DeltaNet kernel refuses 32)
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        rope_parameters=_mrope(hidden) | {"mrope_interleaved": True, "partial_rotary_factor": 1.0},
    )


def qwen3_5(vocab_size: int, *, moe: bool = False) -> tuple[torch.nn.Module, object]:
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    hidden = 4 * TEXT_HIDDEN
    text = _qwen3_5_text(vocab_size)
    config_class, model_class = Qwen3_5Config, Qwen3_5ForConditionalGeneration
    if moe:  # Qwen3.5-35B-A3B and its kin: the same tower before a mixture-of-experts language model
        text.update(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
        )
        config_class, model_class = Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
        num_position_embeddings=64,
    )  # fmt: skip
    config = config_class(vision_config=vision, text_config=text, **_TOKENS)
    return model_class(config), qwen_processor(16, mean_std=0.5)


# AnyRes resolutions of the tiny LLaVA-NeXT / OneVision checkpoints: multiples of their 56 px tile; the
# largest gives OneVision more than its `anyres_max_9` tiles, so that it pools them.
_PINPOINTS = [
    [56, 112], [112, 56], [112, 112], [56, 168], [168, 56], [112, 168], [168, 112], [168, 168], [224, 224]
]  # fmt: skip


def llava_next(vocab_size: int):
    """LLaVA-NeXT (1.6): CLIP tiles of an AnyRes grid plus the whole image, newline rows, the CLS token dropped."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    config = LlavaNextConfig(
        vision_config=_clip_tower(56),
        # 4096 positions: the engine tests' --max-model-len (Llama's default is 2048)
        text_config=dict(
            model_type="llama",
            **_text_config(TEXT_HIDDEN, vocab_size, max_position_embeddings=4096, **_CPU_HEADS),
        ),
        image_token_index=_TOKENS["image_token_id"],
        image_grid_pinpoints=_PINPOINTS,
        image_seq_length=16,
        **_SPECIAL,
    )
    processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}, image_grid_pinpoints=_PINPOINTS
    )
    return LlavaNextForConditionalGeneration(config), processor


def llava_onevision(vocab_size: int):
    """LLaVA-OneVision: SigLIP tiles of an AnyRes grid plus the whole image, newline rows, every token kept,
    the tiles' features pooled down past `anyres_max_9`."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    config = LlavaOnevisionConfig(
        vision_config=_clip_tower(56, "siglip_vision_model"),
        text_config=dict(model_type="qwen2", **_text_config(TEXT_HIDDEN, vocab_size, **_CPU_HEADS)),
        image_token_index=_TOKENS["image_token_id"],
        video_token_index=_TOKENS["video_token_id"],
        image_grid_pinpoints=_PINPOINTS,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        **_SPECIAL,
    )
    processor = LlavaOnevisionImageProcessorPil(
        size={"height": 56, "width": 56}, image_grid_pinpoints=_PINPOINTS
    )
    return LlavaOnevisionForConditionalGeneration(config), processor


def internvl(vocab_size: int):
    """InternVL 3/3.5 in the Hugging Face format: 56 px tiles (448 in the real ones) plus a thumbnail, a
    0.5 pixel shuffle, the CLS token dropped."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    config = InternVLConfig(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=[56, 56],
            patch_size=[14, 14],
        ),
        text_config=dict(model_type="qwen2", **_text_config(TEXT_HIDDEN, vocab_size, **_CPU_HEADS)),
        image_token_id=_TOKENS["image_token_id"],
        image_seq_length=4,
        **_SPECIAL,
    )
    processor = GotOcr2ImageProcessorPil(
        size={"height": 56, "width": 56},
        crop_to_patches=True,
        min_patches=1,
        max_patches=12,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    )
    return InternVLForConditionalGeneration(config), processor


def gemma3(vocab_size: int, *, pan_and_scan: bool = False):
    """Gemma 3: SigLIP at a fixed size (896 px, 256 tokens in the real ones; here 56 px, 4 tokens), and with
    pan-and-scan the processor adds crops of a long image, each its own block of tokens."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    # head_dim 32: vLLM's CPU attention runs no head size below it
    text = _text_config(TEXT_HIDDEN, vocab_size, head_dim=32, sliding_window=64)
    config = Gemma3Config(
        vision_config=_clip_tower(56, "siglip_vision_model"),
        text_config=dict(model_type="gemma3_text", **text),
        mm_tokens_per_image=4,
        image_token_index=_TOKENS["image_token_id"],
        boi_token_index=_TOKENS["vision_start_token_id"],
        eoi_token_index=_TOKENS["vision_end_token_id"],
    )
    processor = Gemma3ImageProcessorPil(
        size={"height": 56, "width": 56},
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        do_pan_and_scan=pan_and_scan,
        pan_and_scan_min_crop_size=28,
        pan_and_scan_max_num_crops=4,
        pan_and_scan_min_ratio_to_activate=1.2,
    )
    model = Gemma3ForConditionalGeneration(config)
    # transformers initializes the projection to zeros: images would then change no answer and every image's
    # features would be zeros. Random, as a trained checkpoint's (seeded by write_checkpoint).
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.5)
    return model, processor


def mistral3(vocab_size: int):
    """Mistral 3 (Mistral Small 3.x, Pixtral in the Hugging Face format): a Pixtral tower at the image's own
    size (up to 1540 px in the real ones; here 224), patch 14, 2x2 patches merged into one row, each row of
    rows ended by a break token in the prompt."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    longest_edge = 224
    config = Mistral3Config(
        vision_config=dict(
            model_type="pixtral",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            patch_size=14,
            image_size=longest_edge,
        ),
        # head_dim 32: vLLM's CPU attention runs no head size below it
        text_config=dict(model_type="mistral", **_text_config(TEXT_HIDDEN, vocab_size, head_dim=32)),
        image_token_index=_TOKENS["image_token_id"],
        spatial_merge_size=2,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    processor = PixtralImageProcessorPil(
        size={"longest_edge": longest_edge}, patch_size={"height": 14, "width": 14}
    )
    return Mistral3ForConditionalGeneration(config), processor


def idefics3(vocab_size: int):
    """Idefics 3 / SmolVLM: a SigLIP tower on fixed square tiles of the image (a grid of them, then the whole
    image shrunk to one), each tile's patches pixel-shuffled by `scale_factor` into 4 rows here (81 to 169 in
    the real ones)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tile = 56
    config = Idefics3Config(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            patch_size=14,
            image_size=tile,
        ),
        # Llama's default 2048 positions would refuse the engine tests' max_model_len of 4096
        text_config=dict(
            model_type="llama",
            **_text_config(TEXT_HIDDEN, vocab_size, head_dim=32, max_position_embeddings=4096),
        ),
        image_token_id=_TOKENS["image_token_id"],
        scale_factor=2,
        pad_token_id=_SPECIAL["pad_token_id"],
        tie_word_embeddings=False,
    )
    processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 4 * tile},  # a grid of up to 4x4 tiles, as SmolVLM's 4 x 384 px
        max_image_size={"longest_edge": tile},
        do_image_splitting=True,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )
    return Idefics3ForConditionalGeneration(config), processor


def glm4v(vocab_size: int, *, moe: bool = False):
    """GLM-4.1V (and with `moe` GLM-4.5V): a Qwen-like patch-14 tower with 2x2 merging and 2D rope, before a
    GLM-4 language model with half-rotary 3D rope; head sizes vLLM's CPU attention runs (64)."""
    from transformers import (
        Glm4vConfig,
        Glm4vForConditionalGeneration,
        Glm4vMoeConfig,
        Glm4vMoeForConditionalGeneration,
    )
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    hidden = 4 * TEXT_HIDDEN
    # The real models rotate half of each head (partial_rotary_factor 0.5), split [8, 12, 12] over t, h, w of
    # 64 rotary dimensions; here 32 of a 64-wide head, in the same proportions.
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5, "mrope_section": [4, 6, 6]}
    text = _text_config(hidden, vocab_size, rope_parameters=rope)
    config_class, model_class = Glm4vConfig, Glm4vForConditionalGeneration
    if moe:  # GLM-4.5V: the same tower before a mixture-of-experts language model (every layer MoE here)
        text.update(
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=0,
            head_dim=hidden // 4, use_qk_norm=False,  # vLLM's GLM-4.5 reads both, as the real config has them
        )  # fmt: skip
        config_class, model_class = Glm4vMoeConfig, Glm4vMoeForConditionalGeneration
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden, image_size=56,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
    )  # fmt: skip
    config = config_class(
        vision_config=vision,
        text_config=text,
        image_token_id=_TOKENS["image_token_id"],
        video_token_id=_TOKENS["video_token_id"],
        image_start_token_id=_TOKENS["vision_start_token_id"],
        image_end_token_id=_TOKENS["vision_end_token_id"],
        video_start_token_id=_GLM_VIDEO_MARKERS[0],
        video_end_token_id=_GLM_VIDEO_MARKERS[1],
    )
    # The real checkpoints' range: 112x112 to 28x28x15000 pixels (4 to 15000 merged tokens), CLIP's mean
    # and std.
    processor = Glm4vImageProcessorPil(size={"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 15000})
    return model_class(config), processor


def minicpmv4_6(vocab_size: int):
    """MiniCPM-V 4.6: a SigLIP-like tower over an overview image and up to 9 slices (448 px in the real ones;
    here 112 px), a window-attention 2x2 merger inside the tower and a 2x2 merger after it (16 patches per
    token), before Qwen3.5's language model."""
    from transformers import MiniCPMV4_6Config, MiniCPMV4_6ForConditionalGeneration
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil

    text = dict(model_type="qwen3_5_text", **_qwen3_5_text(vocab_size))
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=112,
        patch_size=14,
    )  # fmt: skip
    config = MiniCPMV4_6Config(
        vision_config=vision,
        text_config=text,
        insert_layer_id=0,  # the window merger after the first of the two layers (the 7th of 27 in the real ones)
        image_size=112,
        image_token_id=_TOKENS["image_token_id"],
        video_token_id=_TOKENS["video_token_id"],
    )
    processor = MiniCPMV4_6ImageProcessorPil(scale_resolution=112, patch_size=14, max_slice_nums=9)
    return MiniCPMV4_6ForConditionalGeneration(config), processor


# The one place each family's test checkpoint is written: family (encoder_common/families.py) -> builder.
# A family with MoE checkpoints takes `moe=True`, which `write_checkpoint("<family>_moe", ...)` passes.
BUILDERS: dict[str, Callable[..., tuple[torch.nn.Module, object]]] = {
    "qwen2_vl": qwen2_vl,
    "qwen2_5_vl": qwen2_5_vl,
    "qwen3_vl": qwen3_vl,
    "qwen3_5": qwen3_5,
    "llava": llava,
    "llava_next": llava_next,
    "llava_onevision": llava_onevision,
    "internvl": internvl,
    "gemma3": gemma3,
    "glm4v": glm4v,
    "minicpmv4_6": minicpmv4_6,
    "mistral3": mistral3,
    "idefics3": idefics3,
}


# Families whose tensors transformers saves under other names than their real checkpoints: it writes a CLIP
# or SigLIP tower without the `vision_model.` level that the Hub's checkpoints (and vLLM's loader) have.
REAL_PREFIXES: dict[str, dict[str, str]] = {
    "llava_next": {"vision_tower.": "vision_tower.vision_model."},
    "llava_onevision": {"vision_tower.": "vision_tower.vision_model."},
    "gemma3": {"vision_tower.": "vision_tower.vision_model."},
}


def model_types() -> list[str]:
    """Every model type the transformers backend serves, each of which `write_checkpoint` writes."""
    from encoder_common.families import FAMILIES

    return [t for family in FAMILIES.values() if family.tower for t in family.model_types]


def write_checkpoint(
    family: str,
    out_dir: Path,
    *,
    seed: int = 0,
    vocab_size: int = 256,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
    **options,
) -> Path:
    """Builds the full tiny VLM of `family` (or of one of its model types: "qwen3_vl_moe") with seeded
    weights and saves it with its processor."""
    from encoder_common.families import BY_MODEL_TYPE

    name = BY_MODEL_TYPE[family].name
    if family != name:  # the family's MoE checkpoints
        options["moe"] = True
    torch.manual_seed(seed)
    model, processor = BUILDERS[name](vocab_size, **options)
    model = model.to(dtype).eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **kwargs)
    if name in REAL_PREFIXES:
        rename_prefixes(out_dir, REAL_PREFIXES[name])
    processor.save_pretrained(out_dir)
    return out_dir


def write_tower_checkpoint(out_dir: Path, vision_config: dict, device: str, seed: int = 0) -> Path:
    """A Qwen2.5-VL checkpoint holding only the vision tower (random weights), in the real on-disk format.

    The encoder server reads only `visual.*` tensors, so the language model is left out: a real-size
    tower is written in seconds without building a 7B model.
    """
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLConfig(vision_config=vision_config)
    torch.manual_seed(seed)
    with torch.device(device):  # random init of a real-size tower is much faster on the GPU
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config)
    tensors = {f"visual.{k}": v.to(torch.bfloat16).cpu().contiguous() for k, v in tower.state_dict().items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    qwen_processor(14).save_pretrained(out_dir)
    mark_random_weights(out_dir, seed)
    return out_dir


def mark_random_weights(out_dir: Path, seed: int) -> None:
    """The marker file that makes the server log and report a checkpoint's weights as random."""
    from encoder_server.models.loading import RANDOM_WEIGHTS_MARKER

    (out_dir / RANDOM_WEIGHTS_MARKER).write_text(
        f"This checkpoint has deterministic random weights (seed {seed}): its embeddings have no meaning.\n"
    )


def tensor_names(model_dir: Path) -> list[str]:
    """Every tensor name stored in the checkpoint, across its shards."""
    names: list[str] = []
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return sorted(names)


def rewrite_tensors(
    model_dir: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
) -> None:
    """Rewrites each safetensors file of the checkpoint in place with `edit(its tensors)`.

    The index of a sharded checkpoint is kept in step.
    """
    weight_map: dict[str, str] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
            tensors = edit({name: f.get_tensor(name).clone() for name in f.keys()})
        save_file(tensors, str(path), metadata=metadata)
        weight_map.update(dict.fromkeys(tensors, path.name))
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        content = json.loads(index.read_text())
        content["weight_map"] = weight_map
        index.write_text(json.dumps(content, indent=2))


def rename_prefixes(model_dir: Path, renames: Mapping[str, str]) -> None:
    """Stores the checkpoint's tensors under other name prefixes, e.g. {"visual.": "model.visual."}.

    Real checkpoints differ in the prefixes they store (older exports, other tools); this makes
    a checkpoint with the same weights under another naming.
    """

    def renamed(name: str) -> str:
        for old, new in renames.items():
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    rewrite_tensors(model_dir, lambda tensors: {renamed(name): t for name, t in tensors.items()})


def qwen2_5_vl_7b_tower(depth: int = 32) -> dict:
    """The vision_config of Qwen2.5-VL-7B's tower at its real width; `depth` 32 is the real model."""
    return dict(
        depth=depth,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=3584,
        fullatt_block_indexes=[i for i in (7, 15, 23, 31) if i < depth] or [depth - 1],
        window_size=112,
    )
