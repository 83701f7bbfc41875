"""The open door: stage processes that someone else starts join a running training with an invitation.

Crowdsourced nodes are not started by the coordinator: their owners run ``roving pipeline node --join
HOST:PORT --invite TOKEN`` on their own machines, with code the coordinator does not control. The
address and the invitation are all such a node needs: no shared folder, no shared secret.

* **Invitations** (:class:`Invitations`): made by the coordinator (``roving pipeline invite``), each
  single-use, with an expiry, revocable until used. A token is ``rvj1.ID.SECRET.CA``: the invitation's
  id, 128 random bits that prove it (the coordinator keeps only their hash), and the first 128 bits of
  the SHA-256 of the session CA's certificate, which the node checks the coordinator against.
* **The door** (:class:`Door`, the coordinator's side): a TLS 1.3 listener at HOST:PORT. It sends the
  session CA's certificate first; the node checks it against the token and checks that the certificate
  TLS presented is that CA's (so no one else can answer in the coordinator's place and learn the
  token). The node then sends the token and the public halves of keys it made itself; a valid
  invitation is used up, and the node gets a certificate for those keys, marked untrusted
  (:attr:`roving.transport.identity.Peer.trusted`), its place in the run (the settings a stage process
  is started with) and the coordinator's inboxes. Nothing it sends is unpickled: one JSON line of at
  most :data:`MAX_LINE` bytes, within :data:`HANDSHAKE_S` seconds, at most :data:`MAX_HANDSHAKES` at
  once; refusals are logged once a minute per source.
* **Joining** (:func:`join`, the node's side) returns what :func:`run_node` needs to serve as a stage
  process in this process: the node is admitted like a restarted or added one, at an iteration
  boundary, and gets its stage's weights there.

What the node holds afterwards is its own key and a certificate that names it alone and lets it reach
only postboxes: no secret of the session (:meth:`roving.transport.identity.Credentials.certificate_only`).
Its connections present its own node key to ZeroMQ, which the coordinator and every stage process accept
once told of it (``transport.zap.admit``, from its placement and ``protocol.Peers``), and its
certificate alone in roving's handshake (``transport.auth``). It can have no credentials issued, and
once excluded its certificate (and the key admitted with it) is refused by the coordinator and by every
stage process (``protocol.Forget``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import os
import queue
import socket
import ssl
import threading
import time
from typing import Any, Callable

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ed25519
from zmq.utils import z85

from ...transport import identity
from ...transport.guard import Refusals
from ...transport.postbox import PostboxAddress
from ..errors import JoinError, PipelineError
from ..presets import LlamaConfig
from .stage_process import StageSettings

log = logging.getLogger(__name__)

TOKEN_PREFIX = "rvj1"
#: The longest line either side sends.
MAX_LINE = 64 << 10
#: Seconds a stranger has for the whole exchange.
HANDSHAKE_S = 10.0
#: Exchanges served at once; more wait in the listen backlog.
MAX_HANDSHAKES = 8
#: Seconds a node that sent a valid invitation waits for the run to take it (between iterations).
ADMISSION_S = 300.0


# -- invitations --------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Invitation:
    proof: bytes  # SHA-256 of the token's secret
    expires: float  # time.time()
    state: str = "open"  # open, used, revoked


class Invitations:
    """The run's invitations; thread-safe."""

    def __init__(self, ca_pem: str) -> None:
        self.ca_mark = identity.ca_fingerprint(ca_pem)[:32]
        self._open: dict[str, _Invitation] = {}
        self._lock = threading.Lock()

    def create(self, ttl: float = 3600.0) -> tuple[str, str]:
        """A new invitation valid for ``ttl`` seconds: (its id, its token)."""
        if not ttl > 0:
            raise ValueError(f"an invitation's lifetime must be positive, not {ttl!r}")
        inv_id, secret = os.urandom(6).hex(), os.urandom(16).hex()
        with self._lock:
            self._open[inv_id] = _Invitation(hashlib.sha256(secret.encode()).digest(), time.time() + ttl)
        return inv_id, f"{TOKEN_PREFIX}.{inv_id}.{secret}.{self.ca_mark}"

    def revoke(self, inv_id: str) -> bool:
        """Revoke an invitation not used yet; False when there is no such open invitation."""
        with self._lock:
            inv = self._open.get(inv_id)
            if inv is None or inv.state != "open":
                return False
            inv.state = "revoked"
            return True

    def redeem(self, token: str) -> str:
        """Use up the invitation ``token`` proves; its id. JoinError (why) when it is not one, was used,
        revoked or has expired."""
        inv_id, secret, _ = parse_token(token)
        with self._lock:
            inv = self._open.get(inv_id)
            if inv is None or not hmac.compare_digest(inv.proof, hashlib.sha256(secret.encode()).digest()):
                raise JoinError("the invitation is not one of this run's")
            if inv.state != "open":
                raise JoinError(f"the invitation was {inv.state}")
            if time.time() > inv.expires:
                raise JoinError("the invitation has expired")
            inv.state = "used"
        return inv_id


