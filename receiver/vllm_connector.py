"""`EncoderServiceConnector`: a vLLM encoder-cache connector for `ec_consumer` instances that pulls each
image's embedding from the encoder pods by its lease key; for the vLLM releases of `receiver.vllm_releases`.

vLLM loads it out of tree: `--ec-transfer-config '{"ec_connector": "EncoderServiceConnector",
"ec_connector_module_path": "receiver.vllm_connector", "ec_role": "ec_consumer",
"ec_connector_extra_config": {"encoders": ["grpc://enc-0:50051"]}}'`. A request names each item by a
metadata-only embedding part whose `uuid` is `enc:<lease key hex>` (`receiver.fetch.item_uuid`),
optionally with `ec_transfer_params = {"encoder_urls": {uuid: url}}` saying which encoder holds it. For
families whose placeholders vLLM sizes from the image (LLaVA-NeXT/OneVision, InternVL, Gemma 3, ...) the
part is the raw image with that `uuid`: vLLM's processor sizes the placeholders, and the embedding is still
fetched, so vLLM's own tower does not run.

The module imports on any vLLM; when vLLM creates the connector, `receiver.vllm_contract` refuses a
release outside the declared range or one lacking a method, signature or type the connector relies on,
naming the version and what is missing.

The scheduler-side instance fetches (it is asked about every waiting request each step, while the
worker is not called at all in a step that schedules nothing); it receives each embedding through the
receiver's Fetch path into a file under /dev/shm. The worker-side instance maps that file and puts
the mapped tensor itself into vLLM's encoder cache. A request is deferred until all its items are in,
and failed alone (through `take_unavailable_requests`) when one cannot be fetched: the worker is never
asked to load an embedding that is not there, which would kill the engine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .client import EncoderReceiver
from .fetch import UUID_PREFIX, lease_key
from .item_files import DEFAULT_DIRECTORY, create_item_file, map_item_file, new_item_path, sweep_dead
from .vllm_contract import check_vllm_contract

try:
    from vllm.distributed.ec_transfer.ec_connector.base import (
        ECConnectorBase,
        ECConnectorMetadata,
        ECConnectorRole,
    )
    from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver

    _IMPORT_GAP = None
except ImportError as exc:  # reported by check_vllm_contract when vLLM creates the connector
    _IMPORT_GAP = f"the encoder-cache connector interface ({exc})"
    ECConnectorBase = ECConnectorMetadata = object
    ECConnectorRole = PlaceholderMetadataResolver = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_FILE_PREFIX = "encoder-connector"
DEFAULT_FETCH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ItemFile:
    """A received embedding waiting in a file for the worker: [num_tokens, hidden_size] of dtype."""

    identifier: str
    path: str
    shape: tuple[int, int]
    dtype: torch.dtype


@dataclass
class EncoderServiceConnectorMetadata(ECConnectorMetadata):
    """Scheduler to worker, each step: the items to put into the encoder cache."""

    loads: list[ItemFile] = field(default_factory=list)


@dataclass(eq=False)
class _Item:
    """One identifier's fetch, shared by every request naming it; the file goes with the last of them.

    `requests` and `future` belong to the scheduler thread. `file`, `error` and `released` cross threads
    (the fetch on the event loop sets the outcome, the scheduler reads it and releases the item), so they are
    read and written under `_SchedulerSide.lock` only.
    """

    identifier: str
    requests: set[str] = field(default_factory=set)
    future: Any = None  # the fetch, running on the connector's event loop
    file: ItemFile | None = None  # set once the embedding is in
    error: str | None = None  # set when it cannot be had
    released: bool = False  # its last request went: a fetch finishing now removes its own file


class EncoderServiceConnector(ECConnectorBase):
    """Encoder-cache connector of an `ec_consumer`: embeddings come from the encoder pods' leases.

    Extra config (`ec_connector_extra_config`): `encoders` (list of URLs, required), `fetch_timeout_s`
    (30), `transfer` ("auto": shared memory from encoders on this host, else the gRPC stream), and
    `directory` (/dev/shm) for the files handed to the worker.
    """

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole):
        check_vllm_contract(type(self), _IMPORT_GAP)
        super().__init__(vllm_config=vllm_config, role=role)
        if not self.is_consumer or self.is_producer:
            raise ValueError('EncoderServiceConnector runs on an "ec_consumer" instance only')
        transfer_config = vllm_config.ec_transfer_config
        self.directory = Path(transfer_config.get_from_extra_config("directory", str(DEFAULT_DIRECTORY)))
        model_config = vllm_config.model_config
        self.model_dtype = model_config.dtype
        self.hidden_size = model_config.get_hidden_size()
        self._scheduler: _SchedulerSide | None = None
        if role == ECConnectorRole.SCHEDULER:
            urls = transfer_config.get_from_extra_config("encoders", None)
            if not urls or isinstance(urls, str):
                raise ValueError(
                    "EncoderServiceConnector needs ec_connector_extra_config "
                    '{"encoders": ["grpc://host:port", ...]}'
                )
            self._scheduler = _SchedulerSide(
                self,
                list(urls),
                timeout=float(
                    transfer_config.get_from_extra_config("fetch_timeout_s", DEFAULT_FETCH_TIMEOUT_S)
                ),
                transfer=str(transfer_config.get_from_extra_config("transfer", "auto")),
                resolver=PlaceholderMetadataResolver(model_config),
            )

    # ---- worker side ----

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs) -> None:
        """Maps each announced file and puts its tensor into the encoder cache (no copy on CPU)."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, EncoderServiceConnectorMetadata)
        device = self._vllm_config.device_config.device
        for item in metadata.loads:
            if item.identifier in encoder_cache:
                continue
            tensor = map_item_file(item.path, item.shape, item.dtype)
            encoder_cache[item.identifier] = tensor.to(device=device, dtype=self.model_dtype)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs) -> None:
        return  # a consumer saves nothing

    # ---- scheduler side ----

    def has_cache_item(self, identifier: str) -> bool:
        return self._scheduler.has_item(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        return self._scheduler.ensure(request, num_computed_tokens)

    def take_unavailable_requests(self) -> set[str]:
        return self._scheduler.take_unavailable()

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        self._scheduler.allocated(request.mm_features[index].identifier)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> EncoderServiceConnectorMetadata:
        return self._scheduler.step_metadata()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.finished(request.request_id)
        return False, None

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()


class _SchedulerSide:
    """Fetches on an event loop of its own thread; the scheduler thread reads each item's outcome under
    `lock`, which the fetch takes to write it."""

    def __init__(
        self,
        connector: EncoderServiceConnector,
        urls: list[str],
        *,
        timeout: float,
        transfer: str,
        resolver: PlaceholderMetadataResolver,
    ):
        self.connector = connector
        self.timeout = timeout
        self.resolver = resolver
        sweep_dead(connector.directory, _FILE_PREFIX)
        self._items: dict[str, _Item] = {}
        self._by_request: dict[str, set[str]] = {}
        self._loads: dict[str, ItemFile] = {}
        self._unavailable: set[str] = set()
        self.lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="encoder-connector", daemon=True)
        self._thread.start()
        self._receiver: EncoderReceiver = asyncio.run_coroutine_threadsafe(
            self._make_receiver(urls, transfer), self._loop
        ).result()
        log.info("EncoderServiceConnector: fetching embeddings from %s", urls)

    async def _make_receiver(self, urls: list[str], transfer: str) -> EncoderReceiver:
        return EncoderReceiver(urls, timeout=self.timeout, transfer=transfer)

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
        item.future = asyncio.run_coroutine_threadsafe(
            self._fetch(item, key, position_embeds=feature.mm_position.get_num_embeds(), prefer=prefer),
            self._loop,
        )
        return item

    async def _fetch(self, item: _Item, key: bytes, *, position_embeds: int, prefer: str | None) -> None:
        path = new_item_path(self.connector.directory, _FILE_PREFIX)
        try:
            result = await self._receiver.fetch(
                f"vllm-{key.hex()[:16]}",
                key,
                prefer_url=prefer,
                allocate=lambda shape, dtype: create_item_file(path, shape, dtype),
            )
            if result.deepstack is not None:
                raise ValueError("the encoder sent deepstack features, which this connector does not place")
            if result.num_tokens != position_embeds or result.hidden_size != self.connector.hidden_size:
                raise ValueError(
                    f"the encoder sent [{result.num_tokens}, {result.hidden_size}], the prompt has room for "
                    f"[{position_embeds}, {self.connector.hidden_size}]"
                )
        except asyncio.CancelledError:  # its last request went away
            path.unlink(missing_ok=True)
            raise
        except Exception as exc:  # every failure becomes this item's error, reported per request
            path.unlink(missing_ok=True)
            with self.lock:
                item.error = f"embedding {item.identifier} unavailable: {exc}"
            return
        shape = (result.num_tokens, result.hidden_size)
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

    def step_metadata(self) -> EncoderServiceConnectorMetadata:
        metadata = EncoderServiceConnectorMetadata(list(self._loads.values()))
        self._loads.clear()
        return metadata

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


__all__ = ["EncoderServiceConnector"]
