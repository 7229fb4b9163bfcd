"""TLS, mTLS and bearer tokens on real servers, with certificates made by the test itself."""

from __future__ import annotations

import datetime
import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encoder_server.tls import TlsConfig
from receiver import ClientTls, EncodeFailedError, EncoderReceiver
from receiver.config import ReceiverConfig
from receiver.fleet.fetch import FetchFailedError
from receiver.vllm.connector import CONNECTOR_DEFAULTS, ConnectorSettings
from testkit.images import image_bytes
from testkit.launcher import launch_server
from testkit.servers import running_server

TOKEN = "s3cret-token-0123456789abcdef"


@dataclass
class Pem:
    cert: bytes
    key: bytes
    cert_file: Path
    key_file: Path


def _issue(dir_: Path, name: str, *, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None, server: bool) -> tuple[Pem, x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[0].subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    if issuer is None:  # a CA
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    else:
        builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if server:
            names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (dir_ / f"{name}.crt").write_bytes(cert_pem)
    (dir_ / f"{name}.key").write_bytes(key_pem)
    return Pem(cert_pem, key_pem, dir_ / f"{name}.crt", dir_ / f"{name}.key"), cert, key


@dataclass
class Pki:
    ca: Pem
    server: Pem
    client: Pem
    other_ca: Pem
    stranger: Pem  # a client certificate from another CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, ca_cert, ca_key = _issue(d, "ca", issuer=None, server=False)
    server, _, _ = _issue(d, "server", issuer=(ca_cert, ca_key), server=True)
    client, _, _ = _issue(d, "client", issuer=(ca_cert, ca_key), server=False)
    other_ca, other_cert, other_key = _issue(d, "other-ca", issuer=None, server=False)
    stranger, _, _ = _issue(d, "stranger", issuer=(other_cert, other_key), server=False)
    return Pki(ca, server, client, other_ca, stranger)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(f"old-token-being-rotated-out\n{TOKEN}\n")
    return path


def grpcs(server) -> str:
    return f"grpcs://127.0.0.1:{server.port}"


async def encode_one(rx: EncoderReceiver) -> int:
    result = await rx.encode("sec", [{"data": image_bytes(56, 56)}])
    return result.items[0].num_tokens


FAST_FAIL = dict(timeout=10.0)


async def test_tls_server_serves_grpcs_and_refuses_plaintext_and_unknown_cas(default_model_dir, pki):
    tls = TlsConfig(cert_file=str(pki.server.cert_file), key_file=str(pki.server.key_file))
    async with running_server(default_model_dir, tls=tls) as server:
        async with EncoderReceiver([grpcs(server)], tls=ClientTls(root_certificates=pki.ca.cert)) as rx:
            assert await encode_one(rx) == 4
        async with EncoderReceiver([server.url], **FAST_FAIL) as plaintext:  # grpc:// to a TLS port
            with pytest.raises(EncodeFailedError) as raised:
                await encode_one(plaintext)
        assert raised.value.code == grpc.StatusCode.UNAVAILABLE
        async with EncoderReceiver([grpcs(server)], tls=ClientTls(root_certificates=pki.other_ca.cert), **FAST_FAIL) as wrong_ca:
            with pytest.raises(EncodeFailedError) as raised:
                await encode_one(wrong_ca)
        assert raised.value.code == grpc.StatusCode.UNAVAILABLE


async def test_mtls_requires_a_client_certificate_from_the_configured_ca(default_model_dir, pki):
    tls = TlsConfig(
        cert_file=str(pki.server.cert_file), key_file=str(pki.server.key_file), client_ca_file=str(pki.ca.cert_file)
    )
    async with running_server(default_model_dir, tls=tls) as server:
        with_cert = ClientTls(root_certificates=pki.ca.cert, certificate_chain=pki.client.cert, private_key=pki.client.key)
        async with EncoderReceiver([grpcs(server)], tls=with_cert) as rx:
            assert await encode_one(rx) == 4
        for who, client in (
            ("no certificate", ClientTls(root_certificates=pki.ca.cert)),
            ("another CA's", ClientTls(root_certificates=pki.ca.cert, certificate_chain=pki.stranger.cert, private_key=pki.stranger.key)),
        ):
            async with EncoderReceiver([grpcs(server)], tls=client, **FAST_FAIL) as rx:
                with pytest.raises(EncodeFailedError) as raised:
                    await encode_one(rx)
            assert raised.value.code == grpc.StatusCode.UNAVAILABLE, who


async def test_bearer_token_required_health_open_and_token_never_logged(default_model_dir, token_file, caplog):
    caplog.set_level(logging.DEBUG)
    async with running_server(default_model_dir, auth_token_file=str(token_file)) as server:
        async with EncoderReceiver([server.url], auth_token=TOKEN) as rx:
            assert await encode_one(rx) == 4
        async with EncoderReceiver([server.url], auth_token="old-token-being-rotated-out") as rx:
            assert await encode_one(rx) == 4  # every token in the file is accepted
        for token in (None, "wrong", TOKEN + "x", TOKEN[:-1]):
            urls = [server.url, server.url.replace("127.0.0.1", "localhost")]
            async with EncoderReceiver(urls, auth_token=token) as rx:
                with pytest.raises(EncodeFailedError) as raised:
                    await encode_one(rx)
                assert raised.value.code == grpc.StatusCode.UNAUTHENTICATED, token
                assert "missing or invalid bearer token" in str(raised.value)
                assert "credentials" in raised.value.message
                # The caller's misconfiguration, not the encoder's failure: refused once, not tried on the
                # other encoder, and nobody benched.
                assert [a.status for a in raised.value.attempts[0]] == ["UNAUTHENTICATED"]
                assert rx.healthy_urls() == urls
        async with grpc.aio.insecure_channel(server.url.removeprefix("grpc://")) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(service="encoder.v1.EncoderService"))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
            info = channel.unary_unary("/encoder.v1.EncoderService/GetModelInfo")
            with pytest.raises(grpc.aio.AioRpcError) as raised_info:
                await info(b"")
            assert raised_info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert TOKEN not in caplog.text and "old-token" not in caplog.text


