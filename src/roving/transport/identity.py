"""Who each process of a session is: the session's certificate authority, every process's own
credentials, the proof a peer gives of them, and revocation.

* **The session CA.** The program that starts a session (the root, the process without a parent) makes
  its secret; from it, two keys that nothing else can make: the *member secret* that every process of
  the session proves it holds on every connection (:mod:`.auth`), and the Ed25519 key of the session's
  certificate authority (:class:`Authority`), which only the root holds. A child never learns the root's
  secret, so no child can make the CA's key.
* **Every process its own credentials.** The parent has the CA issue a :class:`Grant` for each child it
  starts, before the job is made: a fresh 32-byte seed (the child's Ed25519 identity key and its CURVE key
  pair are derived from it) and a certificate that names the child's node id (its uid) and its *node
  key* (its CURVE public key, which every address of its node carries: ``tcp://HOST:PORT#KEY``), valid
  for :data:`LIFETIME`. The seed travels with the member secret (the job's secret variable or file),
  the certificates with the rest of what a child is told. A child whose own children need credentials
  asks the CA over its authenticated connection (:class:`Issuer`). The CA issues a node id once.
* **Proof on every connection.** On top of the member secret's proof, each side of every stream and
  ZeroMQ connection sends its certificate and an Ed25519 signature over both handshake nonces, the
  direction and the key of the node the client meant to reach (:meth:`Credentials.prove` /
  :meth:`Credentials.check`): a peer is who its certificate names, a signature made for one node is
  worth nothing at another, and a client checks that the node it reached has the key its address names
  (:func:`node_key`) — a stream relayed to another node of the same session is refused. Under CURVE the
  client also pins the node's key in ZeroMQ's own handshake. What each side learns of the other is a
  :class:`Peer`, which the node keeps for every message it receives on that connection.
* **Revocation.** :func:`revoke` marks a node id revoked in this process: its certificate is refused on
  new connections from then on, and each node of this process closes the connections that were opened
  with it (:func:`on_revoke`). The pool revokes a worker it declares lost.

Nodes and connections made from raw secret bytes (a manager's ``authkey``, tests) use an *ad hoc* CA
and identity derived from those bytes (:func:`credentials`): whoever knows the bytes is that identity
and can issue under it.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import datetime
import os
import shutil
import ssl
import tempfile
import threading
import weakref
from typing import Any, Dict, Optional, Protocol, Tuple, Union, cast

import zmq
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import NameOID
from zmq.utils import z85

from .errors import IdentityError

#: How long a certificate is valid: a session that runs longer has its processes refused from then on.
LIFETIME = datetime.timedelta(days=30)
_SKEW = datetime.timedelta(minutes=10)  # clocks of the session's machines may differ by this much
_KEY_URI = "roving-node:"  # the certificate's subjectAltName URI that names the node key
#: The subjectAltName URI that marks an untrusted process's certificate (a pipeline node's: see Peer.trusted).
_UNTRUSTED_URI = "roving-role:untrusted"
#: What a signature is over, by direction (so that one made as a client is never taken as a node's).
_AS_NODE, _AS_CLIENT = b"roving-identity-node", b"roving-identity-client"
SIGNATURE_BYTES = 64
_CHECKED_MAX = 65536  # certificates whose check is remembered


def derive(secret: bytes, label: str, length: int = 32) -> bytes:
    """A key of ``length`` bytes for ``label``, derived from ``secret`` (HKDF-SHA256)."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=b"roving-session-keys",
                info=label.encode()).derive(secret)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def node_key(address: str) -> Optional[str]:
    """The node key an address names (``tcp://HOST:PORT#KEY``), or None when it names none."""
    _, mark, key = address.partition("#")
    return key if mark and key else None


def expected_key(address: str, creds: "Credentials") -> Optional[str]:
    """The node key a connection to ``address`` must find: the one the address names; with ad hoc
    credentials and an address that names none, their own (None: any node of the session)."""
    key = node_key(address)
    return creds.key if key is None and creds.ad_hoc else key


def bare(address: str) -> str:
    """The address without the node key: what a socket connects to."""
    return address.partition("#")[0]


def curve_server_key(key: str) -> bytes:
    """A node key as ZeroMQ's CURVE_SERVERKEY option takes it (Z85)."""
    raw = _unb64(key)
    if len(raw) != 32:
        raise IdentityError(f"{key!r} is not a roving node key")
    return z85.encode(raw)


