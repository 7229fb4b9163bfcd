"""The transport section's baselines that run in processes of their own (started as
`bench.py --role NAME`): the strongest bare grpcio server, SGLang's data plane (pyzmq PUSH of raw
frames) and a Mooncake transfer engine (TCP); and the Mooncake figure measured against the latter."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Sequence

import grpc
import numpy as np

from protos import wire
from testkit.bench_harness import Stopwatch

from .transport_items import item_bytes

CONTROL = re.compile(r"control on \S+:(\d+)")  # the zmq-push role's control socket, in its log


def role_zmq_push(args) -> None:
    """SGLang's data plane: PUSH two frames per item (metadata, raw tensor bytes) when told how many."""
    import zmq

    payloads = {
        size: np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
        for size in args.payload_bytes
    }
    context = zmq.Context()
    push, control = context.socket(zmq.PUSH), context.socket(zmq.REP)
    push_port = push.bind_to_random_port("tcp://127.0.0.1")
    control_port = control.bind_to_random_port("tcp://127.0.0.1")
    print(f"control on 127.0.0.1:{control_port}", flush=True)
    print(f"ready on 127.0.0.1:{push_port}", flush=True)
    while True:
        size, count = (int(x) for x in control.recv().split())
        control.send(b"go")
        meta = json.dumps({"shape": [size], "dtype": "uint8"}).encode()
        for _ in range(count):
            push.send_multipart([meta, payloads[size]], copy=False)


def role_bare_grpc(args) -> None:
    """The strongest plain grpcio server we could write: a generic handler that takes the request's
    bytes unparsed and yields pre-framed chunks (the same ~1 MiB chunk messages as ours) of a payload
    made once, one method per payload size; and `Ack`, which answers a request with two bytes."""
    handlers = {}
    for size in args.payload_bytes:
        data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        chunks = list(wire.chunk_messages(memoryview(data)))

        async def stream(request: bytes, context, chunks=chunks):
            for chunk in chunks:
                yield chunk

        handlers[f"Stream{size}"] = grpc.unary_stream_rpc_method_handler(stream)

    async def ack(request: bytes, context) -> bytes:
        return b"ok"

    # The request carried and a few bytes answered: the least a call controlled over gRPC costs.
    handlers["Ack"] = grpc.unary_unary_rpc_method_handler(ack)

    async def serve() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Bare", handlers)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(f"ready on 127.0.0.1:{port}", flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())


def mooncake_engine():
    """A Mooncake transfer engine on TCP, initialized; raises when it does not start."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake: initialize failed")
    return engine


def registered(engine, nbytes: int, fill) -> np.ndarray:
    """A buffer of `nbytes` made by `fill` and registered with the engine."""
    buffer = fill(nbytes)
    if engine.register_memory(buffer.ctypes.data, buffer.nbytes) != 0:
        raise RuntimeError("mooncake: register_memory failed")
    return buffer


def role_mooncake_target(args) -> None:
    """A Mooncake transfer engine (TCP) with one registered buffer that the bench process writes into."""
    try:
        engine = mooncake_engine()
        buffer = registered(engine, max(args.payload_bytes), lambda n: np.zeros(n, dtype=np.uint8))
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    print(f"buffer {buffer.ctypes.data}", flush=True)
    print(f"ready on 127.0.0.1:{engine.get_rpc_port()}", flush=True)
    threading.Event().wait()  # until the bench terminates it


def mooncake_available() -> str | None:
    """None when the Mooncake transfer engine imports, else why not."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or the OSError of a missing libibverbs
        return f"{exc.__class__.__name__}: {exc}"
    return None


ROLES = {"bare-grpc": role_bare_grpc, "zmq-push": role_zmq_push, "mooncake-target": role_mooncake_target}


async def mooncake_gbps(target, transport_bytes: int, sizes: Sequence[int]) -> dict[int, float]:
    """GB/s of Mooncake's TCP transport writing each size into the target process's registered buffer."""
    remote = int(re.search(r"buffer (\d+)", target.log()).group(1))
    engine = mooncake_engine()
    largest = max(map(item_bytes, sizes))
    source = registered(
        engine, largest, lambda n: np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    )
    session = f"127.0.0.1:{target.port}"
    out = {}
    for size in sizes:
        nbytes = item_bytes(size)
        n = max(4, transport_bytes // nbytes)

        def run(n: int = n, nbytes: int = nbytes) -> float:
            engine.transfer_sync_write(session, source.ctypes.data, remote, nbytes)  # warm-up
            watch = Stopwatch()
            for _ in range(n):
                if engine.transfer_sync_write(session, source.ctypes.data, remote, nbytes) != 0:
                    raise RuntimeError("mooncake: transfer_sync_write failed")
            return watch.seconds()

        out[size] = n * nbytes / await asyncio.to_thread(run) / 1e9
    return out
