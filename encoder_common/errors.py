"""Domain errors of the encode path and the one table that maps them to gRPC and HTTP statuses, for every
side: the server's statuses, the receiver's errors, the gateway's HTTP answers, SGLang's error_code."""

from __future__ import annotations

import enum
from dataclasses import dataclass

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


class NotFoundError(EncoderError):
    """A Fetch named a key the server does not hold: never leased there, expired, evicted or fetched."""


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


class TransferUnavailableError(EncoderError):
    """A transport other than the stream was asked for by name, and this receiver or that server cannot
    use it."""


class SharedMemoryUnavailableError(TransferUnavailableError):
    """transfer="shm" was asked for, but this host or that server cannot use the shared-memory path."""


class TransferEngineUnavailableError(TransferUnavailableError):
    """transfer="mooncake" was asked for, but the transfer engine does not run here or that server
    cannot write with it."""


class TokenCountMismatchError(EncoderError):
    """The vision tower produced a different number of tokens than preprocessing announced."""

    def __init__(self, produced: int, expected: int, index: int | None = None):
        where = f"item {index}: " if index is not None else ""
        super().__init__(f"{where}Encoder produced {produced} tokens, but preprocessing expected {expected}")


@dataclass(frozen=True)
class ErrorStatus:
    """How an error class is answered: its gRPC status, and its HTTP status (the gateway's answer, and
    the `error_code` of SGLang's EmbeddingData, which carries HTTP codes)."""

    grpc: grpc.StatusCode
    http: int


# The one table: exact class -> its statuses; subclasses inherit their parent's entry (first match along
# the MRO). Read backwards, a status stands for the first class listed with it: the base first, so that
# INTERNAL comes back as a plain EncoderError. An overloaded server is HTTP 503, not 429: RESOURCE_EXHAUSTED here means this server's
# queue or stream budget is spent, a temporary state of the server (RFC 9110 15.6.4, with Retry-After)
# that a load balancer retries on another backend, while 429 (RFC 6585) tells a client that it sent
# too many requests, blaming a caller who did nothing wrong.
ERROR_TABLE: dict[type[EncoderError], ErrorStatus] = {
    EncoderError: ErrorStatus(grpc.StatusCode.INTERNAL, 500),
    InvalidItemError: ErrorStatus(grpc.StatusCode.INVALID_ARGUMENT, 400),
    OverloadedError: ErrorStatus(grpc.StatusCode.RESOURCE_EXHAUSTED, 503),
    UnavailableError: ErrorStatus(grpc.StatusCode.UNAVAILABLE, 503),
    UnauthenticatedError: ErrorStatus(grpc.StatusCode.UNAUTHENTICATED, 401),
    NotFoundError: ErrorStatus(grpc.StatusCode.NOT_FOUND, 404),
    PermissionDeniedError: ErrorStatus(grpc.StatusCode.PERMISSION_DENIED, 403),
    DeadlineExceededError: ErrorStatus(grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    TransferUnavailableError: ErrorStatus(grpc.StatusCode.FAILED_PRECONDITION, 400),
    TokenCountMismatchError: ErrorStatus(grpc.StatusCode.INTERNAL, 500),
}
_UNEXPECTED = ERROR_TABLE[EncoderError]

_ERROR_BY_STATUS = {status.grpc: cls for cls, status in reversed(ERROR_TABLE.items())}


def error_status(cls: type[BaseException]) -> ErrorStatus:
    """The statuses of an error class; INTERNAL / 500 for anything unexpected."""
    for base in cls.__mro__:
        if base in ERROR_TABLE:
            return ERROR_TABLE[base]
    return _UNEXPECTED


def status_for(error: BaseException) -> grpc.StatusCode:
    """The status code a server sends for `error`; INTERNAL for anything unexpected."""
    return error_status(type(error)).grpc


def status_for_class(cls: type[BaseException]) -> grpc.StatusCode:
    """The status code of an error class; INTERNAL for anything unexpected."""
    return error_status(cls).grpc


def http_status_for(error: BaseException) -> int:
    """The HTTP status (and SGLang error_code) of `error`; 500 for anything unexpected."""
    return error_status(type(error)).http


def http_status_for_code(code: grpc.StatusCode, details: str = "") -> int:
    """The HTTP status of a gRPC status a receiver got back: that of the error class it stands for."""
    return error_status(error_class_for(code, details)).http


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