@dataclasses.dataclass(frozen=True)
class Peer:
    """Who is at the other end of a connection, as its certificate says (checked against the CA)."""
    #: The process's node id (its uid in the session).
    node_id: str
    #: Its node key: the CURVE public key of its node, which the node's addresses name.
    key: str
    #: False for a process its certificate marks untrusted (:meth:`Authority.issue`): one that may run
    #: code of its own, as a crowdsourced pipeline node. A node serves such a peer only the mailboxes
    #: made for it or open to untrusted writers (:mod:`.boxes`), and nothing else; the CA issues it
    #: nothing (:mod:`.issuer`).
    trusted: bool = True


@dataclasses.dataclass(frozen=True)
class Grant:
    """What the CA issues for one process: its seed (secret) and its certificate and the CA's (PEM)."""
    node_id: str
    seed: bytes
    cert_pem: str
    ca_pem: str

    def public(self) -> Dict[str, str]:
        """The parts a child may be told in the open."""
        return {"cert": self.cert_pem, "ca": self.ca_pem}


def public_keys(seed: bytes) -> Tuple[bytes, str]:
    """The public halves of the keys made from ``seed``: the Ed25519 identity key (32 raw bytes) and
    the node key, as :meth:`Authority.certify` takes them."""
    identity_key, curve_public, _ = _keys(seed)
    raw = identity_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return raw, _b64(z85.decode(curve_public))


def ca_fingerprint(ca_pem: str) -> str:
    """The SHA-256 of a CA certificate (hex): what a process that joins from outside is told to expect."""
    der = x509.load_pem_x509_certificate(ca_pem.encode()).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(der).hexdigest()


def _keys(seed: bytes) -> Tuple[ed25519.Ed25519PrivateKey, bytes, bytes]:
    """A process's Ed25519 identity key and CURVE key pair (Z85 public, secret), made from its seed."""
    curve_secret = z85.encode(derive(seed, "curve-node"))
    return (ed25519.Ed25519PrivateKey.from_private_bytes(derive(seed, "identity-ed25519")),
            zmq.curve_public(curve_secret), curve_secret)


class Authority:
    """The session's certificate authority (only the root process holds one): issues each node id once."""

    def __init__(self, seed: bytes, name: str = "roving session CA") -> None:
        self._key = ed25519.Ed25519PrivateKey.from_private_bytes(derive(seed, "session-ca"))
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        public = self._key.public_key()
        now = datetime.datetime.now(datetime.timezone.utc)
        self.ca_pem = (x509.CertificateBuilder()
                       .subject_name(self._name).issuer_name(self._name).public_key(public)
                       .serial_number(x509.random_serial_number())
                       .not_valid_before(now - _SKEW).not_valid_after(now + LIFETIME + _SKEW)
                       .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                       .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                                      critical=True)
                       .sign(self._key, None)).public_bytes(serialization.Encoding.PEM).decode()
        self._issued: Dict[str, str] = {}  # node id -> its node key
        self._lock = threading.Lock()

    def issue(self, node_id: str, seed: Optional[bytes] = None, trusted: bool = True) -> Grant:
        """Credentials for the process ``node_id`` (made from ``seed``, default: a fresh one), marked
        untrusted unless ``trusted`` (:attr:`Peer.trusted`); IdentityError when that id was issued
        before (one process cannot be given another's id)."""
        seed = os.urandom(32) if seed is None else seed
        identity_key, curve_public, _ = _keys(seed)
        cert_pem = self._certify(node_id, identity_key.public_key(), _b64(z85.decode(curve_public)), trusted)
        return Grant(node_id, seed, cert_pem, self.ca_pem)

    def certify(self, node_id: str, identity_public: bytes, node_key: str, trusted: bool = True) -> str:
        """A certificate (PEM) for keys a process made itself and holds alone: its Ed25519 identity key
        (``identity_public``, 32 raw bytes) and its node key (``node_key``, :attr:`Credentials.key`):
        what a process that joins from outside gets (:func:`public_keys` makes both from its seed).
        IdentityError when the id was issued before or the keys are not keys."""
        try:
            public = ed25519.Ed25519PublicKey.from_public_bytes(bytes(identity_public))
            if len(_unb64(node_key)) != 32:
                raise ValueError("a node key is 32 bytes")
        except (ValueError, TypeError) as exc:
            raise IdentityError(f"not a process's public keys: {exc}") from None
        return self._certify(node_id, public, node_key, trusted)

    def _certify(self, node_id: str, public: ed25519.Ed25519PublicKey, key: str, trusted: bool) -> str:
        if not node_id or len(node_id) > 128 or not node_id.isprintable():
            raise IdentityError(f"not a node id: {node_id!r}")
        with self._lock:
            if node_id in self._issued:
                raise IdentityError(f"the node id {node_id!r} was issued already: one process cannot be "
                                    "given another's identity")
            self._issued[node_id] = key
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
                .issuer_name(self._name).public_key(public)
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - _SKEW).not_valid_after(now + LIFETIME)
                .add_extension(x509.SubjectAlternativeName(
                    [x509.UniformResourceIdentifier(_KEY_URI + key)]
                    + ([] if trusted else [x509.UniformResourceIdentifier(_UNTRUSTED_URI)])), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .sign(self._key, None))
        return cert.public_bytes(serialization.Encoding.PEM).decode()


