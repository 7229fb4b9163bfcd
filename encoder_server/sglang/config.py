"""Settings of the SGLang contract's servicer, part of the server's ServerConfig."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SglangConfig:
    # A ZMQ push first waits for a connection to the receiver's socket (the receiver binds it
    # before calling Encode, so this is short: a receiver that gave up must not hold a call long),
    # then for its bytes to be handed over.
    connect_timeout_s: float = 3.0
    push_timeout_s: float = 30.0
    # zmq_to_scheduler: how long an Encode waits for its SchedulerReceiveUrl registrations, and how
    # long registrations whose Encode never comes are kept.
    receive_url_timeout_s: float = 60.0
    max_pending_registrations: int = 10_000
