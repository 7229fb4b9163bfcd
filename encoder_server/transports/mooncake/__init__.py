"""The Mooncake transfer engine, the across-hosts transport (`--mooncake-transfer`), server side: a call
whose receiver offered its engine gets each payload written straight into one of the receiver's
granted slots (TCP, or RDMA where the hosts have it), then the item's header naming the slot with a MAC
keyed by the call's token; no chunks follow. What cannot be written that way (no engine, an offer it
refuses, no slot left that holds it, a failed write) follows as chunks, with the reason in the header.

`writer.py` holds the engine and its write threads (the registry's entry), `call.py` one call's use of
them, `metrics.py` their Prometheus counts. The MAC is in `protos/mooncake.py`; the receiver's side is
`receiver/transports/mooncake.py`.
"""

from .writer import MooncakeConfig, MooncakeWriter

__all__ = ["MooncakeConfig", "MooncakeWriter"]
