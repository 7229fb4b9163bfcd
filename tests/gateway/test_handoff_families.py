"""What encoder-gateway hands vLLM, per family, derived from encoder_common/families.py: which hand-off
refuses which family at start-up, the inline part's form, and the connector part (metadata only where vLLM
sizes the placeholders from it, else the raw image beside the lease uuid)."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from encoder_common.families import FAMILIES
from gateway.handoff import HANDOFFS, ConnectorHandoff, InlineEmbedsHandoff, check_family
from protos import encoder_pb2 as pb
from receiver import EncoderReceiver
from receiver.embeddings.result import EncodeResult, ItemResult
from receiver.fleet.fetch import item_uuid, lease_key
from testkit.checkpoints import write_checkpoint
from testkit.images import image_bytes
from testkit.servers import running_server

# The families inline cannot carry: vLLM refuses their image_embeds, or batches them at one token count only.
REFUSED_INLINE = {"llava_next", "llava_onevision", "internvl", "gemma3", "mistral3", "glm4v", "idefics3"}


@pytest.mark.parametrize("handoff", HANDOFFS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_start_up_check_follows_the_registry(family, handoff):
    """Inline needs an image_embeds form vLLM takes at any token count (the gateway builds each); the
    connector carries every family, Qwen3-VL's deepstack levels included."""
    if handoff == "inline" and family in REFUSED_INLINE:
        with pytest.raises(ValueError, match=f"family '{family}'.*connector"):
            check_family(family, handoff)
    else:
        check_family(family, handoff)


def test_an_unknown_family_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="'fuyu', which is none of .*'gemma3'"):
        check_family("fuyu", "inline")


async def test_parts_for_families_vllm_sizes_from_the_image(tmp_path):
    """LLaVA-OneVision: inline, the plain tensor; through the connector, the very bytes encoded as a data
    URL beside the lease uuid (vLLM's processor sizes the placeholders, the connector fetches the rows)."""
    model_dir = write_checkpoint("llava_onevision", tmp_path / "onevision")
    family = FAMILIES["llava_onevision"]
    png = image_bytes(200, 150, seed=2)
    async with running_server(model_dir) as server, EncoderReceiver([server.url]) as receiver:
        inline = InlineEmbedsHandoff()
        result = await receiver.encode("inline", [{"data": png}], **inline.encode_options)
        (part,) = await inline.content_parts("inline", result, family=family, images=[png])
        assert part["type"] == "image_embeds" and isinstance(part["image_embeds"], str)
        loaded = torch.load(io.BytesIO(base64.b64decode(part["image_embeds"])), weights_only=True)
        assert torch.equal(loaded, result.items[0].embedding)

        connector = ConnectorHandoff(lease_ttl_s=30)
        leased = await receiver.encode("leased", [{"data": png}], **connector.encode_options)
        (part,) = await connector.content_parts("leased", leased, family=family, images=[png])
    assert part["type"] == "image_url" and lease_key(part["uuid"]) == leased.items[0].lease.key
    prefix, data = part["image_url"]["url"].split(",", 1)
    assert prefix.endswith(";base64") and base64.b64decode(data) == png


async def test_parts_for_a_family_vllm_takes_with_its_image_size():
    """MiniCPM-V 4.6: the encoder reports an item's image as loaded in `image_size`; inline, the rows with
    `image_sizes` [width, height]; through the connector, the image beside the lease uuid (vLLM 0.32's 4.6
    processor drops a metadata-only part)."""
    family = FAMILIES["minicpmv4_6"]
    rows = torch.randn(28, 8)
    item = ItemResult(index=0, embedding=rows, grid_thw=(1, 1, 28), encoder_url="x", image_size=(333, 250))
    (part,) = await InlineEmbedsHandoff().content_parts(
        "inline", EncodeResult("inline", [item]), family=family, images=[b"png"]
    )
    embeds = part["image_embeds"]
    assert part["type"] == "image_embeds" and embeds["image_sizes"] == [333, 250]
    loaded = torch.load(io.BytesIO(base64.b64decode(embeds["image_embeds"])), weights_only=True)
    assert torch.equal(loaded, rows)

    item.lease = pb.LeaseGrant(key=bytes(32))
    (part,) = await ConnectorHandoff(lease_ttl_s=30).content_parts(
        "leased", EncodeResult("leased", [item]), family=family, images=[b"png"]
    )
    assert part["type"] == "image_url" and part["uuid"] == item_uuid(bytes(32))
    assert base64.b64decode(part["image_url"]["url"].split(",", 1)[1]) == b"png"

    sizeless = ItemResult(index=3, embedding=rows, grid_thw=(1, 1, 28), encoder_url="x")  # from an older server
    with pytest.raises(ValueError, match="item 3 has no image size"):
        await InlineEmbedsHandoff().content_parts("old", EncodeResult("old", [sizeless]), family=family, images=[b""])