async def test_health_can_require_the_token_too(default_model_dir, token_file):
    async with running_server(default_model_dir, auth_token_file=str(token_file), auth_protect_health=True) as server:
        async with grpc.aio.insecure_channel(server.url.removeprefix("grpc://")) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.Check(health_pb2.HealthCheckRequest())
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
            reply = await stub.Check(health_pb2.HealthCheckRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_cli_flags_serve_mtls_with_a_token(default_model_dir, pki, token_file, tmp_path):
    """The same through `python -m encoder_server` flags, in a child process."""
    flags = [
        "--dtype", "float32",
        "--tls-cert-file", str(pki.server.cert_file),
        "--tls-key-file", str(pki.server.key_file),
        "--tls-client-ca-file", str(pki.ca.cert_file),
        "--auth-token-file", str(token_file),
    ]  # fmt: skip
    with launch_server(default_model_dir, *flags, log_dir=tmp_path) as proc:
        assert "mTLS, bearer token" in proc.log()
        client = ClientTls.from_files(ca_file=pki.ca.cert_file, cert_file=pki.client.cert_file, key_file=pki.client.key_file)
        url = f"grpcs://127.0.0.1:{proc.port}"
        async with EncoderReceiver([url], tls=client, auth_token=TOKEN) as rx:
            assert await encode_one(rx) == 4
        async with EncoderReceiver([url], tls=client, **FAST_FAIL) as rx:
            with pytest.raises(EncodeFailedError) as raised:
                await encode_one(rx)
        assert raised.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert TOKEN not in proc.log()


async def test_the_vllm_connector_settings_reach_an_mtls_encoder_with_a_token(default_model_dir, pki, token_file):
    """EncoderServiceConnector's receiver, configured from its `ec_connector_extra_config` alone, fetches an item
    leased on an encoder that asks for a client certificate and the token; without them the fetch is refused."""
    tls = TlsConfig(
        cert_file=str(pki.server.cert_file), key_file=str(pki.server.key_file), client_ca_file=str(pki.ca.cert_file)
    )
    async with running_server(default_model_dir, tls=tls, auth_token_file=str(token_file)) as server:
        extra = {
            "encoders": [grpcs(server)],
            "tls_ca_file": str(pki.ca.cert_file),
            "tls_cert_file": str(pki.client.cert_file),
            "tls_key_file": str(pki.client.key_file),
            "auth_token_file": str(token_file),
            "placement": "affinity",
            "failover": {"max_attempts": 2},
        }
        settings = ConnectorSettings.from_extra_config(extra)
        assert settings.receiver.timeout == CONNECTOR_DEFAULTS.timeout and settings.receiver.failover.max_attempts == 2
        async with EncoderReceiver(settings.encoders, settings.receiver) as rx:
            leased = await rx.encode("leased", [{"data": image_bytes(56, 56)}], lease_ms=30_000, withhold_payloads=True)
            key = leased.items[0].lease.key
            assert (await rx.fetch("fetch", key)).num_tokens == 4
            leased = await rx.encode("again", [{"data": image_bytes(56, 56)}], lease_ms=30_000, withhold_payloads=True)
        for dropped in (("auth_token_file",), ("tls_cert_file", "tls_key_file")):
            without = {key: value for key, value in extra.items() if key not in dropped}
            settings = ConnectorSettings.from_extra_config({**without, "timeout": 5})
            async with EncoderReceiver(settings.encoders, settings.receiver) as rx:
                with pytest.raises(FetchFailedError):
                    await rx.fetch("refused", leased.items[0].lease.key)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "needs ec_connector_extra_config"),
        ({"encoders": "grpc://a:1"}, "needs ec_connector_extra_config"),
        ({"encoders": ["grpc://a:1"], "fetch_timeout_s": 5}, "unknown receiver setting 'fetch_timeout_s'; the settings are timeout, "),
        ({"encoders": ["grpc://a:1"], "auth_token": "x"}, "unknown receiver setting 'auth_token'.*auth_token_file"),
        ({"encoders": ["grpc://a:1"], "timeout": "30"}, "'timeout' must be a number, got '30'"),
        ({"encoders": ["grpc://a:1"], "seed": True}, "'seed' must be an integer, got True"),
        ({"encoders": ["grpc://a:1"], "failover": {"tries": 2}}, "unknown receiver setting 'tries'; the settings are max_attempts"),
        ({"encoders": ["grpc://a:1"], "placement": "nearest"}, "placement must be one of"),
        ({"encoders": ["grpc://a:1"], "tls_cert_file": "c.pem"}, "No such file|a client certificate needs its private key"),
    ],
)
def test_the_vllm_connector_refuses_bad_settings_naming_them(extra, message):
    with pytest.raises((ValueError, OSError), match=message):
        ConnectorSettings.from_extra_config(extra)


def test_the_vllm_connector_takes_the_receivers_settings_by_their_names(tmp_path):
    settings = ConnectorSettings.from_extra_config(
        {"encoders": ["grpc://a:1"], "directory": str(tmp_path), "timeout": 5, "seed": 3, "file_roots": ["/srv"]}
    )
    assert settings.directory == tmp_path
    assert settings.receiver == ReceiverConfig(timeout=5.0, seed=3, file_roots=(Path("/srv"),))
