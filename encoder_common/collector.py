"""The cyclic garbage collector in long-lived serving processes (the encoder server, encoder-gateway):
what start-up made frozen out of its reach, so that full collections stop holding the event loop."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collects once, then freezes every object alive now (modules, the model, the server: what start-up
    made, never garbage later); returns how many are frozen. Call it once, when start-up is done, in a
    process that serves until it exits.

    torch, transformers and a loaded model leave some 200,000 tracked objects, which every full collection
    walked: in an encoder server answering cached calls, a ~73 ms stop of the event loop every ~15,000 calls.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
