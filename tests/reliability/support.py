"""Helpers for the reliability tests: a real service process with any settings (TLS and bearer
tokens included), certificates made here with ``cryptography``, and tokens files.

The service is ``python -m advantage_service serve`` on free loopback ports, waited for by
polling ``/readyz`` (HTTPS when TLS is on) and the gRPC health service.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import ssl
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from process_support import ServiceProcess, launch_service

# ---- certificates -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tls:
    """PEM files: a CA, a server certificate for 127.0.0.1/localhost, a client certificate
    (both signed by the CA), and a client certificate from another CA (to be refused)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    rogue_key: Path

    def client_context(self, *, client: bool = True, rogue: bool = False) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        if rogue:
            context.load_cert_chain(self.rogue_cert, self.rogue_key)
        elif client:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context

    def channel_credentials(
        self, *, client: bool = True, rogue: bool = False
    ) -> grpc.ChannelCredentials:
        cert, key = (
            (self.rogue_cert, self.rogue_key) if rogue else (self.client_cert, self.client_key)
        )
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=key.read_bytes() if client or rogue else None,
            certificate_chain=cert.read_bytes() if client or rogue else None,
        )


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: str,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        ).add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def make_tls(directory: Path) -> Tls:
    """A fresh CA with server and client certificates, and a rogue CA's client certificate."""
    directory.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}

    def save(name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        paths[name] = directory / f"{name}.pem"
        paths[name].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{name}_key"] = directory / f"{name}-key.pem"
        _write_key(paths[f"{name}_key"], key)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    save("ca", _certificate("test CA", ca_key, "test CA", ca_key, ca=True), ca_key)
    server_key = ec.generate_private_key(ec.SECP256R1())
    save(
        "server", _certificate("localhost", server_key, "test CA", ca_key, server=True), server_key
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    save("client", _certificate("trainer", client_key, "test CA", ca_key), client_key)
    rogue_ca_key = ec.generate_private_key(ec.SECP256R1())
    rogue_key = ec.generate_private_key(ec.SECP256R1())
    save("rogue", _certificate("intruder", rogue_key, "rogue CA", rogue_ca_key), rogue_key)
    return Tls(
        ca=paths["ca"],
        server_cert=paths["server"],
        server_key=paths["server_key"],
        client_cert=paths["client"],
        client_key=paths["client_key"],
        rogue_cert=paths["rogue"],
        rogue_key=paths["rogue_key"],
    )


# ---- tokens -------------------------------------------------------------------------------------


def write_tokens(path: Path, tokens: Mapping[str, list[str]]) -> Path:
    """A tokens file, written atomically (a reader never sees half of it)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"tokens": dict(tokens)}))
    os.replace(tmp, path)
    return path


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


# ---- the service --------------------------------------------------------------------------------


class Service(ServiceProcess):
    """One running service process (HTTP and gRPC on one engine)."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        http_port: int,
        grpc_port: int,
        log: Path,
        tls: Tls | None,
        mutual: bool,
    ) -> None:
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.scheme = "https" if tls is not None else "http"
        self.target = f"127.0.0.1:{grpc_port}"
        self.tls = tls
        self.mutual = mutual
        verify: ssl.SSLContext | bool = (
            tls.client_context(client=mutual) if tls is not None else True
        )
        url = f"{self.scheme}://127.0.0.1:{http_port}"
        super().__init__(proc, url, log, httpx.Client(base_url=url, timeout=60.0, verify=verify))

    def channel(self, **options: Any) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(self.target)
        return grpc.secure_channel(
            self.target, self.tls.channel_credentials(client=self.mutual, **options)
        )

    def grpc_health(self) -> int | None:
        with self.channel() as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                return int(stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status)
            except grpc.RpcError:
                return None

    def also_ready(self) -> bool:
        return self.grpc_health() == health_pb2.HealthCheckResponse.SERVING

    def access_lines(self) -> list[dict[str, Any]]:
        """The JSON access lines the service has logged so far."""
        lines = []
        for line in self.output().splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("logger") == "advantage_service.access":
                    lines.append(record)
        return lines


# Tests that start a service they expect to fail use ``launch`` directly.
launch = launch_service


def start_service(
    directory: Path, *, tls: Tls | None = None, mutual: bool = False, **settings: Any
) -> Service:
    """A ready service with ``ADV_<NAME>`` settings; HTTPS and gRPC TLS with ``tls`` (mutual
    TLS when ``mutual``)."""
    directory.mkdir(parents=True, exist_ok=True)
    if tls is not None:
        settings.update(tls_cert=tls.server_cert, tls_key=tls.server_key)
        if mutual:
            settings["tls_client_ca"] = tls.ca
    proc, http_port, grpc_port, log = launch_service(directory, settings)
    service = Service(proc, http_port, grpc_port, log, tls, mutual)
    service.ready_or_killed()
    return service
