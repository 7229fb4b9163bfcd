"""Chat requests with images as the tests and benchmarks send them: greedy, with token ids and top logprobs."""

from __future__ import annotations

import base64
from typing import Any

MAX_TOKENS = 8
TOP_LOGPROBS = 5


def engine_session(timeout_s: float = 600):
    """An aiohttp session for engines and gateways: `timeout_s` for a whole request, and idle connections
    dropped before vLLM's and SGLang's 5 s keep-alive closes them (see gateway.config.ENGINE_KEEPALIVE_S)."""
    import aiohttp

    from gateway.config import ENGINE_KEEPALIVE_S

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(keepalive_timeout=ENGINE_KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_part(png: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(png)}}


def chat_request(
    model: str, parts: list[dict[str, Any]], *, stream: bool = False, max_tokens: int = MAX_TOKENS
) -> dict[str, Any]:
    """A greedy request that returns each token's id and top logprobs."""
    body = {
        "model": model,
        "messages": [
            {"role": "user", "content": [*parts, {"type": "text", "text": "What is in the pictures?"}]}
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": TOP_LOGPROBS,
        "return_tokens_as_token_ids": True,  # tokens come back as "token_id:<id>"
    }
    if stream:
        body["stream"] = True
    return body
