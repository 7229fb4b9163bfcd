"""Reads `file://` URLs confined to allowed directories, size-capped: encoder_common.sources' file reading.
Errors name the URL as the caller gave it, never the resolved path, which would reveal the file system."""

from __future__ import annotations

import os
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from encoder_common.errors import InvalidItemError


def read_file_url(url: str, roots: Sequence[Path], *, max_bytes: int) -> bytes:
    """The bytes of the file a `file://` URL names.

    `roots` are resolved directories the file must lie in after symlinks and `..` are resolved.
    `max_bytes` bounds the read, so a device file or a huge file cannot exhaust memory.
    """
    shown = url if len(url) <= 200 else url[:200] + "..."
    try:
        parsed = urllib.parse.urlparse(url)
    except ValueError as exc:  # e.g. an unbalanced [ in the host
        raise InvalidItemError(f"not a valid file:// URL: {shown!r}: {exc}") from None
    if parsed.scheme != "file":
        raise InvalidItemError(f"not a file:// URL: {shown!r}")
    if parsed.netloc not in ("", "localhost"):
        raise InvalidItemError(f"file:// URL names a remote host {parsed.netloc!r}")
    try:
        path = Path(urllib.request.url2pathname(parsed.path)).resolve()
    except (ValueError, RuntimeError, OSError) as exc:  # a NUL byte in the path, a symlink loop
        raise InvalidItemError(f"{shown} names no usable path: {exc}") from None
    if not any(path.is_relative_to(root) for root in roots):
        raise InvalidItemError(f"{shown} is outside the allowed directories")
    try:
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else exc.__class__.__name__
        raise InvalidItemError(f"cannot read {shown}: {reason}") from None
    if len(data) > max_bytes:
        raise InvalidItemError(f"{shown} is over the limit of {max_bytes} bytes")
    return data
