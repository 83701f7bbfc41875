"""The session's keys for encrypted, integrity-protected connections, derived from its secret.

Every process of a session knows the session secret (:mod:`roving.transport.session`), so each one
derives the same keys by itself, with HKDF-SHA256 (RFC 5869) and a distinct label per key; nothing but
the secret ever has to be handed over:

* **ZeroMQ: CurveZMQ.** One CURVE key pair for the nodes (servers) and one for their clients. A node's
  ROUTER accepts only the session's client key (:mod:`roving.transport.zap`), so a stranger never
  completes the ZeroMQ handshake; a client accepts only the session's server key.
* **Streams: TLS 1.3** (Python's :mod:`ssl`, mutual). An Ed25519 key pair and a self-signed certificate
  made from it, the same in every process of the session; it is the only trust anchor of both sides,
  so a peer is accepted only if it holds the session's private key. Host names are not checked: the
  key pins the peer.

Which connections are encrypted is the ``encrypt`` option (:func:`mode`): ``auto`` (the default)
encrypts every stream whose address is not loopback and runs every ZeroMQ socket with CURVE (which also
keeps strangers out of the ZeroMQ handshake, on loopback too); ``always`` encrypts everything; ``off``
nothing (logged when a connection leaves loopback). roving's HMAC handshake (:mod:`.auth`) runs on top
of either, unchanged.
"""
from __future__ import annotations

import datetime
import logging
import os
import shutil
import ssl
import tempfile
import threading
from typing import Dict, NamedTuple, Tuple

import zmq
from zmq.utils import z85
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import NameOID

from .addressing import is_loopback

log = logging.getLogger(__name__)


def mode() -> str:
    """The ``encrypt`` option in force in this process."""
    from .. import config  # late: config is imported by much of roving

    return config.current().encrypt


def derive(secret: bytes, label: str, length: int = 32) -> bytes:
    """A key of ``length`` bytes for ``label``, derived from the session secret (HKDF-SHA256)."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=b"roving-session-keys",
                info=label.encode()).derive(secret)


class CurveKeys(NamedTuple):
    """The session's CURVE keys, Z85-encoded as ZeroMQ's socket options take them."""
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


_curve_cache: Dict[bytes, CurveKeys] = {}
_tls_cache: Dict[bytes, Tuple[ssl.SSLContext, ssl.SSLContext]] = {}
_cache_lock = threading.Lock()


def curve_keys(secret: bytes) -> CurveKeys:
    """The session's CURVE server and client key pairs."""
    keys = _curve_cache.get(secret)
    if keys is None:
        server_secret = z85.encode(derive(secret, "curve-server"))
        client_secret = z85.encode(derive(secret, "curve-client"))
        keys = CurveKeys(zmq.curve_public(server_secret), server_secret,
                         zmq.curve_public(client_secret), client_secret)
        _curve_cache[secret] = keys
    return keys


def curve_server(sock: zmq.Socket, secret: bytes) -> None:
    """Make ``sock`` a CURVE server with the session's key (before it binds)."""
    keys = curve_keys(secret)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)


def curve_client(sock: zmq.Socket, secret: bytes) -> None:
    """Make ``sock`` a CURVE client that accepts only the session's server key (before it connects)."""
    keys = curve_keys(secret)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


def _certificate(secret: bytes) -> Tuple[bytes, bytes]:
    """The session's private key and self-signed certificate (PEM), the same in every process."""
    key = ed25519.Ed25519PrivateKey.from_private_bytes(derive(secret, "tls-ed25519"))
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "roving session")])
    public = key.public_key()
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name).public_key(public)
            .serial_number(1)
            .not_valid_before(datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc))
            .not_valid_after(datetime.datetime(9999, 12, 31, tzinfo=datetime.timezone.utc))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, None))  # Ed25519 signatures are deterministic: so is the certificate
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def _context(side: int, key_pem: bytes, cert_pem: bytes) -> ssl.SSLContext:
    ctx = ssl.SSLContext(side)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=cert_pem.decode())
    # ssl loads a certificate chain from files only: a private folder that is gone once read
    folder = tempfile.mkdtemp(prefix="roving-tls-")
    try:
        path = os.path.join(folder, "session.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key_pem + cert_pem)
        ctx.load_cert_chain(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if side == ssl.PROTOCOL_TLS_SERVER:
        ctx.num_tickets = 0  # no resumption: every stream makes a full, mutually verified handshake
    return ctx


def tls_contexts(secret: bytes) -> Tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) TLS 1.3 contexts: mutual, the session's certificate the only trust anchor."""
    contexts = _tls_cache.get(secret)
    if contexts is None:
        with _cache_lock:
            contexts = _tls_cache.get(secret)
            if contexts is None:
                key_pem, cert_pem = _certificate(secret)
                contexts = (_context(ssl.PROTOCOL_TLS_SERVER, key_pem, cert_pem),
                            _context(ssl.PROTOCOL_TLS_CLIENT, key_pem, cert_pem))
                _tls_cache[secret] = contexts
    return contexts


_warned_off: set = set()


def stream_encrypted(host: str, encrypt: str) -> bool:
    """Whether a stream to or from ``host`` is encrypted under the ``encrypt`` option."""
    if encrypt == "always":
        return True
    loopback = is_loopback(host)
    if encrypt == "off":
        if not loopback and host not in _warned_off:
            _warned_off.add(host)
            log.warning("roving: encrypt='off': traffic with %s leaves loopback in plain text, without "
                        "integrity protection", host)
        return False
    return not loopback


def zmq_encrypted(encrypt: str, host: str = "127.0.0.1") -> bool:
    """Whether ZeroMQ sockets run CURVE under the ``encrypt`` option (all of them, or none); ``host``
    is the address bound or connected to (warned about once when ``off`` lets traffic leave loopback)."""
    if encrypt == "off":
        if not is_loopback(host) and ("zmq", host) not in _warned_off:
            _warned_off.add(("zmq", host))
            log.warning("roving: encrypt='off': ZeroMQ traffic with %s is plain text; strangers that reach "
                        "a node's port can hold connections and memory until they fail to authenticate",
                        host)
        return False
    return True
