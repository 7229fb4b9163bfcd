"""The receiver: the client library a prefill node imports to encode images on encoder servers.

Importing it loads no model code (no transformers), only grpc, protobuf and torch.
"""

from encoder_common.errors import (
    DeadlineExceededError,
    EncoderError,
    InvalidItemError,
    ItemsOffsetError,
    OverloadedError,
    SharedMemoryUnavailableError,
    UnavailableError,
    UnsupportedModalityError,
)

from .channels import ClientTls
from .client import EncoderReceiver
from .errors import EncodeFailedError, ItemAttempt, ShardError
from .health import FailoverPolicy
from .precomputed import PRECOMPUTED_KEY
from .prefill import batch_embedding, expand_placeholders
from .result import EncodeResult, ItemResult
from .sharding import Shard, plan_shards
from .shm import TransferStats
from .windows import Window, get_embedding_chunk, window_rows

__all__ = [
    "ClientTls",
    "DeadlineExceededError",
    "EncodeFailedError",
    "EncodeResult",
    "EncoderError",
    "EncoderReceiver",
    "FailoverPolicy",
    "InvalidItemError",
    "ItemAttempt",
    "ItemResult",
    "ItemsOffsetError",
    "OverloadedError",
    "PRECOMPUTED_KEY",
    "Shard",
    "ShardError",
    "SharedMemoryUnavailableError",
    "TransferStats",
    "UnavailableError",
    "UnsupportedModalityError",
    "Window",
    "batch_embedding",
    "expand_placeholders",
    "get_embedding_chunk",
    "plan_shards",
    "window_rows",
]
