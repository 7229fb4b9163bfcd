"""The receiver's transport registry (receiver.transports): `transfer` takes "auto" and its names, each
name opens its transport, and a transport's offer goes into the call's own request, read back by the
reader it returns for that call."""

from __future__ import annotations

import dataclasses
import os

import pytest

from encoder_common.env_flags import METADATA_KEY
from encoder_common.errors import SharedMemoryUnavailableError
from protos import encoder_pb2 as pb
from receiver.config import ReceiverConfig
from receiver.transports import TRANSFERS, TRANSPORTS, open_transport

LOCAL = "grpc://127.0.0.1:50051"


def test_transfer_takes_auto_and_the_registry_names_and_each_opens(tmp_path, monkeypatch):
    monkeypatch.setenv("ENCODER_SHM_DIR", str(tmp_path))  # "shm" makes its probe at once
    assert TRANSFERS == ("auto", *TRANSPORTS)
    (transfer,) = [field for field in dataclasses.fields(ReceiverConfig) if field.name == "transfer"]
    assert tuple(transfer.metadata[METADATA_KEY].choices) == TRANSFERS
    for name in TRANSFERS:
        transport = open_transport(name, ReceiverConfig())
        assert transport.stats.items_shm == 0 and not transport.stats.fallbacks
        transport.close()
    for name in set(TRANSPORTS) - {"grpc"}:  # the stream is offered by no field: it is always there
        assert name in pb.EncodeRequest.DESCRIPTOR.fields_by_name and name in pb.FetchRequest.DESCRIPTOR.fields_by_name


def test_the_stream_offers_nothing_and_reads_nothing():
    request = pb.EncodeRequest(request_id="r")
    assert open_transport("grpc", ReceiverConfig()).open_call(request, LOCAL, 1) is None
    assert request == pb.EncodeRequest(request_id="r")


def test_shared_memory_offers_its_probe_in_the_request_and_reads_that_calls_headers(tmp_path, monkeypatch):
    monkeypatch.setenv("ENCODER_SHM_DIR", str(tmp_path))
    transport = open_transport("shm", ReceiverConfig())  # strict: the probe is made now
    try:
        request = pb.FetchRequest(request_id="r", keys=[bytes(32)])
        read = transport.open_call(request, LOCAL, 1)
        assert request.shm.probe == transport.probe and os.listdir(tmp_path) == [transport.probe]
        with pytest.raises(SharedMemoryUnavailableError, match="predates"):
            read(pb.ItemHeader(index=0, payload_bytes=4))  # no `shm` in the header: an older server
    finally:
        transport.close()
    assert os.listdir(tmp_path) == []
