"""Everything an EncoderReceiver is configured with, in frozen dataclasses that need neither torch nor
a model: the receiver and its fleet take `ReceiverConfig` whole, `encoder-client` builds its flags from
it, and `encoder-gateway` embeds it. The vocabulary of `placement` lives here, that of `transfer` in the
transport registry (receiver.transports)."""

from __future__ import annotations

import argparse
import types as types_module
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from encoder_common.env_flags import flag, section
from encoder_common.mooncake_engine import EngineSettings

from .transports import TRANSFERS

PLACEMENTS = ("random", "affinity")
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_REFRESH_S = 10.0  # how often `dns:` names are resolved again
DEFAULT_BALANCE = 1.25


@dataclass(frozen=True, kw_only=True)
class FailoverPolicy:
    max_attempts: int = 6  # Encode calls one item may fail in before its request fails
    stall_timeout_s: float = 5.0  # silence on a stream after which the encoder is probed
    probe_timeout_s: float = 1.0  # a health probe without an answer by then counts as failed
    backoff_s: float = 1.0  # how long a failed encoder is skipped; doubles with each further failure
    max_backoff_s: float = 30.0
    # First wait before re-sending items an encoder refused as overloaded; doubles per attempt, so
    # an item gives up on a fleet that stays overloaded after ~3 s of back-off (0.1 + ... + 1.6).
    busy_backoff_s: float = 0.1


