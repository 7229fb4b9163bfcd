"""Errors a receiver raises: the shared domain errors, plus the failure of one shard."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from protos.errors import (
    DeadlineExceededError,
    EncoderError,
    InvalidItemError,
    OverloadedError,
    UnauthenticatedError,
    UnavailableError,
    UnsupportedModalityError,
    error_class_for,
)


class ShardError(EncoderError):
    """One encoder failed its share of a request: names the encoder, the request and the items."""

    def __init__(
        self,
        *,
        encoder_url: str,
        request_id: str,
        item_indices: Sequence[int],
        code: grpc.StatusCode | None,
        message: str,
    ):
        self.encoder_url = encoder_url
        self.request_id = request_id
        self.item_indices = list(item_indices)
        self.code = code
        self.cause_class = error_class_for(code) if code is not None else EncoderError
        status = code.name if code is not None else "PROTOCOL"
        super().__init__(
            f"encoder {encoder_url} failed request {request_id!r} items {self.item_indices}: {status}: {message}"
        )


__all__ = [
    "DeadlineExceededError",
    "EncoderError",
    "InvalidItemError",
    "OverloadedError",
    "ShardError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnsupportedModalityError",
]
