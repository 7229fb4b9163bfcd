"""Domain errors of the encode path and the one table that maps them to gRPC status codes.

Both sides use it: the server aborts a call with the status of the error it raised, and the
receiver turns a status it got back into the same error class.
"""

from __future__ import annotations

import enum

import grpc


class Failover(enum.Enum):
    """What a receiver does when an encoder's call fails with an error of a class (its `failover`)."""

    REPLACE = "replace"  # the encoder is broken: bench it, re-place its unfinished items on others
    BACK_OFF = "back off"  # the encoder is busy, not broken: retry its items after a back-off
    TERMINAL = "terminal"  # no encoder can do better: fail the whole request at once


class EncoderError(Exception):
    """Base of every error the encode path raises on purpose."""

    failover = Failover.REPLACE
    # The server metrics' `outcome` label of a call failing with it: what an operator alerts on
    # without listing status codes.
    outcome = "error"


class InvalidItemError(EncoderError, ValueError):
    """An item (or the request carrying it) is malformed: the caller's fault, never retried."""

    failover = Failover.TERMINAL
    outcome = "invalid"


class UnsupportedModalityError(InvalidItemError, NotImplementedError):
    """An item is not an image: the gRPC encode path carries images only."""

    def __init__(self, modalities: list[str]):
        self.modalities = modalities
        super().__init__(f"gRPC encode only supports IMAGE modality, got: {modalities}")


class ItemsOffsetError(InvalidItemError):
    """A request's prompt layout (placeholder tokens or items_offset) disagrees with its items."""


class OverloadedError(EncoderError):
    """The server's queue is full; the call was refused at once."""

    failover = Failover.BACK_OFF
    outcome = "overloaded"


class UnavailableError(EncoderError):
    """The server is not serving (starting, draining or shutting down)."""

    outcome = "overloaded"


class UnauthenticatedError(EncoderError):
    """The call carried no valid credentials: the caller's configuration, the same on every encoder."""

    failover = Failover.TERMINAL
    outcome = "invalid"


class PermissionDeniedError(EncoderError):
    """The caller's credentials do not allow the call."""

    failover = Failover.TERMINAL
    outcome = "invalid"


class DeadlineExceededError(EncoderError, TimeoutError):
    """The call's deadline passed before its items were encoded."""

    failover = Failover.TERMINAL
    outcome = "cancelled"


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
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
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
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}


def status_for(error: BaseException) -> grpc.StatusCode:
    """The status code a server sends for `error`; INTERNAL for anything unexpected."""
    return status_for_class(type(error))


def status_for_class(cls: type[BaseException]) -> grpc.StatusCode:
    """The status code of an error class; INTERNAL for anything unexpected."""
    for base in cls.__mro__:
        if base in STATUS_BY_ERROR:
            return STATUS_BY_ERROR[base]
    return grpc.StatusCode.INTERNAL


# gRPC itself refuses a message over the size limit with RESOURCE_EXHAUSTED and this text; that is
# the caller's request being too large, not an overloaded server.
_MESSAGE_TOO_LARGE = "larger than max"


def error_class_for(code: grpc.StatusCode, details: str = "") -> type[EncoderError]:
    """The error class a receiver raises for a status (and its details) it got back."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _MESSAGE_TOO_LARGE in details:
        return InvalidItemError
    return _ERROR_BY_STATUS.get(code, EncoderError)


def outcome_for(code: grpc.StatusCode) -> str:
    """The `outcome` label of a call that ended with `code`: that of the code's error class."""
    if code == grpc.StatusCode.OK:
        return "ok"
    if code == grpc.StatusCode.CANCELLED:  # the caller went away: no error of the encode path
        return "cancelled"
    return error_class_for(code).outcome
