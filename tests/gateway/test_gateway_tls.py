"""Optional TLS (and mTLS) on the gateway's public ports, over real sockets.

A throwaway CA and certificates are made per test with `trustme` (nothing is
committed); a real gateway serves gRPC and HTTP with them, in front of the
fake scheduler and a real Redis (tests/gateway/conftest.py).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import grpc.aio
import pytest
import trustme
from cryptography.hazmat.primitives import serialization
from gateway_fakes import GatewayFactory

from gateway.config import GatewayConfig, from_env_and_args
from gateway.service import GatewayService
from lemix._proto.lemix.v1 import gateway_pb2, gateway_pb2_grpc
from lemix.infra.rpc.client import channel
from lemix.infra.rpc.tls import client_tls, load_server_tls

DEADLINE_S = 10.0
REFUSED_DEADLINE_S = 3.0  # a refused handshake fails fast; this only bounds a hang


@dataclass(frozen=True)
class Pki:
    ca_file: str  # signed the gateway's certificate
    cert_file: str  # the gateway's chain, for 127.0.0.1 and localhost
    key_file: str
    client_ca_file: str  # signed `client_cert_file` (mTLS)
    client_cert_file: str
    client_key_file: str
    other_ca_file: str  # signed nothing here: a client trusting only it must fail


def _write_leaf(cert: trustme.LeafCert, cert_path: Path, key_path: Path) -> None:
    for i, blob in enumerate(cert.cert_chain_pems):
        blob.write_to_path(str(cert_path), append=i > 0)
    cert.private_key_pem.write_to_path(str(key_path))


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    server_ca, client_ca, other_ca = trustme.CA(), trustme.CA(), trustme.CA()
    _write_leaf(
        server_ca.issue_cert("127.0.0.1", "localhost"),
        tmp_path / "server.pem",
        tmp_path / "server.key",
    )
    _write_leaf(
        client_ca.issue_cert("lemix-test-client"), tmp_path / "client.pem", tmp_path / "client.key"
    )
    for name, ca in (("ca", server_ca), ("client-ca", client_ca), ("other-ca", other_ca)):
        ca.cert_pem.write_to_path(str(tmp_path / f"{name}.pem"))
    return Pki(
        *(
            str(tmp_path / name)
            for name in (
                "ca.pem",
                "server.pem",
                "server.key",
                "client-ca.pem",
                "client.pem",
                "client.key",
                "other-ca.pem",
            )
        )
    )


def _tls(pki: Pki, *, is_mtls: bool = False) -> dict[str, str]:
    """`make_gateway` overrides for a TLS (or mTLS) gateway."""
    overrides = {"tls_cert_file": pki.cert_file, "tls_key_file": pki.key_file}
    if is_mtls:
        overrides["tls_client_ca_file"] = pki.client_ca_file
    return overrides


async def _generate(
    ch: grpc.aio.Channel, deadline_s: float = DEADLINE_S
) -> list[gateway_pb2.GenerateResponse]:
    request = gateway_pb2.GenerateRequest(prompt="hello over tls", max_tokens=3)
    stub = gateway_pb2_grpc.GatewayStub(ch)
    return [r async for r in stub.Generate(request, timeout=deadline_s)]


def _client_ssl(ca_file: str, cert_file: str = "", key_file: str = "") -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_file)
    if cert_file:
        context.load_cert_chain(cert_file, key_file)
    return context


async def _get(url: str, ssl_context: ssl.SSLContext | bool = True) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=DEADLINE_S)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(url, ssl=ssl_context) as response,
    ):
        return response.status, await response.json()


# ------------------------------------------------------------------ gRPC


@pytest.mark.usefixtures("live_node")
async def test_grpc_generate_over_tls_with_the_ca(make_gateway: GatewayFactory, pki: Pki) -> None:
    gateway = await make_gateway(**_tls(pki))
    assert gateway.other_addresses == {"http": gateway.http_address, "tls": "tls"}
    async with channel(gateway.address, credentials=client_tls(pki.ca_file)) as ch:
        responses = await _generate(ch)
    assert sum(len(r.token_ids) for r in responses) == responses[-1].num_output_tokens == 3
    assert responses[-1].is_finished and responses[-1].finish_reason == "length"


@pytest.mark.usefixtures("live_node")
async def test_grpc_refuses_plaintext_and_an_untrusted_ca(
    make_gateway: GatewayFactory, pki: Pki
) -> None:
    gateway = await make_gateway(**_tls(pki))
    for credentials in (None, client_tls(pki.other_ca_file)):
        async with channel(gateway.address, credentials=credentials) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _generate(ch, REFUSED_DEADLINE_S)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE, credentials
    async with channel(gateway.address, credentials=client_tls(pki.ca_file)) as ch:
        # still serving after the failed handshakes
        assert (await _generate(ch))[-1].num_output_tokens == 3


# ------------------------------------------------------------------ HTTP


async def test_https_models_with_the_ca_and_plain_http_is_refused(
    make_gateway: GatewayFactory, pki: Pki
) -> None:
    gateway = await make_gateway(**_tls(pki))
    assert gateway.http_url == f"https://{gateway.http_address}"
    status, body = await _get(f"{gateway.http_url}/v1/models", _client_ssl(pki.ca_file))
    assert status == 200 and [m["id"] for m in body["data"]] == ["lemix"]
    with pytest.raises(aiohttp.ClientError):
        await _get(f"http://{gateway.http_address}/v1/models")
    with pytest.raises(aiohttp.ClientConnectorCertificateError):  # trusts another CA
        await _get(f"{gateway.http_url}/v1/models", _client_ssl(pki.other_ca_file))


async def test_https_accepts_tls_1_2_and_up_only(pki: Pki) -> None:
    context = load_server_tls(pki.cert_file, pki.key_file).ssl_context
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert context.verify_mode == ssl.CERT_NONE  # no client CA: no client certificate


# ------------------------------------------------------------------ mTLS


@pytest.mark.usefixtures("live_node")
async def test_mtls_refuses_a_client_without_a_certificate(
    make_gateway: GatewayFactory, pki: Pki
) -> None:
    gateway = await make_gateway(**_tls(pki, is_mtls=True))
    assert gateway.other_addresses["tls"] == "mtls"
    # gRPC: the CA alone is not enough; a certificate from the client CA is.
    async with channel(gateway.address, credentials=client_tls(pki.ca_file)) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _generate(ch, REFUSED_DEADLINE_S)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    with_cert = client_tls(
        pki.ca_file, cert_file=pki.client_cert_file, key_file=pki.client_key_file
    )
    async with channel(gateway.address, credentials=with_cert) as ch:
        assert (await _generate(ch))[-1].num_output_tokens == 3
    # HTTP: the same.
    url = f"{gateway.http_url}/v1/models"
    with pytest.raises(aiohttp.ClientError):
        await _get(url, _client_ssl(pki.ca_file))
    context = _client_ssl(pki.ca_file, pki.client_cert_file, pki.client_key_file)
    assert (await _get(url, context))[0] == 200


async def test_mtls_refuses_a_certificate_from_another_ca(
    make_gateway: GatewayFactory, pki: Pki
) -> None:
    # The gateway's own certificate is valid, but not signed by the client CA.
    gateway = await make_gateway(**_tls(pki, is_mtls=True))
    context = _client_ssl(pki.ca_file, pki.cert_file, pki.key_file)
    with pytest.raises(aiohttp.ClientError):
        await _get(f"{gateway.http_url}/v1/models", context)


# ------------------------------------------------------------------ config


def test_tls_options_come_from_env_and_flags(pki: Pki) -> None:
    env = {
        "LEMIX_GATEWAY_TLS_CERT_FILE": pki.cert_file,
        "LEMIX_GATEWAY_TLS_KEY_FILE": pki.key_file,
        "LEMIX_GATEWAY_TLS_CLIENT_CA_FILE": pki.client_ca_file,
    }
    config = from_env_and_args([], env=env)
    assert (config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file) == (
        pki.cert_file,
        pki.key_file,
        pki.client_ca_file,
    )
    assert config.is_tls_enabled
    flags = ["--tls-cert-file", "c.pem", "--tls-key-file", "k.pem"]
    config = from_env_and_args(flags, env={})
    assert (config.tls_cert_file, config.tls_key_file) == ("c.pem", "k.pem")
    assert not GatewayConfig().is_tls_enabled


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tls_cert_file": "c.pem"}, "tls_cert_file is set but tls_key_file is not"),
        ({"tls_key_file": "k.pem"}, "tls_key_file is set but tls_cert_file is not"),
        ({"tls_client_ca_file": "ca.pem"}, "tls_client_ca_file \\(mTLS\\) needs TLS"),
    ],
)
def test_tls_options_are_both_or_neither(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GatewayConfig(**kwargs)


async def _start_error(**kwargs: Any) -> str:
    """The error a gateway with these TLS files gives at start (before any I/O)."""
    service = GatewayService(GatewayConfig(**kwargs))
    with pytest.raises(ValueError) as info:
        await service.start()
    with pytest.raises(RuntimeError, match="not started"):
        service.port  # noqa: B018 (nothing was bound)
    return str(info.value)


async def test_start_names_a_missing_or_bad_file(pki: Pki, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    error = await _start_error(tls_cert_file=missing, tls_key_file=pki.key_file)
    assert error.startswith(f"--tls-cert-file: no such file {missing!r}")

    error = await _start_error(
        tls_cert_file=pki.cert_file, tls_key_file=pki.key_file, tls_client_ca_file=missing
    )
    assert error.startswith(f"--tls-client-ca-file: no such file {missing!r}")

    not_pem = tmp_path / "not.pem"
    not_pem.write_bytes(b"\x30\x82\x01\x0a binary DER")
    error = await _start_error(tls_cert_file=str(not_pem), tls_key_file=pki.key_file)
    assert "is not a PEM file" in error

    # A key that is not the certificate's (the client's key with the server's cert).
    error = await _start_error(tls_cert_file=pki.cert_file, tls_key_file=pki.client_key_file)
    assert "do not load as a certificate chain and its private key" in error

    error = await _start_error(tls_cert_file=str(tmp_path), tls_key_file=pki.key_file)
    assert "is a directory" in error


async def test_start_refuses_an_encrypted_key_instead_of_prompting(
    pki: Pki, tmp_path: Path
) -> None:
    # OpenSSL's default would prompt for a passphrase on the terminal (a hang).
    key = serialization.load_pem_private_key(Path(pki.key_file).read_bytes(), None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        )
    )
    error = await _start_error(tls_cert_file=pki.cert_file, tls_key_file=str(encrypted))
    assert "the key is encrypted; give an unencrypted PEM key" in error


def test_client_tls_names_a_missing_ca(tmp_path: Path) -> None:
    missing = str(tmp_path / "ca.pem")
    with pytest.raises(ValueError, match=f"--tls-ca-file: no such file '{missing}'"):
        client_tls(missing)
