"""TLS for the server: its certificate, and optionally the CA whose client certificates it requires (mTLS)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True, kw_only=True)
class TlsConfig:
    cert_file: str  # PEM certificate chain, leaf first
    key_file: str  # PEM private key of the leaf
    client_ca_file: str | None = None  # PEM CA bundle: when set, clients must present a certificate it signed

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
