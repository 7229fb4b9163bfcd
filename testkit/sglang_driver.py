"""Drives SGLang's own receiver code against encoder servers: run in .venv-engines (with the checkout
on PYTHONPATH) by tests/engines/test_sglang.py, one process for every scenario of a plan, since importing
SGLang takes seconds to a minute.

`python testkit/sglang_driver.py PLAN.json OUT_DIR` writes OUT_DIR/results.json (per scenario: what
SGLang's code returned, logged and how long it took) and OUT_DIR/tensors.safetensors (per
scenario: the embedding and img_grid_thw SGLang assembled).

Scenario kinds:
- "tokenizer": SGLang's MMReceiverGrpc.recv_mm_data (zmq_to_tokenizer), items as image_data.
- "tokenizer_error": SGLang's `_grpc_encode_request` for one part plus the receiver's own ZMQ
  receive (`_recv_mm_data`), to see the RPC status and the error SGLang's receiver read.
- "scheduler": zmq_to_scheduler's encoder side: SGLang's `_grpc_scheduler_receive_url` registers
  receive_count PULL sockets, SGLang's `_grpc_encode_request` sends the part without a port, and
  each socket's messages go through SGLang's WaitingZmqRequestGrpc.consume_parts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path


class RecordingProcessor:
    """Takes the place of the prompt-expanding multimodal processor: keeps what SGLang's receiver
    assembled (the per-modality embeddings and the grid metadata) and returns it."""

    prefer_tokenized_input = True

    def get_validated_mm_data(self, prompt, embeddings, **kwargs):
        return _Assembled(embeddings, kwargs)


class _Assembled:
    def __init__(self, embeddings, kwargs):
        self.embeddings = embeddings
        self.kwargs = kwargs
        self.input_ids = [0]


class LogLines(logging.Handler):
    """Keeps the messages of the records it handles (the driver's and the test's log checks)."""

    def __init__(self, level: int):
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main(plan_path: str, out_dir: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")  # all traffic on loopback
    import sglang
    import torch
    from safetensors.torch import save_file
    from sglang.srt.disaggregation.encoder import receiver as sglang_receiver
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.multimodal.modality import Modality
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    plan = json.loads(Path(plan_path).read_text())
    for scenario in plan["scenarios"]:
        scenario["items"] = [_VIDEO_ITEMS[item]() if item in _VIDEO_ITEMS else item for item in scenario["items"]]
    urls = sorted({url for scenario in plan["scenarios"] for url in scenario.get("urls", [])})
    args = ServerArgs(
        model_path=plan["model_dir"],
        skip_tokenizer_init=True,
        language_only=True,
        encoder_urls=urls,
        encoder_transfer_backend="zmq_to_tokenizer",
        host="127.0.0.1",
        device="cpu",
    )
    publish(args, role="tokenizer")
    capture = LogLines(logging.WARNING)
    logging.getLogger(sglang_receiver.__name__).addHandler(capture)

    results: dict = {"sglang_version": sglang.__version__, "checks": checks(), "scenarios": {}}
    tensors: dict[str, torch.Tensor] = {}

    def keep(name: str, assembled: _Assembled) -> dict:
        embedding = assembled.embeddings[Modality.IMAGE]
        tensors[f"{name}/embedding"] = embedding.contiguous()
        tensors[f"{name}/img_grid_thw"] = assembled.kwargs["img_grid_thw"].contiguous()
        return {"assembled": True, "dtype": str(embedding.dtype).removeprefix("torch.")}

    async def run_all() -> None:
        for scenario in plan["scenarios"]:
            name, kind = scenario["name"], scenario["kind"]
            capture.lines.clear()
            started = time.monotonic()
            if kind == "tokenizer":
                outcome = await tokenizer_scenario(scenario)
            elif kind == "tokenizer_error":
                outcome = await tokenizer_error_scenario(scenario)
            elif kind == "scheduler":
                outcome = await scheduler_scenario(scenario)
            else:
                raise ValueError(f"unknown scenario kind {kind!r}")
            outcome["seconds"] = time.monotonic() - started
            outcome["log"] = list(capture.lines)
            results["scenarios"][name] = outcome

    async def tokenizer_scenario(scenario: dict) -> dict:
        receiver = sglang_receiver.create_mm_receiver(args, transport_mode="grpc", encode_urls=scenario["urls"])
        request = GenerateReqInput(text="<image>", **{scenario.get("field", "image_data"): scenario["items"]})
        try:
            assembled = await receiver.recv_mm_data(request, RecordingProcessor(), "<image>")
        except Exception as exc:  # SGLang's own refusals before any call (e.g. video_data over gRPC)
            return {"assembled": False, "raised": f"{type(exc).__name__}: {exc}"}
        if assembled is None:
            return {"assembled": False}
        return keep(scenario["name"], assembled)

    async def tokenizer_error_scenario(scenario: dict) -> dict:
        import grpc
        import zmq

        receiver = sglang_receiver.create_mm_receiver(args, transport_mode="grpc", encode_urls=scenario["urls"])
        req_id = f"{scenario['name']}-req"
        port, socket = sglang_receiver.get_zmq_socket_on_host(receiver.context, zmq.PULL, host=receiver.host)
        received = asyncio.create_task(receiver._recv_mm_data(req_id, socket, RecordingProcessor(), "<image>"))
        part = dict(mm_items=scenario["items"], req_id=req_id, num_parts=1, part_idx=0, prefill_host=receiver.host, embedding_port=port)
        if "grpc_timeout_s" in scenario:
            os.environ["SGLANG_ENCODER_GRPC_TIMEOUT_SECS"] = str(scenario["grpc_timeout_s"])
        outcome: dict = {}
        rpc_started = time.monotonic()
        try:
            await asyncio.to_thread(sglang_receiver._grpc_encode_request, sglang_receiver._grpc_target(scenario["urls"][0]), part)
            outcome["status"] = "OK"
        except grpc.RpcError as exc:
            outcome.update(status=exc.code().name, details=exc.details())
        finally:
            os.environ.pop("SGLANG_ENCODER_GRPC_TIMEOUT_SECS", None)
        outcome["rpc_seconds"] = time.monotonic() - rpc_started
        assembled = await asyncio.wait_for(received, scenario.get("receive_timeout_s", 60))
        outcome["assembled"] = assembled is not None
        return outcome

    async def scheduler_scenario(scenario: dict) -> dict:
        import zmq

        context = zmq.Context()
        sockets = [context.socket(zmq.PULL) for _ in range(scenario["receive_count"])]
        ports = [socket.bind_to_random_port("tcp://127.0.0.1") for socket in sockets]
        req_id = f"{scenario['name']}-req"
        target = sglang_receiver._grpc_target(scenario["urls"][0])
        part = dict(mm_items=scenario["items"], req_id=req_id, num_parts=1, part_idx=0, prefill_host="127.0.0.1", embedding_port=None)
        encode = asyncio.create_task(asyncio.to_thread(sglang_receiver._grpc_encode_request, target, part))
        for port in ports:  # each receiving rank registers itself, as WaitingZmqRequestGrpc does
            await sglang_receiver._grpc_scheduler_receive_url(target, req_id, f"127.0.0.1:{port}", len(ports))
        await encode
        outcome: dict = {"ranks": []}
        for rank, socket in enumerate(sockets):
            waiting = sglang_receiver.WaitingZmqRequestGrpc(
                rid=req_id,
                recv_req=_SchedulerRequest(req_id),
                mm_processor=RecordingProcessor(),
                encoder_urls=scenario["urls"],
                model_type="qwen2_5_vl",
                host_name="127.0.0.1",
                receive_count=len(sockets),
                zmq_context=context,
                embedding_port=ports[rank],
            )
            if socket.poll(30_000):
                waiting.consume_parts(socket.recv_multipart(copy=False))
            outcome["ranks"].append({"status": waiting.status.name, "error_msg": waiting.error_msg})
            if waiting.status.name == "SUCCESS":
                keep(f"{scenario['name']}/rank{rank}", waiting.recv_req.mm_inputs)
            socket.close(linger=0)
        context.term()
        return outcome

    asyncio.run(run_all())
    out = Path(out_dir)
    save_file(tensors, str(out / "tensors.safetensors"))
    (out / "results.json").write_text(json.dumps(results, indent=1))


def mp4_bytes() -> bytes:
    """A real MP4 file (three 32x32 frames, MPEG-4 part 2), written by OpenCV."""
    import tempfile

    import cv2
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "clip.mp4")
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 5, (32, 32))
        for shade in (0, 100, 200):
            writer.write(np.full((32, 32, 3), shade, np.uint8))
        writer.release()
        return Path(path).read_bytes()


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


# Placeholders a plan may use for a video item, made here because .venv has no video writer.
_VIDEO_ITEMS = {
    "$MP4_DATA_URI": lambda: "data:video/mp4;base64," + _b64(mp4_bytes()),
    "$MP4_BASE64": lambda: _b64(mp4_bytes()),
}


class _SchedulerRequest:
    """The fields of TokenizedGenerateReqInput that SGLang's waiting request reads."""

    def __init__(self, rid: str):
        self.rid = rid
        self.input_ids = [0]
        self.input_text = "<image>"
        self.num_items_assigned = {"IMAGE": [1]}
        self.mm_inputs = None


