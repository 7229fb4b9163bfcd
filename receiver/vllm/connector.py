"""`EncoderServiceConnector`: a vLLM encoder-cache connector for `ec_consumer` instances that pulls each
image's embedding from the encoder pods by its lease key (docs/vllm-connector.md); vLLM loads it out of tree
with `"ec_connector_module_path": "receiver.vllm.connector"`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from encoder_common import tracing

from ..config import ReceiverConfig, config_from_mapping
from .contract import check_vllm_contract
from .fetches import ItemFile, SchedulerFetches
from .item_files import DEFAULT_DIRECTORY

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
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# The receiver's settings where the extra config says nothing: a fetch's deadline, every encoder tried included.
CONNECTOR_DEFAULTS = ReceiverConfig(timeout=30.0)


@dataclass(frozen=True)
class ConnectorSettings:
    """What `ec_connector_extra_config` configures: the encoders, the directory the worker maps received
    embeddings from, and the receiver's settings (`receiver.config.config_from_mapping`: ReceiverConfig's
    fields and the TLS and token files; CONNECTOR_DEFAULTS for the others)."""

    encoders: tuple[str, ...]
    directory: Path
    receiver: ReceiverConfig

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        settings = dict(extra)
        urls = settings.pop("encoders", None)
        if not urls or isinstance(urls, str):
            raise ValueError(
                'EncoderServiceConnector needs ec_connector_extra_config {"encoders": ["grpc://host:port", ...]}'
            )
        directory = Path(settings.pop("directory", DEFAULT_DIRECTORY))
        return cls(tuple(urls), directory, config_from_mapping(settings, CONNECTOR_DEFAULTS))


@dataclass
class EncoderServiceConnectorMetadata(ECConnectorMetadata):
    """Scheduler to worker, each step: the items to put into the encoder cache."""

    loads: list[ItemFile] = field(default_factory=list)


class EncoderServiceConnector(ECConnectorBase):
    """Encoder-cache connector of an `ec_consumer`: embeddings come from the encoder pods' leases.

    Extra config (`ec_connector_extra_config`): `encoders` (list of URLs, required), `directory` (/dev/shm)
    and the receiver's settings (ConnectorSettings), listed in docs/vllm-connector.md.

    vLLM loads it out of tree: `--ec-transfer-config '{"ec_connector": "EncoderServiceConnector",
    "ec_connector_module_path": "receiver.vllm.connector", "ec_role": "ec_consumer",
    "ec_connector_extra_config": {"encoders": ["grpc://enc-0:50051"]}}'`. A request names each item by a
    metadata-only embedding part whose `uuid` is `enc:<lease key hex>` (`receiver.fleet.fetch.item_uuid`),
    optionally with `ec_transfer_params = {"encoder_urls": {uuid: url}}` saying which encoder holds it. For
    families whose placeholders vLLM sizes from the image (LLaVA-NeXT/OneVision, InternVL, Gemma 3, ...) the
    part is the raw image with that `uuid`: vLLM's processor sizes the placeholders, and the embedding is still
    fetched, so vLLM's own tower does not run.

    The module imports on any vLLM; when vLLM creates the connector, `receiver.vllm.contract` refuses a
    release outside the declared range or one lacking a method, signature or type the connector relies on,
    naming the version and what is missing.

    The scheduler-side instance fetches (it is asked about every waiting request each step, while the
    worker is not called at all in a step that schedules nothing); it receives each embedding through the
    receiver's Fetch path into a file under /dev/shm. The worker-side instance maps that file and puts
    the mapped tensor itself into vLLM's encoder cache. A request is deferred until all its items are in,
    and failed alone (through `take_unavailable_requests`) when one cannot be fetched: the worker is never
    asked to load an embedding that is not there, which would kill the engine.
    """

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole):
        check_vllm_contract(type(self), _IMPORT_GAP)
        super().__init__(vllm_config=vllm_config, role=role)
        if not self.is_consumer or self.is_producer:
            raise ValueError('EncoderServiceConnector runs on an "ec_consumer" instance only')
        settings = ConnectorSettings.from_extra_config(vllm_config.ec_transfer_config.ec_connector_extra_config)
        self.directory = settings.directory
        model_config = vllm_config.model_config
        self.model_dtype = model_config.dtype
        self._scheduler: SchedulerFetches | None = None
        if role == ECConnectorRole.SCHEDULER:
            if vllm_config.observability_config.otlp_traces_endpoint:  # vLLM set up its tracer provider
                tracing.use_host_provider()
            self._scheduler = SchedulerFetches(
                self.directory,
                list(settings.encoders),
                settings.receiver,
                resolver=PlaceholderMetadataResolver(model_config),
                hidden_size=model_config.get_hidden_size(),
                deepstack_levels=_deepstack_levels(model_config),
            )

    # ---- worker side ----

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs) -> None:
        """Maps each announced file and puts its entry into the encoder cache (on CPU no copy, but for the
        deepstack levels' one: `ItemFile.entry`)."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, EncoderServiceConnectorMetadata)
        device = self._vllm_config.device_config.device
        for item in metadata.loads:
            if item.identifier in encoder_cache:
                continue
            encoder_cache[item.identifier] = item.entry().to(device=device, dtype=self.model_dtype)

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
        return EncoderServiceConnectorMetadata(self._scheduler.take_loads())

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.finished(request.request_id)
        return False, None

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()


def _deepstack_levels(model_config: Any) -> int:
    """How many deepstack levels vLLM's model splits off each encoder-cache entry (Qwen3-VL's
    `deepstack_visual_indexes`, read as its model reads them); 0 for the other families."""
    vision = getattr(model_config.hf_config, "vision_config", None)
    return len(getattr(vision, "deepstack_visual_indexes", None) or ())


__all__ = ["EncoderServiceConnector"]
