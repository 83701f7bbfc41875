"""The roving session this process belongs to: its secret, its identity and its endpoint.

A session is a parent program and every process it starts, directly or not. Each process has its own
credentials (:mod:`.identity`): the root (the program) holds the session's CA, made from its own
secret, and has it issue every child's before the child's job is made; a child whose own children need
credentials asks the CA at the root's node (:mod:`.issuer`). They share one member secret (never the
root's), which the parent hands to each child, with the child's private seed (the value is
``MEMBER_HEX.SEED_HEX``), through the child's job environment, in the variable SECRET_ENV, which every
backend moves out of the environment (local and Slurm children and containers read it from a one-use
private file named by SECRET_FILE_ENV, a pod from a Kubernetes Secret; the job's
:class:`~roving.backends.base.JobSession` names both variables); every connection between them is
authenticated with it. A child removes what it was told from ``os.environ`` as soon as it has read it,
so that the programs it starts itself (a ``subprocess``, a tool) never inherit the secret; the roving
processes it starts get the secret from its Session, as its own children. The endpoint
(:class:`~roving.transport.node.Node`) of a process is started the first time something needs it.

Importing this module points roving.transport.addressing at :func:`roving.backends.towards`: the
transport stands above the backends and asks them where their jobs run.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from typing import Dict, Mapping, Optional, Tuple

from .. import backends
from .. import config as _config
from ..system.private import take_private
from . import addressing, auth, identity, issuer
from .endpoint import Endpoint, close_connections
from .node import Node

#: What the parent tells a child (JSON: its uid, the parent's address, the work's box...; never the secret).
CHILD_ENV = "ROVING_CHILD"
#: Where a child finds the session's secret (hex): the job's environment (local, slurm), or a variable
#: that references a Kubernetes Secret (the pod spec holds only the reference).
SECRET_ENV = "ROVING_SESSION_SECRET"
#: Or a file that holds it (the docker backend mounts one read-only into each container).
SECRET_FILE_ENV = "ROVING_SESSION_SECRET_FILE"

# The address a process without a parent binds looks towards the machines its backend starts jobs on.
addressing.set_cluster_route(backends.towards)


class Session:
    def __init__(self, credentials: identity.Credentials, uid: str, parent_address: Optional[str] = None,
                 ca_address: Optional[str] = None) -> None:
        #: This process's credentials; the session's CA with them in the root.
        self.credentials = credentials
        #: The member secret that every connection of the session proves (not the root's own secret).
        self.secret = credentials.secret
        #: This process's identity within the session (also the key of the pipe ends it holds, and the
        #: node id its certificate names).
        self.uid = uid
        self.parent_address = parent_address
        #: The node of the process that holds the session's CA (None: this one).
        self.ca_address = ca_address
        identity.adopt(credentials)
        self._node: Optional[Node] = None
        self._endpoints: Dict[str, Endpoint] = {}
        self._lock = threading.Lock()

    @property
    def tag(self) -> str:
        """A short name for this session, the same in every process of it: derived from the secret by a
        one-way hash, so that it can be shown in job names and labels."""
        return hashlib.sha256(b"roving-session:" + self.secret).hexdigest()[:12]

    def job_session(self) -> backends.JobSession:
        """What a backend is told of this session with each job it starts."""
        return backends.JobSession(self.tag, SECRET_ENV, SECRET_FILE_ENV)

    def child_env(self, info: Mapping[str, object], trusted: bool = True) -> Dict[str, str]:
        """The variables that make a job a child of this session: ``info`` (what :func:`child_info`
        gives the child, with ``info["uid"]`` its node id), its credentials, issued now by the CA
        (IdentityError when that uid has had credentials before; marked untrusted unless ``trusted``),
        and the member secret."""
        grant = self.issue(str(info["uid"]), trusted)
        told = dict(info, identity=grant.public(), ca=self.ca_address or self.node().address)
        return {CHILD_ENV: json.dumps(told), SECRET_ENV: self.secret.hex() + "." + grant.seed.hex()}

    def issue(self, uid: str, trusted: bool = True) -> identity.Grant:
        """Credentials for a new process ``uid`` of this session (untrusted unless ``trusted``): from the
        CA here, or asked of it (which issues only trusted ones to children of children)."""
        if not self.credentials.trusted:
            raise identity.IdentityError(f"this process ({self.uid}) is untrusted: it can have no credentials "
                                         "issued, so it cannot start processes of the session")
        authority = self.credentials.authority
        if authority is not None:
            return authority.issue(uid, trusted=trusted)
        assert self.ca_address is not None
        if not trusted:
            raise identity.IdentityError("only the session's root can start an untrusted process")
        return issuer.ask(self.ca_address, self.credentials, uid, _config.current().connect_timeout)

    def address(self) -> addressing.Choice:
        """Where this process's endpoints listen and what they advertise, with why
        (:mod:`roving.transport.addressing`); AddressError when no interface can be chosen."""
        cfg = _config.current()
        return addressing.choose(cfg.host, cfg.advertise, self.parent_address, cfg, cfg.port_range)

    def node(self) -> Node:
        """This process's endpoint, started on first use."""
        with self._lock:
            if self._node is None:
                self._node = Node.at(self.credentials, self.address())
                if self.credentials.authority is not None:
                    issuer.serve(self._node)
            return self._node

    def endpoint(self, address: str, connect_timeout: Optional[float] = None) -> Endpoint:
        """The way to the mailboxes at ``address`` (direct calls when it is this process's own);
        ``connect_timeout`` (default: the option) bounds each authentication of its connections."""
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            with self._lock:
                local = self._node if self._node is not None and self._node.address == address else None
                endpoint = self._endpoints.get(address)
                if endpoint is None:
                    endpoint = Endpoint(address, self.credentials, local,
                                        connect_timeout or _config.current().connect_timeout)
                    self._endpoints[address] = endpoint
        return endpoint

    def started_node(self) -> Optional[Node]:
        """This process's endpoint if it was started, else None (it is not started by asking)."""
        return self._node

    def close(self) -> None:
        close_connections()
        if self._node is not None:
            self._node.close()


