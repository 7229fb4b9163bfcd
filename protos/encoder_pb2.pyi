from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    IMAGE: _ClassVar[Modality]
    VIDEO: _ClassVar[Modality]
    AUDIO: _ClassVar[Modality]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]

class ShmFallback(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHM_FALLBACK_NONE: _ClassVar[ShmFallback]
    SHM_DISABLED: _ClassVar[ShmFallback]
    SHM_PROBE_UNREADABLE: _ClassVar[ShmFallback]
    SHM_BUDGET_FULL: _ClassVar[ShmFallback]
    SHM_WRITE_FAILED: _ClassVar[ShmFallback]
    SHM_SMALL_ITEM: _ClassVar[ShmFallback]

class MooncakeFallback(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MOONCAKE_FALLBACK_NONE: _ClassVar[MooncakeFallback]
    MOONCAKE_DISABLED: _ClassVar[MooncakeFallback]
    MOONCAKE_OFFER_REFUSED: _ClassVar[MooncakeFallback]
    MOONCAKE_NO_SLOT: _ClassVar[MooncakeFallback]
    MOONCAKE_WRITE_FAILED: _ClassVar[MooncakeFallback]
    MOONCAKE_SMALL_ITEM: _ClassVar[MooncakeFallback]
MODALITY_UNSPECIFIED: Modality
IMAGE: Modality
VIDEO: Modality
AUDIO: Modality
DTYPE_UNSPECIFIED: DType
BFLOAT16: DType
FLOAT16: DType
FLOAT32: DType
SHM_FALLBACK_NONE: ShmFallback
SHM_DISABLED: ShmFallback
SHM_PROBE_UNREADABLE: ShmFallback
SHM_BUDGET_FULL: ShmFallback
SHM_WRITE_FAILED: ShmFallback
SHM_SMALL_ITEM: ShmFallback
MOONCAKE_FALLBACK_NONE: MooncakeFallback
MOONCAKE_DISABLED: MooncakeFallback
MOONCAKE_OFFER_REFUSED: MooncakeFallback
MOONCAKE_NO_SLOT: MooncakeFallback
MOONCAKE_WRITE_FAILED: MooncakeFallback
MOONCAKE_SMALL_ITEM: MooncakeFallback

class ImageItem(_message.Message):
    __slots__ = ("index", "modality", "data", "url", "content_sha256")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    CONTENT_SHA256_FIELD_NUMBER: _ClassVar[int]
    index: int
    modality: Modality
    data: bytes
    url: str
    content_sha256: bytes
    def __init__(self, index: _Optional[int] = ..., modality: _Optional[_Union[Modality, str]] = ..., data: _Optional[bytes] = ..., url: _Optional[str] = ..., content_sha256: _Optional[bytes] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "items", "shm", "lease", "mooncake")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    items: _containers.RepeatedCompositeFieldContainer[ImageItem]
    shm: ShmOffer
    lease: Lease
    mooncake: MooncakeOffer
    def __init__(self, request_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[ImageItem, _Mapping]]] = ..., shm: _Optional[_Union[ShmOffer, _Mapping]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., mooncake: _Optional[_Union[MooncakeOffer, _Mapping]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("ttl_ms", "withhold_payload")
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    WITHHOLD_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    ttl_ms: int
    withhold_payload: bool
    def __init__(self, ttl_ms: _Optional[int] = ..., withhold_payload: _Optional[bool] = ...) -> None: ...

class LeaseGrant(_message.Message):
    __slots__ = ("key", "ttl_ms")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    ttl_ms: int
    def __init__(self, key: _Optional[bytes] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("request_id", "keys", "shm", "mooncake")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    shm: ShmOffer
    mooncake: MooncakeOffer
    def __init__(self, request_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., shm: _Optional[_Union[ShmOffer, _Mapping]] = ..., mooncake: _Optional[_Union[MooncakeOffer, _Mapping]] = ...) -> None: ...

class ShmOffer(_message.Message):
    __slots__ = ("probe",)
    PROBE_FIELD_NUMBER: _ClassVar[int]
    probe: str
    def __init__(self, probe: _Optional[str] = ...) -> None: ...

class ShmPlacement(_message.Message):
    __slots__ = ("segment", "proof", "fallback")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    segment: str
    proof: bytes
    fallback: ShmFallback
    def __init__(self, segment: _Optional[str] = ..., proof: _Optional[bytes] = ..., fallback: _Optional[_Union[ShmFallback, str]] = ...) -> None: ...

class MooncakeOffer(_message.Message):
    __slots__ = ("session", "protocol", "slots", "token")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    session: str
    protocol: str
    slots: _containers.RepeatedCompositeFieldContainer[MooncakeSlot]
    token: bytes
    def __init__(self, session: _Optional[str] = ..., protocol: _Optional[str] = ..., slots: _Optional[_Iterable[_Union[MooncakeSlot, _Mapping]]] = ..., token: _Optional[bytes] = ...) -> None: ...

class MooncakeSlot(_message.Message):
    __slots__ = ("address", "capacity")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    address: int
    capacity: int
    def __init__(self, address: _Optional[int] = ..., capacity: _Optional[int] = ...) -> None: ...

class MooncakePlacement(_message.Message):
    __slots__ = ("slot", "mac", "fallback")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    slot: int
    mac: bytes
    fallback: MooncakeFallback
    def __init__(self, slot: _Optional[int] = ..., mac: _Optional[bytes] = ..., fallback: _Optional[_Union[MooncakeFallback, str]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_ms", "preprocess_ms", "forward_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    preprocess_ms: float
    forward_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., preprocess_ms: _Optional[float] = ..., forward_ms: _Optional[float] = ...) -> None: ...

class ItemHeader(_message.Message):
    __slots__ = ("index", "num_tokens", "grid_thw", "hidden_size", "dtype", "num_deepstack_layers", "payload_bytes", "cache_hit", "timing", "shm", "lease", "content_sha256", "not_held", "image_size", "mooncake")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_DEEPSTACK_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_SHA256_FIELD_NUMBER: _ClassVar[int]
    NOT_HELD_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_FIELD_NUMBER: _ClassVar[int]
    index: int
    num_tokens: int
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    dtype: DType
    num_deepstack_layers: int
    payload_bytes: int
    cache_hit: bool
    timing: Timing
    shm: ShmPlacement
    lease: LeaseGrant
    content_sha256: bytes
    not_held: bool
    image_size: ImageSize
    mooncake: MooncakePlacement
    def __init__(self, index: _Optional[int] = ..., num_tokens: _Optional[int] = ..., grid_thw: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., num_deepstack_layers: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., cache_hit: _Optional[bool] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., shm: _Optional[_Union[ShmPlacement, _Mapping]] = ..., lease: _Optional[_Union[LeaseGrant, _Mapping]] = ..., content_sha256: _Optional[bytes] = ..., not_held: _Optional[bool] = ..., image_size: _Optional[_Union[ImageSize, _Mapping]] = ..., mooncake: _Optional[_Union[MooncakePlacement, _Mapping]] = ...) -> None: ...

class ImageSize(_message.Message):
    __slots__ = ("width", "height")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    width: int
    height: int
    def __init__(self, width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ItemHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[ItemHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("family", "model_type", "hidden_size", "dtype", "patch_size", "spatial_merge_size", "temporal_patch_size", "num_deepstack_layers", "weights_fingerprint", "device", "random_weights", "max_items_per_request", "max_request_bytes", "server_version", "extra_tokens_per_item", "lease_max_bytes", "lease_max_ttl_ms", "preprocess_profile", "backend", "backend_version")
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPATIAL_MERGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TEMPORAL_PATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_DEEPSTACK_LAYERS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RANDOM_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    MAX_ITEMS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXTRA_TOKENS_PER_ITEM_FIELD_NUMBER: _ClassVar[int]
    LEASE_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_MAX_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_PROFILE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_VERSION_FIELD_NUMBER: _ClassVar[int]
    family: str
    model_type: str
    hidden_size: int
    dtype: DType
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    num_deepstack_layers: int
    weights_fingerprint: str
    device: str
    random_weights: bool
    max_items_per_request: int
    max_request_bytes: int
    server_version: str
    extra_tokens_per_item: int
    lease_max_bytes: int
    lease_max_ttl_ms: int
    preprocess_profile: str
    backend: str
    backend_version: str
    def __init__(self, family: _Optional[str] = ..., model_type: _Optional[str] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., patch_size: _Optional[int] = ..., spatial_merge_size: _Optional[int] = ..., temporal_patch_size: _Optional[int] = ..., num_deepstack_layers: _Optional[int] = ..., weights_fingerprint: _Optional[str] = ..., device: _Optional[str] = ..., random_weights: _Optional[bool] = ..., max_items_per_request: _Optional[int] = ..., max_request_bytes: _Optional[int] = ..., server_version: _Optional[str] = ..., extra_tokens_per_item: _Optional[int] = ..., lease_max_bytes: _Optional[int] = ..., lease_max_ttl_ms: _Optional[int] = ..., preprocess_profile: _Optional[str] = ..., backend: _Optional[str] = ..., backend_version: _Optional[str] = ...) -> None: ...
