"""A TCP relay in front of an encoder that lands a fault at a chosen byte of what the encoder sends.

The receiver sees exactly the bytes before that point, however far ahead the encoder (or the
kernel's socket buffers) had got by then, so a fault test does not race the wall clock. For chaos
runs (scripts/soak.py) it also partitions at once (`hold`, both ways, connections left open),
slows the link (`delay_s` per relayed read) and follows a restarted encoder (`target_port`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

RELAY_BYTES = 64 << 10


class FaultProxy:
    """Relays 127.0.0.1:`port` to the encoder at 127.0.0.1:`target_port`, one upstream connection per
    accepted one. `arm` schedules the fault; until then it only relays."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._client_writers: set[asyncio.StreamWriter] = set()  # toward the receiver
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._cut = False
        self._budget: int | None = None  # encoder bytes still relayed before the fault
        self._fault: Callable[[], None] = lambda: None
        self._hang = True
        self.delay_s = 0.0  # a slow link: this long before each relayed read (of RELAY_BYTES at most)

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self._flowing.set()
        self._abort_all()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def arm(self, after_bytes: int, fault: Callable[[], None], *, hang: bool) -> None:
        """After `after_bytes` more bytes from the encoder, runs `fault`, then either hangs (relays
        nothing either way until `resume`; the held bytes follow then) or cuts every connection,
        dropping what the encoder had sent past that point, as a killed process's peer sees it: the
        receiver reads what came before, then the connection's end."""
        self._budget, self._fault, self._hang = after_bytes, fault, hang

    def resume(self) -> None:
        self._flowing.set()

    def hold(self) -> None:
        """A partition: nothing more is relayed either way, and no connection is closed, until `resume`."""
        self._flowing.clear()

    def cut(self) -> None:
        """Ends every connection now, dropping what is held, as a killed process's peer sees it: the
        receiver reads what was relayed before, then the connection's end. New connections are refused.

        Toward the receiver a FIN (a half-close), never a reset: a reset would make its kernel discard
        what it has not read yet. What the receiver still sends is read and dropped until it closes,
        because closing a socket with unread bytes in it sends a reset too.
        """
        self._cut = True
        self._flowing.set()  # held pumps wake up and drop what they hold
        for writer in list(self._writers):
            if writer in self._client_writers:
                writer.write_eof()
            else:
                writer.transport.abort()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if self._cut:
            client_writer.transport.abort()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:  # the encoder is gone: refuse, as its closed port would
            client_writer.transport.abort()
            return
        self._writers |= {client_writer, upstream_writer}
        self._client_writers.add(client_writer)
        try:
            await asyncio.gather(
                self._pump(client_reader, upstream_writer, from_encoder=False),
                self._pump(upstream_reader, client_writer, from_encoder=True),
            )
        finally:
            for writer in (client_writer, upstream_writer):
                self._writers.discard(writer)
                self._client_writers.discard(writer)
                writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, from_encoder: bool) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(RELAY_BYTES):
                if self._cut:
                    if from_encoder:
                        return
                    continue  # the receiver's bytes after a cut: read and dropped (see `cut`)
                if from_encoder and self._budget is not None:
                    before, data = data[: self._budget], data[self._budget :]
                    self._budget -= len(before)
                    await self._write(writer, before)
                    if self._budget == 0 and data:
                        self._land_fault()
                        if self._cut:
                            return
                await self._flowing.wait()
                if self._cut:  # cut while held: what was held is dropped, never sent late
                    if from_encoder:
                        return
                    continue
                await self._write(writer, data)
        if not self._cut:
            writer.close()  # one side ended: end the other, after what it has been sent

    async def _write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        if data:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            writer.write(data)
            await writer.drain()

    def _land_fault(self) -> None:
        self._budget = None
        self._fault()
        if self._hang:
            self._flowing.clear()
        else:
            self.cut()

    def _abort_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()


@contextlib.asynccontextmanager
async def fault_proxy(target_port: int) -> AsyncIterator[FaultProxy]:
    proxy = FaultProxy(target_port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()
