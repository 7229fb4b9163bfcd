"""Settings of the SGLang contract's servicer, part of the server's ServerConfig."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SglangConfig:
    push_timeout_s: float = 30.0  # one ZMQ push: connecting to the receiver and handing over the bytes
    # zmq_to_scheduler: how long an Encode waits for its SchedulerReceiveUrl registrations, and how
    # long registrations whose Encode never comes are kept.
    receive_url_timeout_s: float = 60.0
    max_pending_registrations: int = 10_000
