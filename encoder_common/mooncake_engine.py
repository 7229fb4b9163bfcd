"""The Mooncake transfer engine as both sides run it (the `mooncake` extra,
`mooncake-transfer-engine-non-cuda`): one engine per process side, started on one protocol with the
P2P handshake (no metadata server), its session name, its registered memory, and one payload written
as one batch of pieces. Nothing here imports the engine until one is started."""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from encoder_common.env_flags import flag
from protos.mooncake import PROTOCOLS

# The engine logs through glog to stderr; its INFO lines (one per connection) would drown ours.
_LOG_LEVEL = "ERROR"
# How long a write thread sleeps between looks at its write's progress: a small part of a write's
# milliseconds, and few wake-ups.
_POLL_S = 100e-6
# No write is faster than this (an RDMA NIC's line rate): the first look at a write waits as long as
# its bytes take at this rate.
_FASTEST_BYTES_PER_S = 25e9
# What `transfer_submit_write` returns for a write it could not submit (-1 as a batch id).
_SUBMIT_FAILED = (-1, (1 << 64) - 1)


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """How a transfer engine starts; the server's and the receiver's sections both carry these."""

    protocol: str = field(
        default="tcp",
        metadata=flag(
            "transfer engine protocol: tcp, or rdma where the hosts have RDMA NICs", choices=PROTOCOLS
        ),
    )
    devices: str = field(
        default="",
        metadata=flag(
            "RDMA devices the engine uses, comma-separated (e.g. mlx5_0,mlx5_1); empty: every one it finds"
        ),
    )
    host: str = field(
        default="",
        metadata=flag(
            "the address peers reach this engine at (empty: found from the peer's address or the host name)"
        ),
    )

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")


def unavailable() -> str | None:
    """None when the engine's module imports here, else why not (no package, no libibverbs)."""
    os.environ.setdefault("MC_LOG_LEVEL", _LOG_LEVEL)
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or the OSError of a missing shared library
        return f"{exc.__class__.__name__}: {exc}"
    return None


def address_towards(host: str) -> str:
    """This host's address on the route to `host` (no packet is sent): where that peer reaches us."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])
    if address.is_loopback:
        return str(address)
    with socket.socket(
        socket.AF_INET6 if address.version == 6 else socket.AF_INET, socket.SOCK_DGRAM
    ) as probe:
        probe.connect((str(address), 9))
        return probe.getsockname()[0]


def split_session(session: str) -> tuple[str, int]:
    """("host", port) of a session name "host:port" ("[v6]:port" for IPv6); ValueError otherwise."""
    host, sep, port = session.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not a session name (host:port): {session!r}")
    return host, int(port)


class EngineError(RuntimeError):
    """The transfer engine did not start, or refused to register memory."""


class Engine:
    """One started transfer engine. Blocking calls release the GIL; `write` is called from worker threads."""

    def __init__(self, settings: EngineSettings, host: str):
        reason = unavailable()
        if reason is not None:
            raise EngineError(f"the Mooncake transfer engine does not import: {reason}")
        from mooncake.engine import TransferEngine

        self.protocol = settings.protocol
        self._engine = TransferEngine()
        if self._engine.initialize(host, "P2PHANDSHAKE", settings.protocol, settings.devices) != 0:
            raise EngineError(f"the transfer engine did not start on {host} ({settings.protocol})")
        port = self._engine.get_rpc_port()
        self.session = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def register(self, address: int, nbytes: int) -> None:
        if self._engine.register_memory(address, nbytes) != 0:
            raise EngineError(f"the transfer engine refused to register {nbytes} bytes at {address:#x}")

    def write(
        self, session: str, sources: Sequence[tuple[int, int]], destination: int, timeout_s: float
    ) -> bool:
        """Writes the pieces (address, length) back to back from `destination` in the memory `session`
        registered; True once every byte is there, False when a piece failed or `timeout_s` passed.

        Each piece is submitted at once and its completion polled between short sleeps: the engine's own
        synchronous writes poll without sleeping, a core each while they wait.
        """
        engine, pending, failed, start = self._engine, [], False, destination
        for address, length in sources:
            batch = engine.transfer_submit_write(session, address, destination, length)
            destination += length
            if batch in _SUBMIT_FAILED:
                failed = True
                break
            pending.append(batch)
        deadline = time.monotonic() + timeout_s
        # The first look when the bytes could be there at the fastest, then every _POLL_S.
        wait = max(_POLL_S, (destination - start) / _FASTEST_BYTES_PER_S)
        while pending:
            time.sleep(wait)
            wait = _POLL_S
            # 1: done, 0: under way; -1 failed, -2 timed out. A finished batch is freed by the check.
            states = [engine.transfer_check_status(batch) for batch in pending]
            failed = failed or any(state < 0 for state in states)
            pending = [batch for batch, state in zip(pending, states) if state == 0]
            if pending and time.monotonic() > deadline:
                return False  # its batches stay allocated: the engine may still be writing them
        return not failed

    def close(self, *keep_alive: object) -> None:
        """Stops the engine on a thread of its own (it takes about a second), then lets `keep_alive` go:
        memory that writes in flight may still land in lives until the engine that receives them is gone."""
        if self._engine is not None:
            held = [self._engine, keep_alive]
            self._engine = None
            threading.Thread(target=_stop, args=(held,), name="mooncake-stop", daemon=True).start()


def _stop(held: list) -> None:
    held[0] = None  # the last reference: the engine's destructor joins its threads and closes its sockets
    held.clear()  # then the memory
