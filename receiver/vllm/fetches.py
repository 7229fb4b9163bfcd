"""The scheduler-side half of `EncoderServiceConnector`: one fetch per item identifier, shared by every
request naming it, on an event loop of its own thread; each embedding received into a file under the
shared-memory directory and announced to the worker once vLLM allocates its encoder-cache slot."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from encoder_common import tracing

from ..client import EncoderReceiver
from ..config import ReceiverConfig
from ..fleet.fetch import UUID_PREFIX, lease_key
from .item_files import create_item_file, map_item_file, new_item_path, sweep_dead

if TYPE_CHECKING:
    from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_FILE_PREFIX = "encoder-connector"


@dataclass(frozen=True)
class ItemFile:
    """A received embedding waiting in a file for the worker: [1 + deepstack levels, tokens, hidden] of dtype.

    An item is received in the receiver's layout, `[1 + deepstack levels, tokens, hidden]`; `ItemFile.entry`
    turns the mapped file into the encoder-cache entry vLLM's own tower would have made: `[tokens, hidden]`,
    or for Qwen3-VL the embedding with its deepstack levels after it along hidden, `[tokens, hidden * (1 +
    levels)]` (what `Qwen3VLForConditionalGeneration.embed_multimodal` returns and `_compute_deepstack_embeds`
    splits again).
    """

    identifier: str
    path: str
    shape: tuple[int, int, int]
    dtype: torch.dtype

    def entry(self) -> torch.Tensor:
        """The encoder-cache entry: the mapped file itself without deepstack levels (no copy), else one
        copy into [tokens, hidden * (1 + levels)], the levels after the embedding along hidden."""
        layers, tokens, hidden = self.shape
        return (
            map_item_file(self.path, self.shape, self.dtype).permute(1, 0, 2).reshape(tokens, layers * hidden)
        )


@dataclass(eq=False)
class _Item:
    """One identifier's fetch, shared by every request naming it; the file goes with the last of them.

    `requests` and `future` belong to the scheduler thread. `file`, `error` and `released` cross threads
    (the fetch on the event loop sets the outcome, the scheduler reads it and releases the item), so they are
    read and written under `SchedulerFetches.lock` only.
    """

    identifier: str
    requests: set[str] = field(default_factory=set)
    future: Any = None  # the fetch, running on the connector's event loop
    file: ItemFile | None = None  # set once the embedding is in
    error: str | None = None  # set when it cannot be had
    released: bool = False  # its last request went: a fetch finishing now removes its own file


class SchedulerFetches:
    """Fetches on an event loop of its own thread; the scheduler thread reads each item's outcome under
    `lock`, which the fetch takes to write it. `hidden_size` and `deepstack_levels` are the width and
    the deepstack levels of vLLM's model: an item of another shape fails its requests."""

    def __init__(
        self,
        directory: Path,
        urls: list[str],
        config: ReceiverConfig,
        *,
        resolver: PlaceholderMetadataResolver,
        hidden_size: int,
        deepstack_levels: int,
    ):
        self.directory = directory
        self.resolver = resolver
        self.hidden_size = hidden_size
        self.deepstack_levels = deepstack_levels
        sweep_dead(directory, _FILE_PREFIX)
        self._items: dict[str, _Item] = {}
        self._by_request: dict[str, set[str]] = {}
        self._loads: dict[str, ItemFile] = {}
        self._unavailable: set[str] = set()
        self.lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="encoder-connector", daemon=True)
        self._thread.start()
        self._receiver: EncoderReceiver = asyncio.run_coroutine_threadsafe(
            self._make_receiver(urls, config), self._loop
        ).result()
        log.info("EncoderServiceConnector: fetching embeddings from %s", urls)

    async def _make_receiver(self, urls: list[str], config: ReceiverConfig) -> EncoderReceiver:
        return EncoderReceiver(urls, config)

    def _outcome(self, item: _Item | None) -> tuple[ItemFile | None, str | None]:
        """The item's file and error as the fetch left them (both None while it runs)."""
        if item is None:
            return None, None
        with self.lock:
            return item.file, item.error

    def has_item(self, identifier: str) -> bool:
        return self._outcome(self._items.get(identifier))[0] is not None

    def ensure(self, request: Request, num_computed_tokens: int) -> bool:
        """True once every item the request still needs from us is in; False while one is on its way or
        when one cannot be had (the request is then reported by `take_unavailable`)."""
        if request.request_id in self._unavailable:
            return False
        ready = True
        for feature in request.mm_features:
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue  # already prefilled
            if lease_key(feature.identifier) is None and self._carries_input(feature):
                continue  # vLLM has the media or tensor to encode itself
            item = self._items.get(feature.identifier)
            if item is None:
                item = self._start(feature, request)
            if request.request_id not in item.requests:
                item.requests.add(request.request_id)
                self._by_request.setdefault(request.request_id, set()).add(item.identifier)
            file, error = self._outcome(item)
            if error is not None:
                log.error("request %s: %s; failing the request", request.request_id, error)
                self._unavailable.add(request.request_id)
                return False
            ready = ready and file is not None
        return ready

    def _carries_input(self, feature: MultiModalFeatureSpec) -> bool:
        """Whether the item brought something vLLM can run its own encoder on (media or a tensor). An item
        named by a lease key is fetched even so: for families whose placeholders vLLM sizes from the image,
        the request carries the image beside the key, and the embedding still comes from the encoders."""
        data = feature.data
        if not data:
            return False
        metadata = self.resolver.fields_for(feature.modality)
        return any(value.data is not None for key, value in data.items() if key not in metadata)

    def _start(self, feature: MultiModalFeatureSpec, request: Request) -> _Item:
        item = _Item(feature.identifier)
        self._items[item.identifier] = item
        key = lease_key(feature.identifier)
        if key is None:
            with self.lock:
                item.error = (
                    f"item {feature.identifier!r} came without its embedding and its uuid is not "
                    f"'{UUID_PREFIX}<64 hex digits>' (a lease key), so there is nothing to fetch"
                )
            return item
        hints = (request.ec_transfer_params or {}).get("encoder_urls") or {}
        prefer = hints.get(feature.identifier) if isinstance(hints, dict) else None
        # The fetch is a span of the request's trace where vLLM carries one (--otlp-traces-endpoint).
        trace = tracing.context_from(request.trace_headers)
        embeds = feature.mm_position.get_num_embeds()
        item.future = asyncio.run_coroutine_threadsafe(
            self._fetch(item, key, position_embeds=embeds, prefer=prefer, trace=trace), self._loop
        )
        return item

    async def _fetch(
        self, item: _Item, key: bytes, *, position_embeds: int, prefer: str | None, trace: Any = None
    ) -> None:
        path = new_item_path(self.directory, _FILE_PREFIX)
        try:
            with tracing.span("connector.fetch", parent=trace, attributes={"encoder.item": item.identifier}):
                result = await self._receiver.fetch(
                    f"vllm-{key.hex()[:16]}",
                    key,
                    prefer_url=prefer,
                    allocate=lambda shape, dtype: create_item_file(path, shape, dtype),
                )
            levels = 0 if result.deepstack is None else result.deepstack.shape[0]
            sent = (result.num_tokens, result.hidden_size, levels)
            room = (position_embeds, self.hidden_size, self.deepstack_levels)
            if sent != room:
                raise ValueError(
                    "the encoder sent [{}, {}] with {} deepstack levels, the prompt has room for [{}, {}] with "
                    "{}".format(*sent, *room)
                )
        except asyncio.CancelledError:  # its last request went away
            path.unlink(missing_ok=True)
            raise
        except Exception as exc:  # every failure becomes this item's error, reported per request
            path.unlink(missing_ok=True)
            with self.lock:
                item.error = f"embedding {item.identifier} unavailable: {exc}"
            return
        shape = (1 + levels, result.num_tokens, result.hidden_size)
        file = ItemFile(item.identifier, str(path), shape, result.embedding.dtype)
        with self.lock:
            if not item.released:
                item.file = file
                return
        path.unlink(missing_ok=True)  # released while the fetch ran: nobody will map it

    def allocated(self, identifier: str) -> None:
        file = self._outcome(self._items.get(identifier))[0]
        if file is not None:
            self._loads[identifier] = file

    def take_loads(self) -> list[ItemFile]:
        """The files allocated since the last step, for the worker to load."""
        loads = list(self._loads.values())
        self._loads.clear()
        return loads

    def take_unavailable(self) -> set[str]:
        failed, self._unavailable = self._unavailable, set()
        return failed

    def finished(self, request_id: str) -> None:
        """Lets go of the request's items; an item no request names any more loses its file."""
        self._unavailable.discard(request_id)
        for identifier in self._by_request.pop(request_id, ()):
            item = self._items.get(identifier)
            if item is None:
                continue
            item.requests.discard(request_id)
            if not item.requests:
                del self._items[identifier]
                self._release(item)

    def _release(self, item: _Item) -> None:
        """Marks the item released, then on the event loop stops its fetch if it still runs and removes the
        file it wrote; a fetch that finishes after the mark removes its file itself."""
        with self.lock:
            item.released = True
            file = item.file
        self._loop.call_soon_threadsafe(self._discard, item.future, file)

    @staticmethod
    def _discard(future: Any, file: ItemFile | None) -> None:
        if future is not None and not future.done():
            future.cancel()
        if file is not None:
            Path(file.path).unlink(missing_ok=True)

    def close(self) -> None:
        for item in list(self._items.values()):
            self._release(item)
        self._items.clear()
        asyncio.run_coroutine_threadsafe(self._receiver.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
