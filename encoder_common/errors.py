"""Domain errors of the encode path and the one table that maps them to gRPC status codes.

Both sides use it: the server aborts a call with the status of the error it raised, and the
receiver turns a status it got back into the same error class.
"""

from __future__ import annotations

import grpc


class EncoderError(Exception):
    """Base of every error the encode path raises on purpose."""


class InvalidItemError(EncoderError, ValueError):
    """An item (or the request carrying it) is malformed: the caller's fault, never retried."""


class UnsupportedModalityError(InvalidItemError, NotImplementedError):
    """An item is not an image: the gRPC encode path carries images only."""

    def __init__(self, modalities: list[str]):
        self.modalities = modalities
        super().__init__(f"gRPC encode only supports IMAGE modality, got: {modalities}")


class ItemsOffsetError(InvalidItemError):
    """A request's prompt layout (placeholder tokens or items_offset) disagrees with its items."""


class OverloadedError(EncoderError):
    """The server's queue is full; the call was refused at once."""


class UnavailableError(EncoderError):
    """The server is not serving (starting, draining or shutting down)."""


class NotFoundError(EncoderError):
    """A Fetch named a key the server does not hold: never leased there, expired, evicted or fetched."""


class UnauthenticatedError(EncoderError):
    """The call carried no valid credentials."""


class DeadlineExceededError(EncoderError, TimeoutError):
    """The call's deadline passed before its items were encoded."""


class SharedMemoryUnavailableError(EncoderError):
    """transfer="shm" was asked for, but this host or that server cannot use the shared-memory path."""


class TokenCountMismatchError(EncoderError):
    """The vision tower produced a different number of tokens than preprocessing announced."""

    def __init__(self, produced: int, expected: int, index: int | None = None):
        where = f"item {index}: " if index is not None else ""
        super().__init__(f"{where}Encoder produced {produced} tokens, but preprocessing expected {expected}")


# Exact class -> status code; subclasses inherit their parent's entry (first match along the MRO).
STATUS_BY_ERROR: dict[type[EncoderError], grpc.StatusCode] = {
    UnsupportedModalityError: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidItemError: grpc.StatusCode.INVALID_ARGUMENT,
    OverloadedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    UnavailableError: grpc.StatusCode.UNAVAILABLE,
    UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
    NotFoundError: grpc.StatusCode.NOT_FOUND,
    DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    SharedMemoryUnavailableError: grpc.StatusCode.FAILED_PRECONDITION,
    TokenCountMismatchError: grpc.StatusCode.INTERNAL,
    EncoderError: grpc.StatusCode.INTERNAL,
}

_ERROR_BY_STATUS: dict[grpc.StatusCode, type[EncoderError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidItemError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}


def status_for(error: BaseException) -> grpc.StatusCode:
    """The status code a server sends for `error`; INTERNAL for anything unexpected."""
    for cls in type(error).__mro__:
        if cls in STATUS_BY_ERROR:
            return STATUS_BY_ERROR[cls]
    return grpc.StatusCode.INTERNAL


def error_class_for(code: grpc.StatusCode) -> type[EncoderError]:
    """The error class a receiver raises for a status it got back."""
    return _ERROR_BY_STATUS.get(code, EncoderError)
