"""TLS for the server: its certificate, and optionally the CA whose client certificates it requires (mTLS)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc

from encoder_common.env_flags import flag


@dataclass(frozen=True, kw_only=True)
class TlsConfig:
    cert_file: str = field(  # leaf first
        metadata=flag("PEM certificate chain: serve TLS (with --tls-key-file)")
    )
    key_file: str = field(metadata=flag("PEM private key of --tls-cert-file"))
    client_ca_file: str | None = field(
        default=None, metadata=flag("PEM CA: require client certificates it signed (mTLS)")
    )

    def __post_init__(self) -> None:
        missing = [name for name, value in (("--tls-cert-file", self.cert_file), ("--tls-key-file", self.key_file)) if not value]
        if missing:
            needs = "--tls-client-ca-file needs" if self.client_ca_file else "TLS needs"
            raise ValueError(f"{needs} both --tls-cert-file and --tls-key-file; {' and '.join(missing)} not given")

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        def read(path: str) -> bytes:
            try:
                return Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"cannot read TLS file {path}: {exc.strerror or exc}") from None

        return grpc.ssl_server_credentials(
            [(read(self.key_file), read(self.cert_file))],
            root_certificates=read(self.client_ca_file) if self.client_ca_file else None,
            require_client_auth=self.mutual,
        )
