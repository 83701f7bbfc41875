"""HTTPS for a dashboard that listens beyond loopback: a fresh self-signed certificate (ECDSA P-256, which
browsers accept) made when the server starts, never written anywhere but a private temporary file that
is removed once loaded. Its SHA-256 fingerprint is printed with the URL, so that the user can check the
certificate the browser warns about is the one this program made."""
from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import ssl
import tempfile
from typing import Tuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["server_context"]


def _names(host: str) -> list:
    names: list = [x509.DNSName("localhost")]
    for h in {host, "127.0.0.1"}:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            if h:
                names.append(x509.DNSName(h))
    return names


def server_context(host: str) -> Tuple[ssl.SSLContext, str]:
    """A TLS server context with a new self-signed certificate for ``host``, and the certificate's
    SHA-256 fingerprint (hex, colon-separated)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "roving dashboard")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName(_names(host)), critical=False)
            .sign(key, hashes.SHA256()))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()) + cert.public_bytes(serialization.Encoding.PEM)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    folder = tempfile.mkdtemp(prefix="roving-dashboard-tls-")
    try:  # ssl loads a chain from files only
        path = os.path.join(folder, "cert.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        ctx.load_cert_chain(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    digest = cert.fingerprint(hashes.SHA256()).hex()
    return ctx, ":".join(digest[i:i + 2] for i in range(0, len(digest), 2)).upper()