class Credentials:
    """One process's credentials in one session: the member secret (:attr:`secret`), its own identity
    key, certificate and CURVE key pair, and the CA's certificate it checks peers against. ``authority``
    is the CA itself, in the root only."""

    def __init__(self, secret: bytes, grant: Grant, authority: Optional[Authority] = None,
                 ad_hoc: bool = False, session_client_key: Optional[bytes] = None) -> None:
        #: Whether this process holds the session's member secret. One that does not
        #: (:meth:`certificate_only`) authenticates by its certificate alone, which must mark it untrusted.
        self.member = session_client_key is None
        #: The member secret; a process that is not a member holds random bytes of its own here, which
        #: prove nothing to anyone (its connections are taken on its certificate, :mod:`.auth`).
        self.secret = secret
        #: Where this process is not a member: the public half of the session's shared CURVE client key
        #: (Z85), which its node accepts from members (:mod:`.crypto`); None for a member.
        self.session_client_key = session_client_key
        #: Made from raw secret bytes (:func:`credentials`): every process that holds them is this one
        #: identity, so an address that names no node key is taken to name this one's.
        self.ad_hoc = ad_hoc
        self.node_id = grant.node_id
        self.authority = authority
        self._identity_key, self.curve_public, self.curve_secret = _keys(grant.seed)
        #: This process's node key (what its node's addresses name after ``#``).
        self.key = _b64(z85.decode(self.curve_public))
        self._seed = grant.seed
        self.cert_pem, self.ca_pem = grant.cert_pem, grant.ca_pem
        cert = x509.load_pem_x509_certificate(grant.cert_pem.encode())
        ca = x509.load_pem_x509_certificate(grant.ca_pem.encode())
        self.cert_der = cert.public_bytes(serialization.Encoding.DER)
        self._ca_public = cast(ed25519.Ed25519PublicKey, ca.public_key())  # the session CA's keys are Ed25519
        self._ca_name = ca.subject
        self._checked: Dict[bytes, Tuple[Peer, datetime.datetime, Any]] = {}  # certificate (DER) -> whom it names
        self._tls: Optional[Tuple[ssl.SSLContext, ssl.SSLContext]] = None
        self._lock = threading.Lock()
        mine = self.check_certificate(self.cert_der)
        if mine.key != self.key or mine.node_id != self.node_id:
            raise IdentityError("the certificate given does not name this process's keys")
        #: False when this process's own certificate marks it untrusted (:attr:`Peer.trusted`).
        self.trusted = mine.trusted
        if not self.member and self.trusted:
            raise IdentityError("credentials without the member secret must carry a certificate marked "
                                "untrusted: only members are trusted")

    @classmethod
    def certificate_only(cls, grant: Grant, session_client_key: bytes) -> "Credentials":
        """Credentials that hold no secret of the session: this process's own keys (``grant.seed``) and
        the untrusted certificate the CA gave for them, with the session's shared CURVE client key's
        public half (``session_client_key``, Z85), so that members can reach this process's node. What a
        node that joins through a pipeline's open door holds: its certificate and nothing more.
        IdentityError when the certificate does not mark the process untrusted."""
        return cls(os.urandom(32), grant, session_client_key=bytes(session_client_key))

    def private_part(self) -> str:
        """What a child needs, besides the member secret, to be this identity: its seed (hex)."""
        return self._seed.hex()

    # -- proof on connections ------------------------------------------------------------------------
    def prove(self, as_node: bool, client_nonce: bytes, node_nonce: bytes, node: str,
              binding: bytes = b"") -> bytes:
        """This process's signature for one handshake (``node``: the node key the client meant to reach;
        ``binding``: what names the connection it is made on, as this side sees it, or nothing)."""
        return self._identity_key.sign(_context(as_node, client_nonce, node_nonce, node, binding))

    def check(self, cert_der: bytes, signature: bytes, as_node: bool, client_nonce: bytes,
              node_nonce: bytes, node: Optional[str] = None, binding: bytes = b"") -> Peer:
        """The peer that signed this handshake with ``cert_der``'s key (``node``: the node key the
        client signed for; a node signs for its own; ``binding``: the connection, as this side sees
        it, that the signature must name); IdentityError when the certificate is not the session CA's,
        has expired or was revoked, or the signature is not over this handshake."""
        peer, public = self._checked_peer(cert_der)
        try:
            public.verify(bytes(signature), _context(as_node, client_nonce, node_nonce,
                                                     peer.key if node is None else node, binding))
        except InvalidSignature:
            if binding:
                raise IdentityError(f"the peer's signature is not {peer.node_id}'s over this connection (a relay "
                                    "between the two, whose legs have other addresses, cannot make one)") from None
            raise IdentityError(f"the peer did not prove that it holds the key of {peer.node_id}'s certificate") \
                from None
        return peer

    def check_certificate(self, cert_der: bytes) -> Peer:
        """Whom a certificate names; IdentityError when it is not the session CA's, expired or revoked."""
        return self._checked_peer(cert_der)[0]

    def _checked_peer(self, cert_der: bytes) -> Tuple[Peer, Any]:
        """Whom a certificate names and its public key, checked against the CA once per certificate
        (then remembered); expiry and revocation are checked every time."""
        now = datetime.datetime.now(datetime.timezone.utc)
        cert_der = bytes(cert_der)
        known = self._checked.get(cert_der)
        if known is None:
            try:
                cert = x509.load_der_x509_certificate(cert_der)
            except ValueError:
                raise IdentityError("the peer's certificate cannot be read") from None
            if cert.issuer != self._ca_name:
                raise IdentityError("the peer's certificate is not of this session's CA")
            try:
                self._ca_public.verify(cert.signature, cert.tbs_certificate_bytes)
            except (InvalidSignature, TypeError):
                raise IdentityError("the peer's certificate is not signed by this session's CA") from None
            names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
            try:
                uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value \
                    .get_values_for_type(x509.UniformResourceIdentifier)
            except x509.ExtensionNotFound:
                uris = []
            keys = [u[len(_KEY_URI):] for u in uris if u.startswith(_KEY_URI)]
            if len(names) != 1 or len(keys) != 1:
                raise IdentityError("the peer's certificate names no roving node")
            if now < _valid_from(cert):
                raise IdentityError("the peer's certificate is not valid yet (are the clocks apart?)")
            known = (Peer(str(names[0].value), keys[0], _UNTRUSTED_URI not in uris), _valid_to(cert),
                     cert.public_key())
            with self._lock:
                while len(self._checked) >= _CHECKED_MAX:
                    self._checked.pop(next(iter(self._checked)))
                self._checked[cert_der] = known
        peer, until, public = known
        if now > until:
            raise IdentityError(f"the certificate of {peer.node_id} has expired")
        if peer.node_id in _revoked:
            raise IdentityError(f"the credentials of {peer.node_id} were revoked")
        return peer, public

    def stranger_server_context(self) -> ssl.SSLContext:
        """A TLS 1.3 server context with this process's certificate that asks the client for none: for
        a listener whose clients have no credentials yet (they check this certificate against the CA)."""
        key_pem = self._identity_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption())
        ctx = _tls_context(ssl.PROTOCOL_TLS_SERVER, key_pem, self.cert_pem, self.ca_pem)
        ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def tls_contexts(self) -> Tuple[ssl.SSLContext, ssl.SSLContext]:
        """(server, client) TLS 1.3 contexts: mutual, with this process's certificate, the session CA the
        only trust anchor. Host names are not checked: the in-band proof names the node."""
        if self._tls is None:
            with self._lock:
                if self._tls is None:
                    key_pem = self._identity_key.private_bytes(
                        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                        serialization.NoEncryption())
                    self._tls = (_tls_context(ssl.PROTOCOL_TLS_SERVER, key_pem, self.cert_pem, self.ca_pem),
                                 _tls_context(ssl.PROTOCOL_TLS_CLIENT, key_pem, self.cert_pem, self.ca_pem))
        return self._tls


