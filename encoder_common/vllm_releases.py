"""The vLLM releases this project's vLLM-facing code is written against, declared once (the connector,
the gateway's `image_embeds` part, the server's vLLM tower backend), and the range check. Imports nothing
from vLLM."""

from __future__ import annotations

import re

# Lowest release read and tested, and the first release not yet read: [0.31, 0.34).
SUPPORTED_VLLM_FROM = (0, 31)
SUPPORTED_VLLM_BELOW = (0, 34)
# The tower backend drives vLLM's renderer, multimodal batching and `embed_multimodal` on a model loaded
# with `mm_encoder_only`: read and tested in 0.32.0 only (docs/architecture.md, "Tower backends").
TOWER_BACKEND_VLLM_FROM = (0, 32)
TOWER_BACKEND_VLLM_BELOW = (0, 33)

_RELEASE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


def release_range(lowest: tuple[int, int], below: tuple[int, int]) -> str:
    """A range of releases as a pip specifier: ">=0.31,<0.34"."""
    return ">={}.{},<{}.{}".format(*lowest, *below)


SUPPORTED_VLLM = release_range(SUPPORTED_VLLM_FROM, SUPPORTED_VLLM_BELOW)
TOWER_BACKEND_VLLM = release_range(TOWER_BACKEND_VLLM_FROM, TOWER_BACKEND_VLLM_BELOW)


def release(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version string as vLLM reports it ("0.32.0", "0.33.1+cpu", "0.34.0rc1");
    None when it does not start with one."""
    match = _RELEASE.match(version.strip())
    if match is None:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def in_supported_range(
    version: str, lowest: tuple[int, int] = SUPPORTED_VLLM_FROM, below: tuple[int, int] = SUPPORTED_VLLM_BELOW
) -> bool:
    """Whether `version` is in [lowest, below): by default the connector's and the gateway's range."""
    parsed = release(version)
    return parsed is not None and lowest <= parsed[:2] < below
