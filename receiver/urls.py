"""Encoder URLs (`grpc://host:port`, `grpcs://host:port`) and the target string grpc dials for one."""

from __future__ import annotations

_SCHEMES = ("grpc://", "grpcs://")

def grpc_target(url: str) -> str:
    """`grpc://host:port`, `grpcs://host:port` (or a bare `host:port`) to the target string grpc dials."""
    for scheme in _SCHEMES:
        if url.startswith(scheme):
            return url[len(scheme) :]
    if "://" in url:
        raise ValueError(f"unsupported encoder URL {url!r}: use grpc://host:port or grpcs://host:port")
    return url
