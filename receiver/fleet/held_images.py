"""Images an encoder said it keeps (encoder.v1 revision 3, docs/wire-protocol.md#image-references-revision-3):
for one encoder, the sha256 its headers gave for each image, by the receiver's content key (xxh3-128 of
the bytes, `receiver.fleet.affinity.content_key`), so that the image goes there next time as its digest alone
instead of its bytes. The fast key only says where to look: an image is named by a digest only once
its own bytes are confirmed to hash to it (DIGESTS), so a collision of the fast hash costs a call with
the bytes, never another image's embedding. An LRU bounded in entries; used from one event loop."""

from __future__ import annotations

from collections import OrderedDict

from encoder_common.digests import DigestMemo

# The sha256 of image bytes this process confirmed lately, shared by its receivers (their held digests
# here, and their caches' keys in receiver.fleet.failover): a repeated image is confirmed by comparing its
# bytes (~10 us for 465 KB) instead of hashing them (~0.2 ms).
DIGESTS = DigestMemo()

# ~150 bytes an entry: about 3 MB per encoder at most, more images than an encoder's cache holds.
DEFAULT_HELD_IMAGES = 20_000


class HeldImages:
    """Content key -> the image's sha256, as one encoder gave it; least recently used out first."""

    def __init__(self, max_entries: int = DEFAULT_HELD_IMAGES):
        self.max_entries = max_entries
        self._digests: OrderedDict[bytes, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._digests)

    def digest(self, key: bytes, data: bytes) -> bytes | None:
        """The sha256 to name `data` (whose content key is `key`) by on this encoder, or None: send its
        bytes (not held, or bytes that do not hash to the digest held under their key)."""
        digest = self._digests.get(key)
        if digest is None or DIGESTS.sha256(data, key) != digest:
            return None
        self._digests.move_to_end(key)
        return digest

    def held(self, key: bytes, digest: bytes) -> None:
        """The encoder said it keeps the image of `key` under `digest`."""
        self._digests[key] = digest
        self._digests.move_to_end(key)
        if len(self._digests) > self.max_entries:
            self._digests.popitem(last=False)

    def forget(self, key: bytes) -> None:
        """The encoder no longer holds it (it answered not_held)."""
        self._digests.pop(key, None)
