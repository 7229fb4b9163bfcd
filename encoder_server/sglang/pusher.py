"""Pushes frames to SGLang receivers' ZMQ PULL sockets, as SGLang's own encoder does: one PUSH socket
per push, nothing queued for a receiver that is not listening, bounded in time."""

from __future__ import annotations

import asyncio
import ipaddress

import zmq

from encoder_common.errors import EncoderError, InvalidItemError


class DeliveryError(EncoderError):
    """A part's embedding could not be pushed to its SGLang receiver."""


class ZmqPusher:
    def __init__(self, connect_timeout_s: float, push_timeout_s: float):
        self.connect_timeout_s = connect_timeout_s
        self.push_timeout_s = push_timeout_s
        self._zmq = zmq.Context()

    def close(self) -> None:
        """Ends the ZMQ context once the pushes still running have finished (blocks: call it off the loop)."""
        self._zmq.term()

    async def push(self, endpoint: str, frames: list[bytes], timeout_s: float | None = None) -> None:
        """Hands `frames` to the connection to `endpoint` within `timeout_s` (default: the push timeout),
        on a worker thread; DeliveryError naming the endpoint otherwise."""
        loop = asyncio.get_running_loop()
        timeout_s = self.push_timeout_s if timeout_s is None else timeout_s
        await loop.run_in_executor(None, self._push_blocking, endpoint, frames, timeout_s)

    def _push_blocking(self, endpoint: str, frames: list[bytes], timeout_s: float) -> None:
        sock = self._zmq.socket(zmq.PUSH)
        # IMMEDIATE: nothing is queued for a receiver that is not there; the send times out instead.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        connect_timeout_s = min(timeout_s, self.connect_timeout_s)
        sock.setsockopt(zmq.SNDTIMEO, int(connect_timeout_s * 1000))
        sock.setsockopt(zmq.LINGER, int(timeout_s * 1000))
        try:
            sock.connect(endpoint)
            tracker = sock.send_multipart(frames, copy=False, track=True)
            tracker.wait(timeout_s)  # the bytes are handed to the connection
        except zmq.Again:
            raise DeliveryError(
                f"no SGLang receiver listening at {endpoint} (no connection within {connect_timeout_s:g} s)"
            ) from None
        except zmq.NotDone:
            raise DeliveryError(f"pushing the embedding to {endpoint} took over {timeout_s:g} s") from None
        except zmq.ZMQError as exc:
            raise DeliveryError(f"pushing the embedding to {endpoint} failed: {exc}") from None
        finally:
            sock.close()


def endpoint(host: str, port: int) -> str:
    """The tcp:// endpoint of a receiver's PULL socket; IPv6 addresses in brackets."""
    host = host.strip().removeprefix("[").removesuffix("]")
    if not host or any(c in host for c in "/@ ") or not 0 < port < 65536:
        raise InvalidItemError(f"receiver address {host!r}:{port} is not a host and port")
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"tcp://[{host}]:{port}"
    except ValueError:
        pass  # a name
    return f"tcp://{host}:{port}"


def endpoint_of_url(url: str) -> str:
    """A receive URL (`host:port`, `[v6]:port`, optionally `tcp://`) as a tcp:// endpoint."""
    host, sep, port = url.removeprefix("tcp://").rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidItemError(f"receive URL {url!r} is not host:port")
    return endpoint(host, int(port))