def parse_token(token: str) -> tuple[str, str, str]:
    """(id, secret, CA mark) of a token; JoinError when it is not one."""
    parts = token.strip().split(".") if isinstance(token, str) else []
    if len(parts) != 4 or parts[0] != TOKEN_PREFIX or not all(p and all(c in "0123456789abcdef" for c in p)
                                                                 for p in parts[1:]):
        raise JoinError("not an invitation token (rvj1.ID.SECRET.CA, as `roving pipeline invite` prints)")
    return parts[1], parts[2], parts[3]


# -- what a joiner is told ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Placement:
    """What the coordinator tells a node it admits through the door."""
    name: str
    node_id: str
    cert_pem: str
    ca_pem: str
    #: The public half (Z85) of the session's shared CURVE client key: the node's own node accepts the
    #: members that present it. Public: the node is given no secret of the session.
    session_client_key: bytes
    settings: StageSettings
    control: PostboxAddress
    beats: PostboxAddress

    def to_json(self) -> dict:
        s = dataclasses.asdict(self.settings)
        s.update(model=dataclasses.asdict(self.settings.model), receipt_key=self.settings.receipt_key.hex(),
                 emulate=None, adversary=None, betas=list(self.settings.betas))
        return {"name": self.name, "node_id": self.node_id, "cert": self.cert_pem, "ca": self.ca_pem,
                "session_client_key": self.session_client_key.decode(), "settings": s,
                "control": [self.control.node, self.control.box], "beats": [self.beats.node, self.beats.box]}

    @classmethod
    def from_json(cls, doc: Any) -> Placement:
        """JoinError when ``doc`` is not a placement."""
        try:
            s = dict(doc["settings"])
            s["model"] = LlamaConfig(**s["model"])
            s["receipt_key"] = bytes.fromhex(s["receipt_key"])
            s["betas"] = tuple(float(b) for b in s["betas"])
            s["emulate"] = s["adversary"] = None
            settings = StageSettings(**s)
            return cls(str(doc["name"]), str(doc["node_id"]), str(doc["cert"]), str(doc["ca"]),
                       _z85_key(doc["session_client_key"]), settings,
                       PostboxAddress(str(doc["control"][0]), int(doc["control"][1])),
                       PostboxAddress(str(doc["beats"][0]), int(doc["beats"][1])))
        except (KeyError, TypeError, ValueError, IndexError, PipelineError) as exc:
            raise JoinError(f"the coordinator's answer is not a placement: {exc!r}") from None


@dataclasses.dataclass
class Enrolment:
    """A stranger with a valid invitation, waiting for the run to place it (``Door.serve``)."""
    region: str | None
    identity_public: bytes
    node_key: str
    answer: queue.Queue = dataclasses.field(default_factory=lambda: queue.Queue(1))


#: ``enroll(region, identity_public, node_key)``: the trainer places a new node (``Roster.enroll``).
Enroll = Callable[[str | None, bytes, str], Placement]


# -- the coordinator's side -------------------------------------------------------------------------
class Door:
    """The coordinator's open door at ``host:port`` (0: a free port); ``address`` says where it is."""

    def __init__(self, host: str, port: int, credentials: identity.Credentials, invitations: Invitations) -> None:
        self.invitations = invitations
        self._credentials = credentials
        self._tls = credentials.stranger_server_context()
        self._sock = socket.create_server((host, port), backlog=64)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._pending: queue.Queue[Enrolment] = queue.Queue()
        self._slots = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._refusals = Refusals(log, f"the open door at {self.address}")
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="roving-open-door", daemon=True)
        self._thread.start()

    def serve(self, enroll: Enroll) -> list[str]:
        """Place the strangers waiting (on the caller's thread: the trainer's, between iterations);
        the names placed."""
        placed: list[str] = []
        while True:
            try:
                e = self._pending.get_nowait()
            except queue.Empty:
                return placed
            try:
                placement: Any = enroll(e.region, e.identity_public, e.node_key)
                placed.append(placement.name)
            except (PipelineError, identity.IdentityError, ValueError) as exc:
                placement = JoinError(str(exc))
            e.answer.put(placement)

    def close(self) -> None:
        self._closed.set()
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self._refusals.refuse(peer[0], f"more than {MAX_HANDSHAKES} strangers at once")
                conn.close()
                continue
            threading.Thread(target=self._welcome, args=(conn, peer[0]), name="roving-door-guest", daemon=True).start()

    def _welcome(self, conn: socket.socket, source: str) -> None:
        deadline = time.monotonic() + HANDSHAKE_S
        try:
            conn.settimeout(HANDSHAKE_S)
            with self._tls.wrap_socket(conn, server_side=True) as tls:
                _send_line(tls, {"ca": self._credentials.ca_pem})
                request = _read_line(tls, deadline)
                try:
                    enrolment = self._enrolment(request)
                except JoinError as exc:
                    self._refusals.refuse(source, str(exc))
                    _send_line(tls, {"error": str(exc)})
                    return
                self._pending.put(enrolment)
                tls.settimeout(ADMISSION_S)
                try:
                    placement = enrolment.answer.get(timeout=ADMISSION_S)
                except queue.Empty:
                    placement = JoinError(f"the run did not take the node within {ADMISSION_S:g} s")
                if isinstance(placement, JoinError):
                    _send_line(tls, {"error": str(placement)})
                    return
                _send_line(tls, {"placement": placement.to_json()})
                log.info("open door: %s joined from %s as %s", placement.node_id, source, placement.name)
        except (OSError, ssl.SSLError, ValueError) as exc:
            self._refusals.refuse(source, f"the exchange failed: {exc}")
        finally:
            self._slots.release()

    def _enrolment(self, request: Any) -> Enrolment:
        if not isinstance(request, dict):
            raise JoinError("a request that is not a JSON object")
        try:
            public = bytes.fromhex(str(request["identity"]))
            key = str(request["node_key"])
            region = request.get("region")
            ed25519.Ed25519PublicKey.from_public_bytes(public)
        except (KeyError, ValueError, TypeError) as exc:
            raise JoinError(f"a request without the node's public keys: {exc}") from None
        if region is not None and not isinstance(region, str):
            raise JoinError("a region that is not a name")
        self.invitations.redeem(str(request.get("invite", "")))
        return Enrolment(region, public, key)


