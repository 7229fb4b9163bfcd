"""The server's transport registry (encoder_server.transports): each transport is turned on by the
ServerConfig section of its name and offered in the request field of that name; a call that offers
none of them gets the stream, and one that offers a transport the server runs without still gets
that transport's call, which tells the receiver so in each header."""

from __future__ import annotations

import dataclasses

import pytest

from encoder_server.config import ServerConfig
from encoder_server.transports import TRANSPORTS, ServerTransports
from encoder_server.transports.shm import ShmConfig
from encoder_server.transports.stream import STREAM
from protos import encoder_pb2 as pb

PEER = "ipv4:127.0.0.1:40000"


def test_each_transport_is_a_config_section_off_by_default_and_a_field_of_both_requests():
    sections = {field.name: field for field in dataclasses.fields(ServerConfig)}
    for name in TRANSPORTS:
        assert name in sections and sections[name].default is None, name
        assert name in pb.EncodeRequest.DESCRIPTOR.fields_by_name, name
        assert name in pb.FetchRequest.DESCRIPTOR.fields_by_name, name


@pytest.mark.parametrize("shm", [None, ShmConfig()])
async def test_a_call_gets_the_transport_its_request_offers_else_the_stream(shm):
    transports = ServerTransports(ServerConfig(model="unused", shm=shm))
    assert [type(t) for t in transports] == ([] if shm is None else [TRANSPORTS["shm"]])
    assert transports.open_call(pb.EncodeRequest(request_id="r"), PEER) is STREAM
    assert transports.open_call(pb.FetchRequest(request_id="r"), PEER) is STREAM
    offered = transports.open_call(pb.EncodeRequest(request_id="r", shm=pb.ShmOffer(probe="p")), PEER)
    assert offered is not STREAM
    header = pb.ItemHeader(index=0, payload_bytes=1 << 20)
    assert await offered.place(header, payload=None) is False  # a probe it cannot read, or no shm: not placed
    expected = pb.SHM_DISABLED if shm is None else pb.SHM_PROBE_UNREADABLE
    assert header.shm.fallback == expected
