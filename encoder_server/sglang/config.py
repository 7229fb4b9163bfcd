"""Settings of SGLang's contract on the server, a section of ServerConfig (flags `--sglang-*`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from encoder_common.env_flags import flag

from .embedding_data import SGLANG_VERSION, EmbeddingDataLayout, layout_for


def sglang_release(text: str) -> str:
    """An SGLang version the EmbeddingData table knows; the flag's error lists the known ones."""
    try:
        layout_for(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


@dataclass(frozen=True, kw_only=True)
class SglangConfig:
    serve: bool = field(
        default=True,
        metadata=flag("do not serve SGLang's encoder contract (sglang.grpc.encoder) on the port", name="--no-sglang-service"),
    )
    # The release of the prefill nodes' SGLang: its receiver unpickles only its own EmbeddingData layout.
    version: str = field(
        default=SGLANG_VERSION,
        metadata=flag(
            "SGLang release of the prefill nodes: the EmbeddingData layout pushed to them", type=sglang_release
        ),
    )
    # A ZMQ push first waits for a connection to the receiver's socket (the receiver binds it
    # before calling Encode, so this is short: a receiver that gave up must not hold a call long),
    # then for its bytes to be handed over.
    connect_timeout_s: float = field(
        default=3.0, metadata=flag("give up a ZMQ push when the SGLang receiver's socket does not connect by then")
    )
    push_timeout_s: float = field(default=30.0, metadata=flag("time limit of one ZMQ push to an SGLang receiver"))
    # zmq_to_scheduler: how long an Encode waits for its SchedulerReceiveUrl registrations, and how
    # long registrations whose Encode never comes are kept.
    receive_url_timeout_s: float = field(
        default=60.0, metadata=flag("zmq_to_scheduler: how long an Encode waits for its ranks' receive URLs")
    )
    max_pending_registrations: int = 10_000

    def __post_init__(self) -> None:
        layout_for(self.version)  # an unknown release fails here, at start-up, naming the known ones

    @property
    def layout(self) -> EmbeddingDataLayout:
        """How this release's receiver names and fills EmbeddingData."""
        return layout_for(self.version)
