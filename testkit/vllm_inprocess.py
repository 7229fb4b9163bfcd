"""Run in .venv-engines (the checkout on PYTHONPATH): vLLM's `LLM.generate` on the same prompt, once with
the raw images (vLLM runs its own tower) and once with `gateway.handoff.multi_modal_data` of the items the
encoder servers returned; prints one line, RESULT and JSON, comparing greedy ids and top logprobs.

    python testkit/vllm_inprocess.py MODEL_DIR ENCODER_URL IMAGE...
"""

from __future__ import annotations

import asyncio
import io
import json
import sys
from pathlib import Path


def main(model_dir: str, encoder_url: str, image_paths: list[str]) -> None:
    from PIL import Image
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from gateway.handoff import multi_modal_data
    from receiver import EncoderReceiver

    pngs = [Path(path).read_bytes() for path in image_paths]

    async def encode():
        async with EncoderReceiver([encoder_url]) as receiver:
            return await receiver.encode("in-process", [{"modality": "image", "data": png} for png in pngs])

    result = asyncio.run(encode())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    content = [{"type": "image"} for _ in pngs] + [{"type": "text", "text": "What is in the pictures?"}]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        limit_mm_per_prompt={"image": len(pngs)},
        enable_mm_embeds=True,
    )
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5)
    raw_images = [Image.open(io.BytesIO(png)).convert("RGB") for png in pngs]
    raw, embedded = (
        llm.generate({"prompt": prompt, "multi_modal_data": data}, params)[0].outputs[0]
        for data in ({"image": raw_images}, multi_modal_data(result))
    )
    worst = 0.0
    for want, got in zip(raw.logprobs, embedded.logprobs):
        for token in want.keys() & got.keys():
            worst = max(worst, abs(want[token].logprob - got[token].logprob))
    print(
        "RESULT",
        json.dumps(
            {
                "raw_ids": list(raw.token_ids),
                "embedded_ids": list(embedded.token_ids),
                "largest_difference": worst,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":  # vLLM spawns worker processes that import this module
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
