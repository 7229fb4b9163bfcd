"""encoder-gateway's connector hand-off without an engine: the metadata-only parts it writes, when a
request goes inline instead, and Qwen3-VL's deepstack levels left on the encoder with the embedding."""

from __future__ import annotations

import pytest
import torch

from encoder_common.families import FAMILIES
from encoder_common.vllm_inputs import engine_embedding
from gateway.app import start
from gateway.config import GatewayConfig
from gateway.handoff import ConnectorHandoff, InlineEmbedsHandoff, leased_part
from gateway.protocol import image_parts, replace_parts
from receiver import EncoderReceiver
from receiver.fleet.fetch import lease_key
from receiver.vllm.fetches import ItemFile
from receiver.vllm.item_files import create_item_file
from testkit.checkpoints import write_checkpoint
from testkit.images import image_bytes
from testkit.servers import running_server
from tests.support.gateway import chat_request, image_part


async def test_leased_parts_name_the_item_and_carry_no_tensor(default_model_dir):
    png = image_bytes(112, 84, seed=3)
    handoff = ConnectorHandoff(lease_ttl_s=30)
    async with running_server(default_model_dir) as server, EncoderReceiver([server.url]) as receiver:
        result = await receiver.encode("r", [{"data": png}], **handoff.encode_options)
        (part,) = await handoff.content_parts("r", result, family=FAMILIES["qwen2_5_vl"], images=[png])
        assert part == {
            "type": "image_embeds",
            "image_embeds": {"image_grid_thw": [1, 6, 8]},
            "uuid": "enc:" + result.items[0].lease.key.hex(),
        }
        assert lease_key(part["uuid"]) == result.items[0].lease.key
        assert len(server.leases) == 1  # the payload waits on the encoder
    with pytest.raises(ValueError, match="without a lease"):
        leased_part(result.items[0].__class__(**{**result.items[0].__dict__, "lease": None}))


def test_a_request_with_its_own_embeddings_goes_inline():
    handoff = ConnectorHandoff(lease_ttl_s=30)
    raw = chat_request("m", [image_part(image_bytes(56, 56))])
    mixed = chat_request("m", [image_part(image_bytes(56, 56)), {"type": "image_embeds", "image_embeds": {}}])
    assert handoff.for_request(raw) is handoff
    assert isinstance(handoff.for_request(mixed), InlineEmbedsHandoff)


def test_the_lease_uuid_replaces_a_client_uuid_and_inline_parts_keep_it():
    body = chat_request("m", [{**image_part(image_bytes(56, 56)), "uuid": "client-id"}])
    (part,) = image_parts(body)
    leased = replace_parts(body, {part: {"type": "image_embeds", "image_embeds": {}, "uuid": "enc:00"}})
    inline = replace_parts(body, {part: {"type": "image_embeds", "image_embeds": {}}})
    assert leased["messages"][0]["content"][0]["uuid"] == "enc:00"
    assert inline["messages"][0]["content"][0]["uuid"] == "client-id"


async def test_deepstack_items_are_named_like_the_others_and_wait_on_the_encoder(tmp_path):
    """Qwen3-VL through the connector hand-off: the gateway starts, the part is the metadata-only grid part,
    and the embedding with its deepstack levels stays leased on the encoder for the connector to fetch."""
    model_dir = write_checkpoint("qwen3_vl", tmp_path / "qwen3")
    png = image_bytes(100, 70, seed=4)
    handoff = ConnectorHandoff(lease_ttl_s=30)
    async with running_server(model_dir) as server, EncoderReceiver([server.url]) as receiver:
        config = GatewayConfig(
            engine_url="http://127.0.0.1:9",
            encoders=(server.url,),
            host="127.0.0.1",
            port=0,
            handoff="connector",
        )
        runner, _ = await start(config)
        await runner.cleanup()
        result = await receiver.encode("r", [{"data": png}], **handoff.encode_options)
        (item,) = result.items
        assert item.deepstack is not None and item.deepstack.is_meta  # levels announced, payload withheld
        (part,) = await handoff.content_parts("r", result, family=FAMILIES["qwen3_vl"], images=[png])
        assert part == {
            "type": "image_embeds",
            "image_embeds": {"image_grid_thw": list(item.grid_thw)},
            "uuid": "enc:" + item.lease.key.hex(),
        }
        path = tmp_path / "item"
        fetched = await receiver.fetch(
            "f", item.lease.key, allocate=lambda shape, dtype: create_item_file(path, shape, dtype)
        )
    # What the connector's worker puts into vLLM's encoder cache is what the inline hand-off sends.
    file = ItemFile(
        "i", str(path), (1 + fetched.deepstack.shape[0], *fetched.embedding.shape), fetched.embedding.dtype
    )
    assert torch.equal(file.entry(), engine_embedding(fetched))
    assert file.entry().shape == (fetched.num_tokens, fetched.hidden_size * 3)  # the checkpoint's two levels
