"""zmq_to_scheduler's registry: where each SGLang request's embedding goes, as its receiving ranks
register their URLs (SchedulerReceiveUrl calls), before or after the request's Encode."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from encoder_common.errors import DeadlineExceededError, InvalidItemError, OverloadedError


@dataclass
class _Registration:
    receive_count: int
    urls: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class ReceiveUrls:
    """The receive URLs registered per request id (one per receiving rank, receive_count in all)."""

    def __init__(self, keep_s: float, max_pending: int):
        self.keep_s = keep_s
        self.max_pending = max_pending
        self._registrations: dict[str, _Registration] = {}

    def register(self, req_id: str, url: str, receive_count: int) -> None:
        self._expire()
        registration = self._registrations.get(req_id)
        if registration is None:
            if len(self._registrations) >= self.max_pending:
                raise OverloadedError(f"{len(self._registrations)} registrations are waiting for their Encode")
            registration = self._registrations[req_id] = _Registration(receive_count)
        if not registration.receive_count:  # its Encode came first and is waiting
            registration.receive_count = receive_count
        if registration.receive_count != receive_count:
            raise InvalidItemError(
                f"receive_count {receive_count} differs from the {registration.receive_count} registered for {req_id!r}"
            )
        if url not in registration.urls:
            if len(registration.urls) == receive_count:
                raise InvalidItemError(f"{req_id!r} already has its {receive_count} receive URLs")
            registration.urls.append(url)
            registration.changed.set()

    async def wait(self, req_id: str, timeout_s: float) -> list[str]:
        """The request's receive URLs once all have registered; DeadlineExceededError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            registration = self._registrations.setdefault(req_id, _Registration(receive_count=0))
            if registration.receive_count and len(registration.urls) == registration.receive_count:
                return list(registration.urls)
            registration.changed.clear()
            try:
                await asyncio.wait_for(registration.changed.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise DeadlineExceededError(
                    f"{len(registration.urls)} of {registration.receive_count or '?'} receive URLs registered for "
                    f"{req_id!r} within {timeout_s:g} s (zmq_to_scheduler: SchedulerReceiveUrl calls)"
                ) from None

    def registered(self, req_id: str) -> list[str]:
        registration = self._registrations.get(req_id)
        return [] if registration is None else list(registration.urls)

    def forget(self, req_id: str) -> None:
        self._registrations.pop(req_id, None)

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.keep_s
        for req_id in [r for r, reg in self._registrations.items() if reg.created < cutoff]:
            del self._registrations[req_id]
