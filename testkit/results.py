"""Comparing receivers' results in tests: the same items, byte for byte, whatever carried them."""

from __future__ import annotations

import torch


def assert_same_bytes(got, want) -> None:
    """Two EncodeResults hold the same items, each embedding (and deepstack) equal byte for byte."""
    assert [i.index for i in got.items] == [i.index for i in want.items]
    for a, b in zip(got.items, want.items):
        assert a.embedding.dtype == b.embedding.dtype and a.embedding.shape == b.embedding.shape
        assert torch.equal(a.embedding.view(torch.uint8), b.embedding.view(torch.uint8))
        assert (a.deepstack is None) == (b.deepstack is None)
        if a.deepstack is not None:
            assert torch.equal(a.deepstack.view(torch.uint8), b.deepstack.view(torch.uint8))
