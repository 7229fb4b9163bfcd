"""One error table (encoder_common.errors.ERROR_TABLE): every domain error has one gRPC status and one
HTTP status, and the server, the receiver, the gateway and the SGLang path all answer from it."""

from __future__ import annotations

import inspect

import grpc
import pytest

from encoder_common import errors
from encoder_common.errors import (
    ERROR_TABLE,
    EncoderError,
    OverloadedError,
    error_class_for,
    http_status_for,
    http_status_for_code,
    status_for,
)
from gateway.protocol import ImagePart
from gateway.serving import encode_error
from receiver import EncodeFailedError
from receiver.errors import ItemAttempt

DOMAIN_ERRORS = [
    cls for _, cls in inspect.getmembers(errors, inspect.isclass) if issubclass(cls, EncoderError)
]


@pytest.mark.parametrize("cls", DOMAIN_ERRORS, ids=lambda cls: cls.__name__)
def test_every_domain_error_has_its_statuses_and_comes_back_as_its_family(cls):
    status = errors.error_status(cls)
    assert status.grpc != grpc.StatusCode.OK and 400 <= status.http < 600
    # What a receiver makes of the status the server sent: the error's own family, or the base class
    # for INTERNAL ("the server failed").
    back = error_class_for(status.grpc)
    assert issubclass(cls, back) or back is EncoderError
    assert http_status_for_code(status.grpc) == errors.error_status(back).http


def test_an_overloaded_server_is_resource_exhausted_and_503_on_every_path():
    assert status_for(OverloadedError("busy")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert http_status_for(OverloadedError("busy")) == 503  # SGLang's error_code of a pushed failure
    assert http_status_for_code(grpc.StatusCode.RESOURCE_EXHAUSTED) == 503
    # gRPC's own "message larger than max" is the caller's request being too big, not a busy server.
    assert http_status_for_code(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (9 vs. 4)") == 400
    assert http_status_for(ValueError("unexpected")) == 500
    assert {cls: status.http for cls, status in ERROR_TABLE.items()}[errors.InvalidItemError] == 400


def failed(code: grpc.StatusCode, message: str) -> EncodeFailedError:
    return EncodeFailedError(
        request_id="r",
        code=code,
        reason=message,
        encoder_url="grpc://127.0.0.1:1",
        attempts={0: [ItemAttempt("grpc://127.0.0.1:1", code.name, message)]},
        completed=set(),
    )


@pytest.mark.parametrize(
    "code,http",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 503),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 502),  # the encoders failed on their own: a bad upstream
        (grpc.StatusCode.UNAUTHENTICATED, 502),  # the gateway's own credentials: not the client's fault
    ],
)
def test_the_gateway_answers_from_the_table(code, http):
    parts = [ImagePart(message_index=0, part_index=1, url="data:image/png;base64,AAAA")]
    answer = encode_error(failed(code, "item 0: why"), parts, retry_after_s=3)
    assert answer.status == http
    assert ("Retry-After" in answer.headers) == (code == grpc.StatusCode.RESOURCE_EXHAUSTED)
