"""Errors a receiver raises: the shared domain errors, the failure of one shard, and the failure of a
request with what happened to each of its items."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc

from encoder_common.errors import (
    DeadlineExceededError,
    EncoderError,
    InvalidItemError,
    OverloadedError,
    PermissionDeniedError,
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
        self.message = message
        super().__init__(
            f"encoder {encoder_url} failed request {request_id!r} items {self.item_indices}: {self.status}: {message}"
        )

    @property
    def cause_class(self) -> type[EncoderError]:
        """The error class the status stands for (OverloadedError for RESOURCE_EXHAUSTED, ...); its
        `failover` says what the receiver does about it. A stream that broke the contract is an EncoderError."""
        return error_class_for(self.code, self.message) if self.code is not None else EncoderError

    @property
    def status(self) -> str:
        """The status code's name, or PROTOCOL for a stream that broke the contract."""
        return self.code.name if self.code is not None else "PROTOCOL"


@dataclass(frozen=True)
class ItemAttempt:
    """One Encode call an item was part of, and how it ended for that item."""

    encoder_url: str
    status: str  # "OK", a gRPC status name, or "PROTOCOL"
    message: str = ""

    def __str__(self) -> str:
        text = f"{self.status} on {self.encoder_url}"
        return f"{text} ({_shorten(self.message)})" if self.message else text


def _shorten(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class EncodeFailedError(ShardError):
    """A request failed: an item no encoder could serve, a bad item, refused credentials, or the deadline passed.

    `code` is the status that decided it (INVALID_ARGUMENT, UNAUTHENTICATED, PERMISSION_DENIED,
    DEADLINE_EXCEEDED, or the last failure of the item that ran out of encoders or attempts); `encoder_url` is the encoder of that failure,
    if any; `item_indices` lists the items not encoded; `attempts` maps every item to the calls it
    was part of, in order. Completed items' embeddings are discarded with the request.
    """

    def __init__(
        self,
        *,
        request_id: str,
        code: grpc.StatusCode,
        reason: str,
        encoder_url: str,
        attempts: Mapping[int, Sequence[ItemAttempt]],
        completed: set[int],
    ):
        self.encoder_url = encoder_url
        self.request_id = request_id
        self.item_indices = sorted(set(attempts) - completed)
        self.code = code
        self.message = reason
        self.attempts = {index: list(tries) for index, tries in attempts.items()}
        lines = [
            f"request {request_id!r} failed: {code.name}: {reason}; "
            f"items {self.item_indices} not encoded, {len(completed)} of {len(attempts)} done"
        ]
        for index in sorted(self.attempts):
            story = "; ".join(map(str, self.attempts[index])) or "not sent"
            lines.append(f"  item {index}: {story}")
        EncoderError.__init__(self, "\n".join(lines))


__all__ = [
    "DeadlineExceededError",
    "EncodeFailedError",
    "EncoderError",
    "ItemAttempt",
    "InvalidItemError",
    "OverloadedError",
    "PermissionDeniedError",
    "ShardError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnsupportedModalityError",
]
