"""Cost of the server's per-call accounting (metrics.RequestRecord, fed one item_sent event per item)
next to framing the same payload.

Runs both on one 7 MiB item (Qwen2.5-VL-7B width 3584, 1024 tokens, bf16) in this process and
prints their times and ratio: `python scripts/bench_metrics_overhead.py`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages and tooling

from encoder_server.metrics import ServerMetrics
from protos import encoder_pb2 as pb
from protos import wire
from testkit.bench_harness import Stopwatch, add_record_flag, record_result

ROUNDS = 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_flag(parser)
    args = parser.parse_args()
    embedding = torch.randn(1024, 3584).to(torch.bfloat16)
    payload = wire.tensor_bytes(embedding)
    header = pb.EncodeResponse(
        header=pb.ItemHeader(
            index=0,
            num_tokens=1024,
            hidden_size=3584,
            dtype=pb.BFLOAT16,
            payload_bytes=len(payload),
            timing=pb.Timing(queue_ms=1.0, preprocess_ms=2.0, forward_ms=3.0),
        )
    )
    metrics = ServerMetrics()

    watch = Stopwatch()
    for _ in range(ROUNDS):
        chunks = list(wire.chunk_messages(payload))
    framing_s = watch.seconds() / ROUNDS
    response_bytes = header.ByteSize() + sum(len(chunk) for chunk in chunks)

    watch = Stopwatch()
    for i in range(ROUNDS):
        with metrics.record(f"r{i}", 1) as record:
            sent = time.perf_counter()
            record.item_sent(header.header, response_bytes=response_bytes, stream_s=time.perf_counter() - sent)
    accounting_s = watch.seconds() / ROUNDS

    print(f"payload {len(payload) / 2**20:.1f} MiB in {len(chunks)} chunks")
    print(f"framing (wire.chunk_messages): {framing_s * 1e6:.0f} us per item")
    print(f"accounting (RequestRecord):    {accounting_s * 1e6:.0f} us per call")
    print(f"accounting / framing: {accounting_s / framing_s:.4f}")
    if args.record:
        figures = {"rounds": ROUNDS, "payload_bytes": len(payload), "framing_us": framing_s * 1e6,
                   "accounting_us": accounting_s * 1e6, "ratio": accounting_s / framing_s}  # fmt: skip
        print(f"wrote {record_result('metrics_overhead', figures, args.record)}")


if __name__ == "__main__":
    import logging

    logging.disable(logging.INFO)  # the per-call log line is not what is measured here
    main()
