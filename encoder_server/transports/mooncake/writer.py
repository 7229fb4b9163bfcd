"""The server's transfer engine and its write threads: its settings, which offers it takes, and the
writing of one payload into a receiver's slot, straight from the payload's memory (TCP reads any of
this process's memory) or through a registered staging buffer (RDMA NICs read registered memory only)."""

from __future__ import annotations

import asyncio
import logging
import mmap
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from encoder_common.copies import copy_parts
from encoder_common.env_flags import flag
from encoder_common.mooncake_engine import Engine, EngineSettings, split_session
from encoder_common.warn_once import WarnOnce
from protos import encoder_pb2 as pb
from protos.mooncake import TOKEN_BYTES

from .call import MooncakeCall
from .metrics import MooncakeCollector

log = logging.getLogger(__name__)

# Slots one offer may grant; more is a malformed offer (a call carries 64 items by default).
MAX_SLOTS = 1024


@dataclass(frozen=True, kw_only=True)
class MooncakeConfig(EngineSettings):
    # Smaller payloads go as chunks: a write's round trip costs more than one message.
    min_bytes: int = 64 << 10
    write_threads: int = field(
        default=4, metadata=flag("payloads written at once, each waited for on a thread of its own")
    )
    # A write not done by then fails (its item goes as chunks); receivers keep such a slot out of use
    # for longer than this (their late_write_s).
    write_timeout_s: float = 10.0
    staging: bool = field(
        default=False,
        metadata=flag(
            "copy each payload into registered memory before writing it (always on with rdma, whose NICs "
            "read registered memory only)"
        ),
    )
    any_session_host: bool = field(
        default=False,
        metadata=flag(
            "take offers naming an engine on another host than the caller's address (a proxy or NAT "
            "between them); by default a caller can direct writes to its own host only"
        ),
    )


@dataclass
class MooncakeStats:
    """What the engine wrote since the server started."""

    items: int = 0
    bytes: int = 0
    write_seconds: float = 0.0
    fallbacks: Counter[str] = field(default_factory=Counter)  # reason -> items sent as chunks instead


class _Staging(threading.local):
    """A write thread's registered buffer, grown to the largest payload it has staged."""

    buffer: np.ndarray | None = None
    address: int = 0


class MooncakeWriter:
    """The engine, its write threads and its counts: the transfer engine's entry in the transport
    registry (encoder_server/transports)."""

    def __init__(self, config: MooncakeConfig):
        self.config = config
        self.stats = MooncakeStats()
        self.engine: Engine | None = None
        self._threads: ThreadPoolExecutor | None = None
        self._staging = _Staging() if config.staging or config.protocol == "rdma" else None
        self._staged: list[tuple[int, mmap.mmap]] = []  # every staging buffer registered, until stop
        self.warn_once = WarnOnce(log)

    @staticmethod
    def open_call(
        writer: MooncakeWriter | None, request: pb.EncodeRequest | pb.FetchRequest, peer: str
    ) -> MooncakeCall | None:
        """The call's use of the engine when its receiver offered it (`writer` None: this server runs
        without --mooncake-transfer, which the item headers then say); None when it did not."""
        if not request.HasField("mooncake"):
            return None
        refused = writer.refuses(request.mooncake, peer) if writer is not None else None
        if refused is not None:
            writer.warn_once(refused, "transfer-engine offer refused (%s); its items go as chunks", refused)
        return MooncakeCall(writer, request, refused)

    def collector(self) -> MooncakeCollector:
        return MooncakeCollector(self)

    async def start(self) -> None:
        host = self.config.host or _host_address()
        self.engine = await asyncio.to_thread(Engine, self.config, host)
        self._threads = ThreadPoolExecutor(self.config.write_threads, thread_name_prefix="mooncake-write")
        log.info(
            "transfer engine on: %s, %s%s, %d write threads",
            self.engine.session,
            self.config.protocol,
            f" ({self.config.devices})" if self.config.devices else "",
            self.config.write_threads,
        )

    async def stop(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        if self.engine is not None:
            self.engine.close(self._staged)  # staging buffers outlive writes still in the engine
        self._staged = []

    def refuses(self, offer: pb.MooncakeOffer, peer: str) -> str | None:
        """Why this server takes no part of `offer`, or None when it writes into its slots."""
        if offer.protocol != self.config.protocol:
            return f"the offer's protocol is {offer.protocol!r}, this server's engine runs {self.config.protocol!r}"
        if len(offer.token) != TOKEN_BYTES or not 0 < len(offer.slots) <= MAX_SLOTS:
            return "the offer's token or slots are malformed"
        try:
            host, _ = split_session(offer.session)
        except ValueError as exc:
            return str(exc)
        if not self.config.any_session_host and host != peer_host(peer):
            return f"the offer's engine {offer.session} is not on the caller's host {peer_host(peer)}"
        return None

    def fallback(self, header: pb.ItemHeader, reason: pb.MooncakeFallback) -> None:
        header.mooncake.fallback = reason
        self.stats.fallbacks[pb.MooncakeFallback.Name(reason).removeprefix("MOONCAKE_").lower()] += 1

    async def write(self, session: str, parts: Sequence[memoryview], destination: int) -> bool:
        """Writes the payload's parts back to back at `destination` on a write thread; True once it is
        all there. Cancelling the caller leaves the write to finish on its thread (it holds the parts)."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        done = await loop.run_in_executor(self._threads, self._write, session, parts, destination)
        if done:
            self.stats.items += 1
            self.stats.bytes += sum(len(part) for part in parts)
            self.stats.write_seconds += time.perf_counter() - started
        return done

    def _write(self, session: str, parts: Sequence[memoryview], destination: int) -> bool:
        arrays = [np.frombuffer(part, dtype=np.uint8) for part in parts]
        if self._staging is None:
            sources = [(array.ctypes.data, len(array)) for array in arrays]
        else:
            nbytes = sum(len(array) for array in arrays)
            copy_parts(self._staging_buffer(nbytes)[:nbytes], arrays)
            sources = [(self._staging.address, nbytes)]
        return self.engine.write(session, sources, destination, self.config.write_timeout_s)

    def _staging_buffer(self, nbytes: int) -> np.ndarray:
        """This thread's staging buffer, grown and registered (once per growth) when `nbytes` does not fit.
        An outgrown buffer stays registered until stop: the engine refuses overlapping registrations,
        and memory is not handed back to it while it may know the address."""
        staging = self._staging
        if staging.buffer is None or len(staging.buffer) < nbytes:
            size = max(nbytes, 2 * len(staging.buffer) if staging.buffer is not None else 0)
            size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
            memory = mmap.mmap(-1, size)
            buffer = np.frombuffer(memory, dtype=np.uint8)
            address = buffer.ctypes.data
            self.engine.register(address, size)
            self._staged.append((address, memory))
            staging.buffer, staging.address = buffer, address
        return staging.buffer


def peer_host(peer: str) -> str:
    """The address of a gRPC peer ("ipv4:10.0.0.5:41234", "ipv6:[::1]:41234"); "" for other kinds."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    return rest.rpartition(":")[0].strip("[]")


def _host_address() -> str:
    """The address this host's name resolves to (a pod's IP), else loopback."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
