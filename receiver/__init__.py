"""The receiver: the client library a prefill node imports to encode images on encoder servers.

Importing it loads no model code (no transformers), only grpc, protobuf and torch; each public name is
imported on first use, so that `receiver.config` (the settings the commands build their flags from)
loads without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the module that defines it.
_EXPORTS = {
    "DeadlineExceededError": "encoder_common.errors",
    "EncoderError": "encoder_common.errors",
    "InvalidItemError": "encoder_common.errors",
    "ItemsOffsetError": "encoder_common.errors",
    "OverloadedError": "encoder_common.errors",
    "SharedMemoryUnavailableError": "encoder_common.errors",
    "TransferEngineUnavailableError": "encoder_common.errors",
    "TransferUnavailableError": "encoder_common.errors",
    "UnavailableError": "encoder_common.errors",
    "UnsupportedModalityError": "encoder_common.errors",
    "ClientTls": "receiver.config",
    "FailoverPolicy": "receiver.config",
    "ReceiverConfig": "receiver.config",
    "EncoderReceiver": "receiver.client",
    "EncodeFailedError": "receiver.errors",
    "ItemAttempt": "receiver.errors",
    "ShardError": "receiver.errors",
    "PRECOMPUTED_KEY": "receiver.embeddings.precomputed",
    "batch_embedding": "receiver.embeddings.prefill",
    "expand_placeholders": "receiver.embeddings.prefill",
    "EncodeResult": "receiver.embeddings.result",
    "ItemResult": "receiver.embeddings.result",
    "Shard": "receiver.fleet.sharding",
    "plan_shards": "receiver.fleet.sharding",
    "TransferStats": "receiver.transports",
    "Window": "receiver.embeddings.windows",
    "get_embedding_chunk": "receiver.embeddings.windows",
    "window_rows": "receiver.embeddings.windows",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'receiver' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

