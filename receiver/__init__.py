"""The receiver: the client library a prefill node imports to encode images on encoder servers.

Importing it loads no model code (no transformers), only grpc, protobuf and torch.
"""

from protos.errors import (
    DeadlineExceededError,
    EncoderError,
    InvalidItemError,
    OverloadedError,
    UnavailableError,
    UnsupportedModalityError,
)

from .channels import ClientTls
from .client import EncoderReceiver
from .errors import EncodeFailedError, ItemAttempt, ShardError
from .health import FailoverPolicy
from .result import EncodeResult, ItemResult
from .sharding import Shard, plan_shards

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
    "OverloadedError",
    "Shard",
    "ShardError",
    "UnavailableError",
    "UnsupportedModalityError",
    "plan_shards",
]