def checks() -> dict:
    """Drift checks on the installed SGLang: our pickle against SGLang's own EmbeddingData, the
    published proto's descriptor, and the zmq_to_scheduler dispatch of its gRPC receiver."""
    import base64
    import inspect
    import pickle

    import torch
    from sglang.srt.disaggregation.encoder import receiver as sglang_receiver
    from sglang.srt.multimodal.modality import Modality
    from sglang.srt.utils.common import safe_pickle_loads
    from smg_grpc_proto import sglang_encoder_pb2

    from encoder_server.sglang.embedding_data import SGLANG_VERSION, PartMeta, embedding_data_pickle

    def as_comparable(obj) -> dict:
        state = dict(vars(obj))
        if state.get("grid_dim") is not None:
            state["grid_dim"] = torch.as_tensor(state["grid_dim"]).tolist()
        return {key: repr(value) for key, value in state.items()}

    compared = {}
    embedding = torch.zeros(10, 8, dtype=torch.bfloat16)
    grid = torch.tensor([[1, 4, 6], [1, 2, 2]])
    # What SGLang's encoder builds for a Qwen-VL part (_stage_embeddings with the aux data of
    # _build_mm_aux_data), then sends as copy_without_embedding().
    theirs_ok = sglang_receiver.EmbeddingData(
        "r-1", 3, 2, grid, Modality.IMAGE, embedding, video_timestamps=None, second_per_grid_ts=None
    ).copy_without_embedding()
    ours_ok = embedding_data_pickle(
        PartMeta(req_id="r-1", num_parts=3, part_idx=2, grid_thw=grid.tolist(), dtype=torch.bfloat16, shape=[10, 8])
    )
    # _stage_errors' shape.
    theirs_error = sglang_receiver.EmbeddingData(
        "r-2", 1, 0, None, Modality.IMAGE, error_msg="bad image", error_code=400
    ).copy_without_embedding()
    ours_error = embedding_data_pickle(PartMeta(req_id="r-2", num_parts=1, part_idx=0, error_msg="bad image", error_code=400))
    for name, theirs, ours in (("ok", theirs_ok, ours_ok), ("error", theirs_error, ours_error)):
        rebuilt = safe_pickle_loads(ours)
        reference = safe_pickle_loads(pickle.dumps(theirs))
        compared[name] = {
            "class": f"{type(rebuilt).__module__}.{type(rebuilt).__qualname__}",
            "is_sglang_class": type(rebuilt) is sglang_receiver.EmbeddingData,
            "ours": as_comparable(rebuilt),
            "theirs": as_comparable(reference),
        }
    grpc_encode_parameters = list(inspect.signature(sglang_receiver.MMReceiverGrpc.encode).parameters)
    return {
        "pinned_version": SGLANG_VERSION,
        "pickles": compared,
        "smg_descriptor": base64.b64encode(sglang_encoder_pb2.DESCRIPTOR.serialized_pb).decode(),
        # _run_encode_in_thread (the zmq_to_scheduler dispatch) passes time_stats_json to encode().
        "grpc_encode_takes_time_stats_json": "time_stats_json" in grpc_encode_parameters,
    }


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