@dataclass(frozen=True, kw_only=True)
class MooncakeReceiverConfig(EngineSettings):
    """The transfer engine's side of a receiver (transfer "mooncake", or "auto" to encoders on other hosts)."""

    slots: int = field(default=8, metadata=flag("receive slots registered with the transfer engine, one item each"))
    slot_bytes: int = field(
        default=48 << 20, metadata=flag("bytes of each receive slot; larger items come over the stream")
    )
    late_write_s: float = field(
        default=30.0,
        metadata=flag("how long the slots of a call that ended early stay out of use, in case its encoder's write still lands"),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.slots < 1 or self.slot_bytes < 1:
            raise ValueError(f"the transfer engine needs slots of some size, got {self.slots} x {self.slot_bytes} bytes")


@dataclass(frozen=True)
class ClientTls:
    """TLS settings for `grpcs://` encoders: the CAs to trust and, for mTLS, this client's certificate.

    All PEM bytes; `root_certificates=None` trusts the system's CAs. A client certificate needs its key.
    """

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs its private key, and the other way round")

    @classmethod
    def from_files(
        cls, *, ca_file: str | Path | None = None, cert_file: str | Path | None = None, key_file: str | Path | None = None
    ) -> ClientTls:
        def read(path):
            return Path(path).read_bytes() if path is not None else None

        return cls(root_certificates=read(ca_file), certificate_chain=read(cert_file), private_key=read(key_file))

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


@dataclass(frozen=True, kw_only=True)
class ReceiverConfig:
    """An EncoderReceiver's settings. The flagged ones are the commands' flags (`encoder-client`,
    `encoder-gateway`); the credentials come from files (`add_credential_flags`)."""

    timeout: float = field(
        default=DEFAULT_TIMEOUT_S,
        metadata=flag("deadline of one request's encode, retries included, seconds", name="--encode-timeout"),
    )
    placement: str = field(
        default="random",
        metadata=flag(
            "how items are placed on encoders (affinity: by content, so a repeated image meets its cache)",
            choices=PLACEMENTS,
        ),
    )
    balance: float = field(
        default=DEFAULT_BALANCE,
        metadata=flag(
            "with --placement affinity: new items pass over an encoder whose queued work is over this times "
            "the fleet's median, plus eight items' worth"
        ),
    )
    cache_bytes: int = field(
        default=0,
        metadata=flag(
            "embeddings kept by the receiver to serve repeated images without an encoder call, bytes (0: none)",
            name="--receiver-cache-bytes",
        ),
    )
    transfer: str = field(
        default="auto",
        metadata=flag(
            "how embeddings come back: auto (shared memory from encoders on this host, the Mooncake transfer "
            "engine from others where it is installed, else the stream), shm (shared memory or an error), "
            "mooncake (the transfer engine or an error), grpc (the stream only)",
            choices=TRANSFERS,
        ),
    )
    mooncake: MooncakeReceiverConfig = field(
        default_factory=MooncakeReceiverConfig, metadata=section(prefix="mooncake-")
    )
    seed: int | None = field(default=None, metadata=flag("seeds the random sharding across encoders", type=int))
    file_roots: tuple[Path, ...] | None = None  # directories `file://` items may be read from; None: any path
    # The embedding width precomputed items are checked against while no ModelInfo has been fetched (a
    # request of precomputed items only fetches none).
    hidden_size: int | None = None
    refresh_s: float = DEFAULT_REFRESH_S
    failover: FailoverPolicy = field(default_factory=FailoverPolicy)
    tls: ClientTls | None = None  # for grpcs:// encoders
    auth_token: str | None = None  # sent as `authorization: Bearer <token>` on every call

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.transfer not in TRANSFERS:
            raise ValueError(f"transfer must be one of {TRANSFERS}, got {self.transfer!r}")
        if self.balance < 1.0:
            raise ValueError(f"balance must be at least 1.0, got {self.balance}")
        if self.file_roots is not None:
            object.__setattr__(self, "file_roots", tuple(Path(root).resolve() for root in self.file_roots))


def add_credential_flags(parser: argparse.ArgumentParser) -> None:
    """The files a command reads the receiver's TLS credentials and bearer token from."""
    parser.add_argument("--tls-ca-file", default=None, help="PEM CAs to trust for grpcs:// encoders (default: the system's)")
    parser.add_argument("--tls-cert-file", default=None, help="PEM client certificate for mTLS to the encoders")
    parser.add_argument("--tls-key-file", default=None, help="PEM private key of --tls-cert-file")
    parser.add_argument(
        "--auth-token-file", default=None, help="file whose first line is the bearer token sent to the encoders"
    )


def credentials_from_args(args: argparse.Namespace) -> dict[str, ClientTls | str | None]:
    """`tls` and `auth_token` for a ReceiverConfig, read from the files `add_credential_flags` names."""
    return credentials_from_files(**{name: getattr(args, name) for name in CREDENTIAL_FILES})


# The files a receiver's credentials are read from, by the names of their flags' values.
CREDENTIAL_FILES = ("tls_ca_file", "tls_cert_file", "tls_key_file", "auth_token_file")


def credentials_from_files(
    *, tls_ca_file: str | None, tls_cert_file: str | None, tls_key_file: str | None, auth_token_file: str | None
) -> dict[str, ClientTls | str | None]:
    """`tls` and `auth_token` for a ReceiverConfig, read from PEM files and a file whose first line is the
    token (each None: not given)."""
    tls = None
    if tls_ca_file or tls_cert_file or tls_key_file:
        tls = ClientTls.from_files(ca_file=tls_ca_file, cert_file=tls_cert_file, key_file=tls_key_file)
    auth_token = None
    if auth_token_file:
        lines = Path(auth_token_file).read_text().splitlines()
        auth_token = lines[0].strip() if lines else ""
        if not auth_token:
            raise ValueError(f"{auth_token_file} holds no token")
    return {"tls": tls, "auth_token": auth_token}


def config_from_mapping(values: Mapping[str, Any], defaults: ReceiverConfig | None = None) -> ReceiverConfig:
    """A ReceiverConfig from JSON-like settings (vLLM's `ec_connector_extra_config`): keys are its fields'
    names (`failover`: a mapping of FailoverPolicy's), and the credentials come from files, under the keys of
    CREDENTIAL_FILES; the others keep `defaults`. An unknown key or a value of the wrong type is refused,
    naming it."""
    files = {name: values.get(name) for name in CREDENTIAL_FILES}
    settings = {key: value for key, value in values.items() if key not in files}
    config = _settings(ReceiverConfig, settings, defaults or ReceiverConfig(), exclude=("tls", "auth_token"))
    if any(files.values()):
        config = replace(config, **credentials_from_files(**files))
    return config


def _settings(cls: type, values: Mapping[str, Any], defaults: Any, *, exclude: tuple[str, ...] = ()) -> Any:
    """`defaults` (an instance of the dataclass `cls`) with the fields `values` names, each checked against its
    annotation: a number, text, a list of paths, or a mapping of a nested dataclass's fields."""
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(cls) if f.name not in exclude]
    changes = {}
    for key, value in values.items():
        if key not in known:
            extra = f", and the credential files {', '.join(CREDENTIAL_FILES)}" if cls is ReceiverConfig else ""
            raise ValueError(f"unknown receiver setting {key!r}; the settings are {', '.join(known)}{extra}")
        changes[key] = _value(key, hints[key], value, getattr(defaults, key))
    return replace(defaults, **changes)


def _value(key: str, hint: Any, value: Any, default: Any) -> Any:
    types = typing.get_args(hint) if isinstance(hint, types_module.UnionType) else (hint,)
    if value is None and type(None) in types:
        return None
    kind = next(t for t in types if t is not type(None))
    if is_dataclass(kind) and isinstance(value, Mapping):
        return _settings(kind, value, default)
    if typing.get_origin(kind) is tuple and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(Path(v) for v in value)
    numeric = kind in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool)
    if numeric and (kind is float or isinstance(value, int)):
        return kind(value)
    if kind is str and isinstance(value, str):
        return value
    raise ValueError(f"receiver setting {key!r} must be {_expected(kind)}, got {value!r}")


def _expected(kind: Any) -> str:
    if is_dataclass(kind):
        return f"a mapping of {kind.__name__}'s fields"
    if typing.get_origin(kind) is tuple:
        return "a list of paths"
    return {int: "an integer", float: "a number", str: "text"}[kind]
