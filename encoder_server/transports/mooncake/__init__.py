"""The Mooncake transfer engine, the across-hosts transport (`--mooncake-transfer`), server side: each payload
written straight into a slot the receiver granted, then its header naming the slot with a MAC keyed by the
call's token; what cannot be written that way follows as chunks, with the reason in the header."""

from .writer import MooncakeConfig, MooncakeWriter

__all__ = ["MooncakeConfig", "MooncakeWriter"]