def _valid_from(cert: x509.Certificate) -> datetime.datetime:
    value = getattr(cert, "not_valid_before_utc", None)
    return value if value is not None else cert.not_valid_before.replace(tzinfo=datetime.timezone.utc)


def _valid_to(cert: x509.Certificate) -> datetime.datetime:
    value = getattr(cert, "not_valid_after_utc", None)
    return value if value is not None else cert.not_valid_after.replace(tzinfo=datetime.timezone.utc)


def _context(as_node: bool, client_nonce: bytes, node_nonce: bytes, node: str, binding: bytes = b"") -> bytes:
    context = (_AS_NODE if as_node else _AS_CLIENT) + client_nonce + node_nonce + node.encode()
    # the node key is base64 (never a zero byte), so a binding cannot be read as part of it
    return context + b"\x00" + binding if binding else context


def _tls_context(side: int, key_pem: bytes, cert_pem: str, ca_pem: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(side)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=ca_pem)
    # ssl loads a certificate chain from files only: a private folder that is gone once read
    folder = tempfile.mkdtemp(prefix="roving-tls-")
    try:
        path = os.path.join(folder, "identity.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key_pem + cert_pem.encode())
        ctx.load_cert_chain(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if side == ssl.PROTOCOL_TLS_SERVER:
        ctx.num_tickets = 0  # no resumption: every stream makes a full, mutually verified handshake
    return ctx


# -- credentials from raw secret bytes ---------------------------------------------------------------

_adhoc: Dict[bytes, Credentials] = {}
_adhoc_lock = threading.Lock()
_own: Dict[bytes, Credentials] = {}  # member secret -> this process's credentials under it (adopt)


def adopt(creds: Credentials) -> None:
    """Make ``creds`` what :func:`credentials` gives for their member secret's bytes in this process
    (the session's: code that passes ``session.secret`` connects as this process's identity)."""
    _own[creds.secret] = creds


def credentials(secret_or_credentials: Union[bytes, Credentials]) -> Credentials:
    """``Credentials`` as they are; raw secret bytes: this process's credentials under that member
    secret (:func:`adopt`), else the ad hoc identity those bytes make, under the ad hoc CA they make
    (the same in every process that holds them)."""
    if isinstance(secret_or_credentials, Credentials):
        return secret_or_credentials
    secret = bytes(secret_or_credentials)
    creds = _own.get(secret) or _adhoc.get(secret)
    if creds is None:
        with _adhoc_lock:
            creds = _adhoc.get(secret)
            if creds is None:
                authority = Authority(derive(secret, "ad-hoc-ca"), "roving ad hoc CA")
                seed = derive(secret, "ad-hoc-node")
                grant = authority.issue("adhoc-" + derive(seed, "name", 8).hex(), seed)
                creds = _adhoc[secret] = Credentials(secret, grant, authority, ad_hoc=True)
    return creds


def root(secret: bytes, node_id: str) -> Credentials:
    """The credentials of a session's root process (made from the program's own ``secret``): the
    member secret and the CA are derived from it, and the root's own identity is issued first."""
    authority = Authority(derive(secret, "session-ca-seed"))
    return Credentials(derive(secret, "member-secret"), authority.issue(node_id), authority)


def child(secret: bytes, node_id: str, seed_hex: str, public: Dict[str, str]) -> Credentials:
    """A child's credentials, from what its parent handed it (IdentityError when they do not fit)."""
    try:
        seed = bytes.fromhex(seed_hex)
        grant = Grant(node_id, seed, public["cert"], public["ca"])
    except (ValueError, KeyError, TypeError) as exc:
        raise IdentityError(f"this process's credentials from its parent cannot be read: {exc}") from None
    return Credentials(secret, grant)


# -- revocation ----------------------------------------------------------------------------------

_revoked: set = set()
class RevocationWatcher(Protocol):
    """What :func:`on_revoke` calls: a node, which closes the revoked process's connections."""

    def revoked(self, node_id: str) -> None: ...


_watchers: "weakref.WeakSet[RevocationWatcher]" = weakref.WeakSet()
_watch_lock = threading.Lock()


def revoke(node_id: str) -> None:
    """Revoke the credentials of ``node_id`` in this process: refused on new connections from now on,
    and the connections open with them closed by each node of this process (:func:`on_revoke`)."""
    with _watch_lock:
        if node_id in _revoked:
            return
        _revoked.add(node_id)
        watchers = list(_watchers)
    for watcher in watchers:
        watcher.revoked(node_id)


def is_revoked(node_id: str) -> bool:
    return node_id in _revoked


def on_revoke(watcher: RevocationWatcher) -> None:
    """Call ``watcher.revoked(node_id)`` (any thread; it must not block) at each revocation while the
    watcher lives (held weakly)."""
    with _watch_lock:
        _watchers.add(watcher)
