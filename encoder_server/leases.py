"""Leased items: embeddings an Encode call asked the server to keep for a later Fetch by content key,
held until fetched once per grant or until their deadline, within a byte budget (oldest evicted first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from encoder_common.env_flags import flag
from encoder_common.errors import InvalidItemError, NotFoundError
from protos import encoder_pb2 as pb

if TYPE_CHECKING:  # the CLI reads this module's defaults before any torch import
    from .payload import ItemPayload

DEFAULT_LEASE_MAX_BYTES = 1 << 30
DEFAULT_LEASE_MAX_TTL_S = 60.0
# Keys recently dropped, remembered so that a late Fetch learns why (evicted or expired) rather
# than only that the key is unknown.
_REMEMBERED_DROPS = 4096


@dataclass(frozen=True, kw_only=True)
class LeaseConfig:
    max_bytes: int = field(
        default=DEFAULT_LEASE_MAX_BYTES, metadata=flag("bytes of items kept for Fetch at most (0: no leases)")
    )
    max_ttl_s: float = field(default=DEFAULT_LEASE_MAX_TTL_S, metadata=flag("longest lease granted, in seconds"))


@dataclass(eq=False)
class _Lease:
    payload: ItemPayload
    expires: float  # monotonic
    grants: int  # Fetches still owed: each grant is released by one completed Fetch


class LeaseStore:
    """The server's leased items by key. Used from the server's event loop only."""

    def __init__(self, config: LeaseConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self._leases: OrderedDict[bytes, _Lease] = OrderedDict()  # oldest grant first
        self._dropped: OrderedDict[bytes, str] = OrderedDict()  # key -> why it is gone
        self.bytes = 0
        self.grants = 0  # leases granted since start
        self.fetches = 0  # Fetches that streamed an item whole
        self.evictions = 0
        self.expirations = 0

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, key: bytes, payload: ItemPayload, ttl_ms: int) -> pb.LeaseGrant:
        """Keeps `payload` under `key` for one more Fetch, for `ttl_ms` at most (capped by the config).

        A key granted again keeps one payload, owes one Fetch more, and keeps the later deadline.
        Raises InvalidItemError when leases are off or the item alone exceeds the budget.
        """
        if self.config.max_bytes <= 0:
            raise InvalidItemError("this server grants no leases (--lease-max-bytes is 0)")
        if payload.nbytes > self.config.max_bytes:
            raise InvalidItemError(
                f"an item of {payload.nbytes} bytes cannot be leased within "
                f"--lease-max-bytes {self.config.max_bytes}"
            )
        if ttl_ms <= 0:
            raise InvalidItemError(f"lease ttl_ms must be positive, got {ttl_ms}")
        ttl_ms = min(ttl_ms, int(self.config.max_ttl_s * 1000))
        now = self.clock()
        self._expire(now)
        lease = self._leases.pop(key, None)
        if lease is None:
            lease = _Lease(payload, now + ttl_ms / 1000, 0)
            self.bytes += payload.nbytes
        lease.grants += 1
        self.grants += 1
        lease.expires = max(lease.expires, now + ttl_ms / 1000)
        self._leases[key] = lease  # newest last
        self._dropped.pop(key, None)
        while self.bytes > self.config.max_bytes:
            old_key = next(iter(self._leases))
            self._drop(old_key, "evicted to make room for newer leases (--lease-max-bytes)")
            self.evictions += 1
        return pb.LeaseGrant(key=key, ttl_ms=ttl_ms)

    def get(self, key: bytes) -> ItemPayload:
        """The leased payload; NotFoundError saying why when there is none."""
        now = self.clock()
        self._expire(now)
        lease = self._leases.get(key)
        if lease is None:
            why = self._dropped.get(key, "never leased on this server, or already fetched")
            raise NotFoundError(f"no leased item with key {key.hex()}: {why}")
        return lease.payload

    def fetched(self, key: bytes) -> None:
        """One Fetch streamed the item whole: its grant is used up; the last one frees the item."""
        self.fetches += 1
        lease = self._leases.get(key)
        if lease is None:
            return
        lease.grants -= 1
        if lease.grants <= 0:
            self._drop(key, "already fetched as many times as it was leased")

    def _expire(self, now: float) -> None:
        for key in [k for k, lease in self._leases.items() if lease.expires <= now]:
            self._drop(key, "its lease expired")
            self.expirations += 1

    def _drop(self, key: bytes, why: str) -> None:
        lease = self._leases.pop(key)
        self.bytes -= lease.payload.nbytes
        self._dropped[key] = why
        while len(self._dropped) > _REMEMBERED_DROPS:
            self._dropped.popitem(last=False)