_session: Optional[Session] = None
_session_lock = threading.Lock()
_child_info: Optional[dict] = None


def _take_child_env() -> Tuple[Optional[dict], str]:
    """What the parent told this child, and the secret (hex: the member secret, a dot, this process's
    seed), removed from os.environ."""
    global _child_info
    raw = os.environ.pop(CHILD_ENV, None)
    if not raw:
        return None, ""
    secret = os.environ.pop(SECRET_ENV, "")
    secret_file = os.environ.pop(SECRET_FILE_ENV, "")
    info = json.loads(raw)
    if not secret and secret_file:
        try:
            secret = take_private(secret_file).strip()  # not through a link; removed once read
        except OSError as exc:
            raise OSError(f"roving: this child cannot read the session secret from {secret_file} ({exc}); "
                          "the parent made the file, readable only by its user, for one reading: run a container "
                          "as that user (or root), a Slurm job where the parent's home is mounted, and start "
                          "each child once") from None
    _child_info = info
    return info, secret


def child_info() -> Optional[dict]:
    """What the parent told this child (its uid, the parent's address, the work's box...; never the
    secret), or None outside a roving child."""
    current()
    return _child_info


def existing() -> Optional[Session]:
    """This process's session if something made it already, else None (it is not made by asking)."""
    return _session


def current() -> Session:
    """This process's session: inherited from the parent in a child, else a new one."""
    global _session
    if _session is None:
        with _session_lock:
            if _session is None:
                data, secret = _take_child_env()
                if data is not None:
                    if data.get("encrypt"):  # the parent's, for the connections made before its config arrives
                        _config.adopt(_config.current().replace("the parent process", encrypt=data["encrypt"]))
                    member, _, seed = secret.partition(".")
                    creds = identity.child(bytes.fromhex(member), data["uid"], seed, data.get("identity") or {})
                    _session = Session(creds, data["uid"], data["parent"], data.get("ca") or data["parent"])
                else:
                    uid = "main-" + os.urandom(6).hex()
                    _session = Session(identity.root(auth.new_secret(), uid), uid)
    return _session


def enter(credentials: identity.Credentials, towards: str) -> Session:
    """Make this process a member of a session it was not started by: with ``credentials`` issued to
    it from outside (a pipeline node that joined with an invitation), its node bound towards the
    address ``towards`` (the coordinator's). RuntimeError when this process has a session already."""
    global _session
    with _session_lock:
        if _session is not None:
            raise RuntimeError("this process is a member of a roving session already")
        _session = Session(credentials, credentials.node_id, towards, towards)
    return _session


def new_uid() -> str:
    return os.urandom(8).hex()
