"""The VLM families the project knows, one line each: the model types of a family, the module of
encoder_server.models that runs its tower on the transformers backend, and how vLLM takes its images
when our encoders computed them.

The encoder server loads a checkpoint through this table; encoder-gateway and the vLLM connector derive
what they hand the engine from it. It imports neither transformers nor pillow: the gateway and the
connector install without the server's extra.
"""

from __future__ import annotations

from dataclasses import dataclass

from .vllm_inputs import GridEmbeds, ImageSizeEmbeds, NoEmbeds, TensorEmbeds, VllmInput


@dataclass(frozen=True)
class Family:
    """One VLM family: its name (= its model_type), whether `<name>_moe` checkpoints (a mixture-of-experts
    language model before the same tower) belong to it, the `module.Class` of encoder_server.models that
    serves it on the transformers backend (None: the vLLM backend only), and its vLLM input (a form of
    encoder_common.vllm_inputs)."""

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
        Family("qwen2_vl", "qwen_vl.QwenVL", GridEmbeds()),
        Family("qwen2_5_vl", "qwen_vl.QwenVL", GridEmbeds()),
        Family("qwen3_vl", "qwen_vl.QwenVL", GridEmbeds(), moe=True),
        Family("qwen3_5", "qwen_vl.QwenVL", GridEmbeds(), moe=True),
        Family("llava", "llava.Llava", TensorEmbeds()),
        Family("llava_next", "llava_next.LlavaNext", TensorEmbeds(equal_counts_only=True)),
        Family("llava_onevision", "llava_next.LlavaNext", TensorEmbeds(equal_counts_only=True)),
        Family("internvl", "internvl.InternVL", TensorEmbeds(equal_counts_only=True)),
        Family("gemma3", "gemma3.Gemma3", NoEmbeds()),
        Family("mistral3", None, NoEmbeds()),
        Family("glm4v", None, NoEmbeds(), moe=True),
        Family("idefics3", None, NoEmbeds()),
        Family("minicpmv4_6", None, ImageSizeEmbeds()),
    )
}

# model_type in config.json -> its family
BY_MODEL_TYPE: dict[str, Family] = {
    model_type: family for family in FAMILIES.values() for model_type in family.model_types
}


def family_of(name: str) -> Family | None:
    """The family a served family name or a model_type belongs to (None: the project does not know it)."""
    return FAMILIES.get(name) or BY_MODEL_TYPE.get(name)
