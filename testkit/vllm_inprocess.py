"""Run in .venv-engines (the checkout on PYTHONPATH): vLLM's `LLM.generate`, one request per image, once with
the raw image as vLLM's own loader makes it of the file's bytes (vLLM runs its own tower) and once with
`gateway.handoff.multi_modal_data` of the item the encoder server returned, in its family's form; prints one
line, RESULT and JSON, comparing greedy ids and top logprobs per image file.

    python testkit/vllm_inprocess.py MODEL_DIR ENCODER_URL IMAGE...
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path


def main(model_dir: str, encoder_url: str, image_paths: list[str]) -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.multimodal.media.image import ImageMediaIO

    from encoder_common.families import family_of
    from gateway.handoff import multi_modal_data
    from receiver import EncoderReceiver

    files = {Path(path).name: Path(path).read_bytes() for path in image_paths}

    async def encode():
        async with EncoderReceiver([encoder_url]) as receiver:
            family = family_of((await receiver.served_model()).family)
            return family.vllm, {
                name: await receiver.encode(name, [{"modality": "image", "data": data}]) for name, data in files.items()
            }

    taken, results = asyncio.run(encode())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    content = [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,  # within every test checkpoint's positions, room for its largest image
        limit_mm_per_prompt={"image": 1},
        enable_mm_embeds=True,
    )
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5)
    raw_requests = [
        {"prompt": prompt, "multi_modal_data": {"image": [ImageMediaIO().load_bytes(data).media]}}
        for data in files.values()
    ]
    embedded_requests = [
        {"prompt": prompt, "multi_modal_data": multi_modal_data(results[name], taken)} for name in files
    ]
    raw_outputs = llm.generate(raw_requests, params)
    # One request at a time: vLLM batches the image_embeds of some families at one token count only
    # (encoder_common.vllm_inputs.TensorEmbeds.equal_counts_only), and the images differ in size.
    embedded_outputs = [output for request in embedded_requests for output in llm.generate(request, params)]
    report = {}
    for name, raw_output, embedded_output in zip(files, raw_outputs, embedded_outputs):
        raw, embedded = raw_output.outputs[0], embedded_output.outputs[0]
        worst = 0.0
        for want, got in zip(raw.logprobs, embedded.logprobs):
            for token in want.keys() & got.keys():
                worst = max(worst, abs(want[token].logprob - got[token].logprob))
        report[name] = {
            "raw_ids": list(raw.token_ids),
            "embedded_ids": list(embedded.token_ids),
            "largest_difference": worst,
        }
    print("RESULT", json.dumps(report), flush=True)


if __name__ == "__main__":  # vLLM spawns worker processes that import this module
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
