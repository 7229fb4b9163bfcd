"""The VLM families the project knows, one line each: the model types of a family, the module of
encoder_server.models that runs its tower on the transformers backend, and how vLLM takes its images
when our encoders computed them.

The encoder server loads a checkpoint through this table; encoder-gateway and the vLLM connector derive
what they hand the engine from it. It imports neither transformers nor pillow: the gateway and the
connector install without the server's extra.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VllmInput:
    """How vLLM 0.31-0.33 takes one image of a family that was encoded elsewhere (read in vLLM 0.32's code).

    `image_embeds`: the `image_embeds` input vLLM accepts with `--enable-mm-embeds`: "grid" (a dict
    with `image_grid_thw`), "tensor" (the plain [tokens, hidden] tensor), or None where vLLM refuses
    embeddings of the family ("Gemma3 does not support image_embeds."); the inline hand-off needs one.
    `sized_without_image`: vLLM sizes the image's placeholders from the embedding part's metadata
    (`allow_missing_mm_embeddings`); otherwise a connector hand-off sends the raw image beside the uuid,
    for vLLM's processor to size them, and the tower still does not run.
    `equal_counts_only`: vLLM validates an encoder batch of the family's `image_embeds` as one stacked tensor
    (`TensorShape("bn", "ifs", "hs")`): images of different token counts in one batch, of one request or
    of several, raise "data contains inconsistent shapes" in its engine core, which then stops; the
    inline hand-off cannot carry such a family.
    """

    image_embeds: str | None
    sized_without_image: bool
    equal_counts_only: bool = False


# vLLM's Qwen-VL input: image_embeds with its grid, placeholders sized from the grid.
QWEN_GRID = VllmInput(image_embeds="grid", sized_without_image=True)
# LLaVA: a plain tensor inline (a fixed token count); placeholders sized from the image.
PLAIN_TENSOR = VllmInput(image_embeds="tensor", sized_without_image=False)
# LLaVA-NeXT/OneVision, InternVL: a plain tensor, but a count per image size, which vLLM 0.32 cannot batch;
# the connector hand-off with the image.
TILED_TENSOR = VllmInput(image_embeds="tensor", sized_without_image=False, equal_counts_only=True)
# Gemma 3, Mistral 3, Idefics 3, GLM-4.xV: no image_embeds; the connector hand-off with the image.
IMAGE_ONLY = VllmInput(image_embeds=None, sized_without_image=False)
# MiniCPM-V: image_embeds with its image sizes, placeholders sized from them.
IMAGE_SIZES = VllmInput(image_embeds="image_sizes", sized_without_image=True)


@dataclass(frozen=True)
class Family:
    """One VLM family: its name (= its model_type), whether `<name>_moe` checkpoints (a mixture-of-experts
    language model before the same tower) belong to it, the `module.Class` of encoder_server.models that
    serves it on the transformers backend (None: the vLLM backend only), and its vLLM input."""

    name: str
    tower: str | None
    vllm: VllmInput
    moe: bool = False

    @property
    def model_types(self) -> tuple[str, ...]:
        return (self.name, f"{self.name}_moe") if self.moe else (self.name,)


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("qwen2_vl", "qwen_vl.QwenVL", QWEN_GRID),
        Family("qwen2_5_vl", "qwen_vl.QwenVL", QWEN_GRID),
        Family("qwen3_vl", "qwen_vl.QwenVL", QWEN_GRID, moe=True),
        Family("qwen3_5", "qwen_vl.QwenVL", QWEN_GRID, moe=True),
        Family("llava", "llava.Llava", PLAIN_TENSOR),
        Family("llava_next", "llava_next.LlavaNext", TILED_TENSOR),
        Family("llava_onevision", "llava_next.LlavaNext", TILED_TENSOR),
        Family("internvl", "internvl.InternVL", TILED_TENSOR),
        Family("gemma3", "gemma3.Gemma3", IMAGE_ONLY),
        Family("mistral3", None, IMAGE_ONLY),
        Family("glm4v", None, IMAGE_ONLY, moe=True),
        Family("idefics3", None, IMAGE_ONLY),
        Family("minicpmv4_6", None, IMAGE_SIZES),
    )
}

# model_type in config.json -> its family
BY_MODEL_TYPE: dict[str, Family] = {
    model_type: family for family in FAMILIES.values() for model_type in family.model_types
}


def family_of(name: str) -> Family | None:
    """The family a served family name or a model_type belongs to (None: the project does not know it)."""
    return FAMILIES.get(name) or BY_MODEL_TYPE.get(name)
