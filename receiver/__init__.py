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
    "PRECOMPUTED_KEY": "receiver.precomputed",
    "batch_embedding": "receiver.prefill",
    "expand_placeholders": "receiver.prefill",
    "EncodeResult": "receiver.result",
    "ItemResult": "receiver.result",
    "Shard": "receiver.sharding",
    "plan_shards": "receiver.sharding",
    "TransferStats": "receiver.transports",
    "Window": "receiver.windows",
    "get_embedding_chunk": "receiver.windows",
    "window_rows": "receiver.windows",
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

