"""TLS material for LeMix's public listeners, read from PEM files once, at start.

    tls = load_server_tls(cert_file, key_file, client_ca_file)  # ValueError: which file, why
    await start_server(..., server_credentials=tls.grpc_credentials())
    await start_http(..., ssl_context=tls.ssl_context)

    async with channel(address, credentials=client_tls(ca_file)) as ch: ...

One certificate and key serve both the gRPC port and the HTTP port. With a
client CA (mTLS) both ports require a client certificate signed by it. Both
accept TLS 1.2 and 1.3 only: the HTTP side sets `minimum_version`; gRPC core's
own floor is TLS 1.2 already (Python's grpcio does not expose the setting).

Reading every file up front, and building the `ssl.SSLContext` (which checks
that the key matches the certificate), turns a wrong path, a non-PEM file or a
mismatched pair into one error at start naming the file, rather than a failed
handshake on every connection later.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc

_PEM_MARKER = b"-----BEGIN "
_OPENSSL_HINT = (
    "e.g. openssl req -x509 -newkey rsa:2048 -nodes -keyout key.pem "
    "-out cert.pem -subj /CN=HOST -addext subjectAltName=DNS:HOST"
)


def read_pem(what: str, path: str) -> bytes:
    """The bytes of PEM file `path`; ValueError naming `what` (e.g. "--tls-cert-file"),
    the path and the fix when it is missing, unreadable or not PEM."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ValueError(
            f"{what}: no such file {path!r} (mount the file there or fix the path)"
        ) from None
    except IsADirectoryError:
        raise ValueError(f"{what}: {path!r} is a directory; give the PEM file inside it") from None
    except PermissionError:
        raise ValueError(
            f"{what}: cannot read {path!r} (permission denied): make it "
            f"readable by the service's user"
        ) from None
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path!r}: {exc.strerror or exc}") from None
    if _PEM_MARKER not in data:
        raise ValueError(
            f"{what}: {path!r} is not a PEM file (no '-----BEGIN' line); "
            f"convert it, e.g. openssl x509 -inform DER -in FILE -out FILE.pem"
        )
    return data


def _refuse_encrypted_key() -> bytes:
    # Without a password callback OpenSSL would prompt on the terminal and a
    # service would hang at start; gRPC cannot use an encrypted key anyway.
    raise ValueError(
        "the key is encrypted; give an unencrypted PEM key (keep it in a "
        "secret volume readable only by the service)"
    )


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate chain, key and (mTLS) client CA, read and checked."""

    cert_chain_pem: bytes
    private_key_pem: bytes = field(repr=False)
    client_ca_pem: bytes | None  # None: clients need no certificate
    # For the HTTP listener (aiohttp): the same files, TLS 1.2+.
    ssl_context: ssl.SSLContext = field(repr=False)

    @property
    def is_client_cert_required(self) -> bool:
        return self.client_ca_pem is not None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Credentials for `grpc.aio.Server.add_secure_port`."""
        return grpc.ssl_server_credentials(
            [(self.private_key_pem, self.cert_chain_pem)],
            root_certificates=self.client_ca_pem,
            require_client_auth=self.is_client_cert_required,
        )


def load_server_tls(cert_file: str, key_file: str, client_ca_file: str = "") -> ServerTls:
    """Read and check the PEM files. ValueError names the file (by its flag,
    e.g. --tls-cert-file) and what to do."""
    cert_flag, key_flag, ca_flag = "--tls-cert-file", "--tls-key-file", "--tls-client-ca-file"
    cert_pem = read_pem(cert_flag, cert_file)
    key_pem = read_pem(key_flag, key_file)
    ca_pem = read_pem(ca_flag, client_ca_file) if client_ca_file else None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # no system CAs: only ours verify
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file, password=_refuse_encrypted_key)
    except ssl.SSLError as exc:
        raise ValueError(
            f"{cert_flag} {cert_file!r} and {key_flag} {key_file!r} do not "
            f"load as a certificate chain and its private key ({exc.reason or exc}"
            f"): check that the key belongs to the certificate and the "
            f"certificate comes first; {_OPENSSL_HINT}"
        ) from None
    except ValueError as exc:
        raise ValueError(f"{key_flag} {key_file!r}: {exc}") from None
    if ca_pem is not None:
        try:
            context.load_verify_locations(cadata=ca_pem.decode("ascii", "replace"))
        except ssl.SSLError as exc:
            raise ValueError(
                f"{ca_flag} {client_ca_file!r} holds no usable CA certificate ({exc.reason or exc})"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return ServerTls(cert_pem, key_pem, ca_pem, context)


def client_tls(ca_file: str, *, cert_file: str = "", key_file: str = "") -> grpc.ChannelCredentials:
    """Channel credentials trusting the CA in `ca_file` (PEM), for
    `lemix.infra.rpc.client.channel(..., credentials=...)`; with `cert_file` and
    `key_file`, also a client certificate (a gateway that requires mTLS).
    ValueError names the file and the fix."""
    if bool(cert_file) != bool(key_file):
        raise ValueError("a client certificate needs both cert_file and key_file")
    ca_pem = read_pem("--tls-ca-file", ca_file)
    cert_pem = read_pem("client certificate", cert_file) if cert_file else None
    key_pem = read_pem("client key", key_file) if key_file else None
    return grpc.ssl_channel_credentials(
        root_certificates=ca_pem, private_key=key_pem, certificate_chain=cert_pem
    )
