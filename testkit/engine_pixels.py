"""Run in .venv-engines (the checkout on PYTHONPATH): the installed engines' own image loading and processors
on the parity image set, for tests/engines/test_parity.py to compare with the encoder's profiles.

    python testkit/engine_pixels.py MODEL_DIR OUT_DIR [ENGINE...]   (vllm, sglang; default both)

Writes OUT_DIR/pixels.safetensors ("<engine>/<image>/pixel_values" and ".../grid_thw") and
OUT_DIR/results.json (the engines' versions, and each image's refusal where an engine refused it).
- vllm: `ImageMediaIO.load_bytes` (what its chat API does with an image part's bytes), then its
  multimodal processor's own HF processor call (`ctx.call_hf_processor`), then the tower's input
  normalization module (`build_mm_input_norm`), which vLLM runs on the device for Qwen.
- sglang: its encoder's `EncoderPreprocessor.process_mm_items` on the bytes (loading and processor).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

PROMPT = "<|vision_start|><|image_pad|><|vision_end|>"


def refusal(exc: Exception) -> str:
    """An engine's refusal, short: SGLang's messages quote the whole input."""
    return f"{type(exc).__name__}: {exc}"[:300]


def vllm_pixels(model_dir: str, images: dict[str, bytes], tensors: dict, refusals: dict) -> str:
    import torch
    import vllm
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fusion.mm_input_norm import build_mm_input_norm
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.media.image import ImageMediaIO

    model_config = ModelConfig(model=model_dir, dtype="float32")
    processor = MULTIMODAL_REGISTRY.create_processor(model_config)
    # vLLM's processor leaves Qwen's rescale and normalization to the tower's input module (on the
    # device): what the tower sees is that module's output.
    with set_current_vllm_config(VllmConfig(model_config=model_config)):  # a CustomOp reads it when built
        input_norm = build_mm_input_norm(model_config)
    info = processor.info
    hf_processor = info.get_hf_processor()
    for name, data in images.items():
        try:
            image = ImageMediaIO().load_bytes(data).media
            out = info.ctx.call_hf_processor(hf_processor, {"text": PROMPT, "images": [image]}, {})
        except Exception as exc:  # what vLLM refuses: the test checks that the encoder refuses it too
            refusals[name] = refusal(exc)
            continue
        normalize = getattr(input_norm, "forward_native", input_norm)  # the CPU platform's path
        tensors[f"vllm/{name}/pixel_values"] = normalize(out["pixel_values"], torch.float32).contiguous()
        tensors[f"vllm/{name}/grid_thw"] = out["image_grid_thw"].contiguous()
    return vllm.__version__


def sglang_pixels(model_dir: str, images: dict[str, bytes], tensors: dict, refusals: dict) -> str:
    import sglang
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.disaggregation.encoder.preprocessor import EncoderPreprocessor
    from sglang.srt.managers.schedule_batch import Modality
    from sglang.srt.multimodal.encoder_preprocessing import EncoderMediaProcessorConfig
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=model_dir, skip_tokenizer_init=True, host="127.0.0.1", device="cpu")
    publish(args, role="tokenizer")
    preprocessor = EncoderPreprocessor(
        server_args=args,
        model_config=ModelConfig.from_server_args(args),
        encoder_media_processor_config=EncoderMediaProcessorConfig(),
    )

    async def run() -> None:
        for name, data in images.items():
            try:
                out = await preprocessor.process_mm_items([data], Modality.IMAGE)
            except Exception as exc:
                refusals[name] = refusal(exc)
                continue
            tensors[f"sglang/{name}/pixel_values"] = out.mm_inputs["pixel_values"].contiguous()
            tensors[f"sglang/{name}/grid_thw"] = out.grid_thw.contiguous()

    asyncio.run(run())
    return sglang.__version__


def main(model_dir: str, out_dir: str, engines: list[str]) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import PIL
    import torchvision
    import transformers
    from safetensors.torch import save_file

    from testkit.image_set import image_set, refused_images

    images = {**image_set(), **{name: data for name, (data, _) in refused_images().items()}}
    tensors: dict = {}
    results: dict = {
        "versions": {
            "transformers": transformers.__version__,
            "torchvision": torchvision.__version__,
            "pillow": PIL.__version__,
        },
        "refused": {engine: {} for engine in engines},
    }
    for engine in engines:
        run = {"vllm": vllm_pixels, "sglang": sglang_pixels}[engine]
        results["versions"][engine] = run(model_dir, images, tensors, results["refused"][engine])
    save_file(tensors, str(Path(out_dir) / "pixels.safetensors"))
    (Path(out_dir) / "results.json").write_text(json.dumps(results, indent=1))
    print("done", flush=True)


if __name__ == "__main__":  # vLLM may spawn processes that import this module
    main(sys.argv[1], sys.argv[2], sys.argv[3:] or ["vllm", "sglang"])