# -- the node's side ----------------------------------------------------------------------------------
def join(address: str, token: str, seed: bytes, region: str | None = None,
         timeout: float = ADMISSION_S + HANDSHAKE_S) -> Placement:
    """Go through the door at ``address`` (HOST:PORT) with the invitation ``token``, for the keys made
    from ``seed``; the placement the coordinator gives. JoinError (naming the address) when it cannot
    be reached, is not the coordinator the token names, or refuses."""
    _, _, mark = parse_token(token)
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise JoinError(f"{address!r} is not HOST:PORT")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # checked below against the CA the token names
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=HANDSHAKE_S) as raw, \
                ctx.wrap_socket(raw) as tls:
            tls.settimeout(HANDSHAKE_S)
            hello = _read_line(tls, time.monotonic() + HANDSHAKE_S)
            ca_pem = hello.get("ca") if isinstance(hello, dict) else None
            _check_coordinator(tls, ca_pem, mark, address)
            identity_public, node_key = identity.public_keys(seed)
            _send_line(tls, {"invite": token, "identity": identity_public.hex(), "node_key": node_key,
                             "region": region})
            tls.settimeout(max(1.0, deadline - time.monotonic()))
            answer = _read_line(tls, deadline)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise JoinError(f"cannot join the training at {address}: {exc}") from None
    if not isinstance(answer, dict) or "placement" not in answer:
        why = answer.get("error") if isinstance(answer, dict) else None
        raise JoinError(f"the training at {address} refused: {why or 'no answer'}")
    placement = Placement.from_json(answer["placement"])
    if placement.ca_pem != ca_pem:
        raise JoinError(f"the training at {address} answered with another CA than it presented")
    return placement


def _check_coordinator(tls: ssl.SSLSocket, ca_pem: Any, mark: str, address: str) -> None:
    """The CA sent is the one the token names, and the certificate TLS presented is that CA's."""
    if not isinstance(ca_pem, str) or identity.ca_fingerprint(ca_pem)[:32] != mark:
        raise JoinError(f"the server at {address} is not the training the invitation is for (another CA)")
    leaf = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True) or b"")
    ca = x509.load_pem_x509_certificate(ca_pem.encode())
    try:
        ca.public_key().verify(leaf.signature, leaf.tbs_certificate_bytes)  # type: ignore[call-arg,union-attr]
    except (InvalidSignature, TypeError):
        raise JoinError(f"the server at {address} presented a certificate its CA did not issue") from None


def credentials_of(placement: Placement, seed: bytes) -> identity.Credentials:
    """The node's credentials: its own keys (from ``seed``) and the certificate it was given, and no
    secret of the session (:meth:`identity.Credentials.certificate_only`)."""
    return identity.Credentials.certificate_only(
        identity.Grant(placement.node_id, seed, placement.cert_pem, placement.ca_pem), placement.session_client_key)


def _z85_key(text: Any) -> bytes:
    """A CURVE public key as Z85 text (40 characters); ValueError otherwise."""
    key = str(text).encode()
    if len(key) != 40 or len(z85.decode(key)) != 32:
        raise ValueError(f"not a CURVE public key: {str(text)[:60]!r}")
    return key


def _send_line(tls: ssl.SSLSocket, doc: Any) -> None:
    tls.sendall(json.dumps(doc).encode() + b"\n")


def _read_line(tls: ssl.SSLSocket, deadline: float) -> Any:
    data = bytearray()
    while not data.endswith(b"\n"):
        if time.monotonic() > deadline:
            raise ValueError("the other side took too long")
        chunk = tls.recv(4096)
        if not chunk:
            raise ValueError("the other side closed the connection")
        data += chunk
        if len(data) > MAX_LINE:
            raise ValueError(f"a line of more than {MAX_LINE} bytes")
    return json.loads(bytes(data))

