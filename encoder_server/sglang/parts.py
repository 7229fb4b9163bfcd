"""An SGLang part (one Encode call's items) joined as SGLang's encoder sends it: the items' embeddings
row-wise in one tensor, and the pickled EmbeddingData that describes it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protos import encoder_pb2 as pb
from protos import sglang_encoder_pb2 as sglang_pb
from protos import wire

from ..payload import ItemPayload
from .embedding_data import EmbeddingDataLayout, PartMeta, embedding_data_pickle


@dataclass(frozen=True)
class Part:
    """One Encode call's result: the pickled metadata frame and the joined tensor bytes."""

    meta: bytes
    tensor: bytes
    tokens: int
    width: int
    headers: list[pb.ItemHeader]


def join_part(request: sglang_pb.EncodeRequest, payloads: Sequence[ItemPayload], layout: EmbeddingDataLayout) -> Part:
    """The part's items' embeddings joined row-wise, in SGLang's layout: deepstack layers (Qwen3-VL)
    side by side with the embedding along the width, as SGLang's encoder concatenates them."""
    headers = [payload.header for payload in payloads]
    dtype = wire.TORCH_DTYPES[headers[0].dtype]
    layers = 1 + headers[0].num_deepstack_layers
    if layers == 1:
        tensor = b"".join(view for payload in payloads for view in payload.payload_views())
    else:
        rows = []
        for payload, header in zip(payloads, headers):
            flat = torch.frombuffer(bytearray(b"".join(payload.payload_views())), dtype=dtype)
            rows.append(flat.view(layers, header.num_tokens, header.hidden_size).permute(1, 0, 2).reshape(header.num_tokens, -1))
        tensor = wire.tensor_bytes(torch.cat(rows)).tobytes()
    tokens = sum(header.num_tokens for header in headers)
    width = headers[0].hidden_size * layers
    meta = embedding_data_pickle(
        PartMeta(
            req_id=request.req_id,
            num_parts=request.num_parts,
            part_idx=request.part_idx,
            grid_thw=[list(header.grid_thw) for header in headers],
            dtype=dtype,
            shape=[tokens, width],
        ),
        layout,
    )
    return Part(meta, tensor, tokens, width, headers)
