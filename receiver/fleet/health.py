"""What the receiver believes about each encoder: healthy, or failed and backing off until a
grpc.health.v1 probe says SERVING again, under a FailoverPolicy (receiver.config)."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence

from ..config import FailoverPolicy
from .channels import EncoderEndpoint

# Doublings counted at most: 2**64 times any first delay outlasts any cap, and an encoder down for hours
# fails thousands of probes in a row (2**1024 no longer converts to a float).
MAX_DOUBLINGS = 64


def backoff_s(first_s: float, attempt: int, rng: random.Random, *, spread: float, cap_s: float = math.inf) -> float:
    """How long to wait before try `attempt` + 1: `first_s` doubled per earlier attempt, capped at `cap_s`,
    times a random factor in [1 - spread, 1 + spread] so that callers who failed together do not retry together."""
    return min(cap_s, first_s * 2 ** min(attempt - 1, MAX_DOUBLINGS)) * rng.uniform(1 - spread, 1 + spread)


class EncoderHealth:
    """One encoder's state. A failure benches it for a jittered, doubling back-off; after that a
    probe, not a request, finds out whether it is back."""

    def __init__(self, endpoint: EncoderEndpoint, policy: FailoverPolicy):
        self.endpoint = endpoint
        self.policy = policy
        self.healthy = True
        self.failures = 0  # consecutive
        self.retry_at = 0.0  # time.monotonic() after which a probe may bring it back
        self.last_error = ""
        self._probe: asyncio.Task | None = None
        self._jitter = random.Random()

    def mark_failed(self, reason: str) -> None:
        self.failures += 1
        self.healthy = False
        self.last_error = reason
        policy = self.policy
        delay = backoff_s(policy.backoff_s, self.failures, self._jitter, spread=0.2, cap_s=policy.max_backoff_s)
        self.retry_at = time.monotonic() + delay

    def mark_healthy(self) -> None:
        self.healthy = True
        self.failures = 0

    def probe(self, timeout: float) -> asyncio.Task:
        """Starts a health probe, or joins the one already running; its result is whether it is healthy now."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._run_probe(timeout))
        return self._probe

    async def _run_probe(self, timeout: float) -> bool:
        if await self.endpoint.is_serving(timeout):
            self.mark_healthy()
        else:
            self.mark_failed("health probe: no SERVING answer")
        return self.healthy


class HealthTracker:
    """What the receiver believes about every encoder it has seen, by URL, shared by all requests."""

    def __init__(self, policy: FailoverPolicy):
        self.policy = policy
        self._health: dict[str, EncoderHealth] = {}

    def of(self, endpoint: EncoderEndpoint) -> EncoderHealth:
        health = self._health.get(endpoint.url)
        if health is None or health.endpoint is not endpoint:  # new, or reconnected after discovery dropped it
            health = self._health[endpoint.url] = EncoderHealth(endpoint, self.policy)
        return health

    def healthy_urls(self, endpoints: Sequence[EncoderEndpoint]) -> list[str]:
        return [e.url for e in endpoints if self.of(e).healthy]

    async def usable(
        self, endpoints: Sequence[EncoderEndpoint], exclude: set[str], deadline: float
    ) -> list[EncoderEndpoint]:
        """The encoders a request may send to now.

        Benched encoders whose back-off is over are probed in the background and rejoin once
        SERVING; the request waits for those probes only when it has no healthy encoder at all,
        and then probes every encoder it has not excluded, back-off or not.
        """
        now = time.monotonic()
        candidates = [self.of(e) for e in endpoints if e.url not in exclude]
        ready = [h for h in candidates if h.healthy]
        benched = [h for h in candidates if not h.healthy]
        timeout = max(0.0, min(self.policy.probe_timeout_s, deadline - now))
        if ready:
            for h in benched:
                if now >= h.retry_at:
                    h.probe(timeout)
            return [h.endpoint for h in ready]
        if not benched or timeout <= 0:
            return []
        # Shielded: a probe is shared with other requests, and this one being cancelled must not cancel it.
        probes = await asyncio.gather(*(asyncio.shield(h.probe(timeout)) for h in benched))
        return [h.endpoint for h, ok in zip(benched, probes) if ok]
