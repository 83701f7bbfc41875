"""The roving session this process belongs to: its secret, its identity and its endpoint.

A session is a parent program and every process it starts, directly or not. They share one random
secret, which the parent hands to each child through the child's job environment (a container reads it
from a private file, a pod from a Kubernetes Secret); every connection between them is authenticated
with it. A child removes what it was told from ``os.environ`` as soon as it has read it, so that the
programs it starts itself (a ``subprocess``, a tool) never inherit the secret; the roving processes it
starts get the secret from its Session, as its own children. The endpoint (:class:`~roving.transport.node.Node`) of a process
is started the first time something needs it.
"""
from __future__ import annotations

import json
import os
import threading
from typing import Dict, Optional, Tuple

from .. import config as _config
from . import addressing, auth
from .endpoint import Endpoint, close_connections
from .node import Node

CHILD_ENV = "ROVING_CHILD"
#: Where a child finds the session's secret when its CHILD_ENV holds none (the kubernetes backend puts
#: it in a Secret that the pod's environment references, not in the pod spec).
SECRET_ENV = "ROVING_SESSION_SECRET"
#: Or a file that holds it (the docker backend mounts one read-only into each container).
SECRET_FILE_ENV = "ROVING_SESSION_SECRET_FILE"


class Session:
    def __init__(self, secret: bytes, uid: str, parent_address: Optional[str] = None) -> None:
        self.secret = secret
        #: This process's identity within the session (also the key of the pipe ends it holds).
        self.uid = uid
        self.parent_address = parent_address
        self._node: Optional[Node] = None
        self._endpoints: Dict[str, Endpoint] = {}
        self._lock = threading.Lock()

    def address(self) -> addressing.Choice:
        """Where this process's endpoints listen and what they advertise, with why
        (:mod:`roving.transport.addressing`); AddressError when no interface can be chosen."""
        cfg = _config.current()
        return addressing.choose(cfg.host, cfg.advertise, self.parent_address, cfg, cfg.port_range)

    def node(self) -> Node:
        """This process's endpoint, started on first use."""
        with self._lock:
            if self._node is None:
                self._node = Node.at(self.secret, self.address())
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
                    endpoint = Endpoint(address, self.secret, local,
                                        connect_timeout or _config.current().connect_timeout)
                    self._endpoints[address] = endpoint
        return endpoint

    def close(self) -> None:
        close_connections()
        if self._node is not None:
            self._node.close()


_session: Optional[Session] = None
_session_lock = threading.Lock()
_child_info: Optional[dict] = None


def _take_child_env() -> Tuple[Optional[dict], str]:
    """What the parent told this child, and the secret (hex), removed from os.environ."""
    global _child_info
    raw = os.environ.pop(CHILD_ENV, None)
    if not raw:
        return None, ""
    secret = os.environ.pop(SECRET_ENV, "")
    secret_file = os.environ.pop(SECRET_FILE_ENV, "")
    info = json.loads(raw)
    secret = info.pop("secret", None) or secret
    if not secret and secret_file:
        try:
            with open(secret_file) as f:
                secret = f.read().strip()
        except OSError as exc:
            raise OSError(f"roving: this child cannot read the session secret from {secret_file} ({exc}); "
                          "the file is readable only by the user who started the parent: run the container as "
                          "that user, or as root") from None
    _child_info = info
    return info, secret


def child_info() -> Optional[dict]:
    """What the parent told this child (its uid, the parent's address, the work's box...; never the
    secret), or None outside a roving child."""
    current()
    return _child_info


def current() -> Session:
    """This process's session: inherited from the parent in a child, else a new one."""
    global _session
    if _session is None:
        with _session_lock:
            if _session is None:
                data, secret = _take_child_env()
                if data is not None:
                    if data.get("encrypt"):  # the parent's, for the connections made before its config arrives
                        _config._adopt(_config.current().replace("the parent process", encrypt=data["encrypt"]))
                    _session = Session(bytes.fromhex(secret), data["uid"], data["parent"])
                else:
                    _session = Session(auth.new_secret(), "main-" + os.urandom(6).hex())
    return _session


def new_uid() -> str:
    return os.urandom(8).hex()
