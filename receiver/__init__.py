"""The receiver: the client library a prefill node imports to encode images on encoder servers.

Importing it loads no model code (no transformers), only grpc, protobuf and torch.
"""

from protos.errors import (
    DeadlineExceededError,
    EncoderError,
    InvalidItemError,
    OverloadedError,
    SharedMemoryUnavailableError,
    UnavailableError,
    UnsupportedModalityError,
)

from .client import EncoderReceiver
from .errors import ShardError
from .result import EncodeResult, ItemResult
from .sharding import Shard, plan_shards
from .shm import TransferStats

__all__ = [
    "DeadlineExceededError",
    "EncodeResult",
    "EncoderError",
    "EncoderReceiver",
    "InvalidItemError",
    "ItemResult",
    "OverloadedError",
    "Shard",
    "ShardError",
    "SharedMemoryUnavailableError",
    "TransferStats",
    "UnavailableError",
    "UnsupportedModalityError",
    "plan_shards",
]
