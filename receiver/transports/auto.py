"""transfer="auto": per encoder, shared memory where the encoder could share this host, the transfer
engine where it cannot and the engine runs here, else the stream alone. An encoder that shows it is on
another host after all (it cannot read the shared-memory probe) is offered the engine from then on; one
on this host that runs without shared memory is offered nothing for a while, as one that declines the
engine is: a declined offer costs a call once, not every call."""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

from protos import encoder_pb2 as pb

from . import TransferStats
from .mooncake import DECLINED_S, MooncakeReceiver
from .shm import ShmReceiver, could_share_host

if TYPE_CHECKING:
    from ..config import ReceiverConfig
    from . import PayloadReader


class AutoTransport:
    """Shared memory and the transfer engine, neither strict, counting into one TransferStats."""

    def __init__(self, config: ReceiverConfig):
        self.stats = TransferStats()
        self.shm = ShmReceiver(strict=False)
        self.mooncake = MooncakeReceiver(strict=False, config=config)
        self.shm.stats = self.mooncake.stats = self.stats
        self._other_hosts: set[str] = set()  # encoders that could not read the probe
        self._shm_declined: dict[str, float] = {}  # encoder on this host without shared memory -> until when

    def open_call(
        self, request: pb.EncodeRequest | pb.FetchRequest, url: str, items: int
    ) -> PayloadReader | None:
        if url not in self._other_hosts and could_share_host(url):
            if time.monotonic() < self._shm_declined.get(url, 0.0):
                return None
            reader = self.shm.open_call(request, url, items)
            return functools.partial(self._read_shm, url, reader) if reader is not None else None
        return self.mooncake.open_call(request, url, items)

    def _read_shm(self, url: str, reader: PayloadReader, header: pb.ItemHeader):
        fallback = header.shm.fallback if header.HasField("shm") else None
        if fallback == pb.SHM_PROBE_UNREADABLE:
            self._other_hosts.add(url)
        elif fallback == pb.SHM_DISABLED:
            self._shm_declined[url] = time.monotonic() + DECLINED_S
        return reader(header)

    def end_call(self, reader: PayloadReader, complete: bool) -> None:
        self.mooncake.end_call(reader, complete)

    def close(self) -> None:
        self.shm.close()
        self.mooncake.close()
