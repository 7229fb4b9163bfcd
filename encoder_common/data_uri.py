"""Parses `data:` URIs, the one URL form every encoder server accepts for image bytes."""

from __future__ import annotations

import base64
import binascii
import urllib.parse

from encoder_common.errors import InvalidItemError


def decode_data_uri(uri: str) -> bytes:
    """The bytes a `data:[<mediatype>][;base64],<data>` URI carries (RFC 2397)."""
    if not uri.startswith("data:"):
        raise InvalidItemError(f"not a data: URI: {uri[:32]!r}")
    header, sep, body = uri[5:].partition(",")
    if not sep:
        raise InvalidItemError("data: URI has no ',' before its data")
    if header.endswith(";base64"):
        try:
            return base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidItemError(f"data: URI has invalid base64: {exc}") from None
    return urllib.parse.unquote_to_bytes(body)
