"""The roving session this process belongs to: its secret, its identity and its endpoint.

A session is a parent program and every process it starts, directly or not. They share one random
secret, which the parent hands to each child through the child's job environment; every connection
between them is authenticated with it. The endpoint (:class:`~roving.transport.node.Node`) of a process
is started the first time something needs it.
"""
from __future__ import annotations

import json
import os
import threading
from typing import Dict, Optional

from .. import config as _config
from . import auth
from .endpoint import Endpoint, close_connections
from .node import Node

CHILD_ENV = "ROVING_CHILD"
#: Where a child finds the session's secret when its CHILD_ENV holds none (the kubernetes backend puts
#: it in a Secret that the pod's environment references, not in the pod spec).
SECRET_ENV = "ROVING_SESSION_SECRET"


class Session:
    def __init__(self, secret: bytes, uid: str, parent_address: Optional[str] = None) -> None:
        self.secret = secret
        #: This process's identity within the session (also the key of the pipe ends it holds).
        self.uid = uid
        self.parent_address = parent_address
        self._node: Optional[Node] = None
        self._endpoints: Dict[str, Endpoint] = {}
        self._lock = threading.Lock()

    def node(self) -> Node:
        """This process's endpoint, started on first use."""
        with self._lock:
            if self._node is None:
                cfg = _config.current()
                self._node = Node(self.secret, cfg.host, cfg.advertise)
            return self._node

    def endpoint(self, address: str) -> Endpoint:
        """The way to the mailboxes at ``address`` (direct calls when it is this process's own)."""
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            with self._lock:
                local = self._node if self._node is not None and self._node.address == address else None
                endpoint = self._endpoints.get(address)
                if endpoint is None:
                    endpoint = Endpoint(address, self.secret, local, _config.current().connect_timeout)
                    self._endpoints[address] = endpoint
        return endpoint

    def close(self) -> None:
        close_connections()
        if self._node is not None:
            self._node.close()


_session: Optional[Session] = None
_session_lock = threading.Lock()


def current() -> Session:
    """This process's session: inherited from the parent in a child, else a new one."""
    global _session
    if _session is None:
        with _session_lock:
            if _session is None:
                info = os.environ.get(CHILD_ENV)
                if info:
                    data = json.loads(info)
                    secret = data.get("secret") or os.environ.get(SECRET_ENV, "")
                    if data.get("encrypt"):  # the parent's, for the connections made before its config arrives
                        _config._adopt(_config.current().replace("the parent process", encrypt=data["encrypt"]))
                    _session = Session(bytes.fromhex(secret), data["uid"], data["parent"])
                else:
                    _session = Session(auth.new_secret(), "main-" + os.urandom(6).hex())
    return _session


def new_uid() -> str:
    return os.urandom(8).hex()
