"""The pools of one node: the node's handler for the pool protocol's messages, which hands each to its
pool's dispatcher (:mod:`roving.pool._dispatch`) by the pool id in its header, on the node's I/O thread."""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Protocol

from . import _protocol as P


class Dispatcher(Protocol):
    """What the router needs of a pool's dispatcher."""

    pool_id: int

    def on_message(self, ident: bytes, kind: int, arg: int, key: int, frames: List[Any]) -> None: ...


#: The key of the pool service of a node (``node.service``).
SERVICE = "pool"


class Router:
    """The pools of one node: the handler of the pool operation, routing each worker's message to its
    pool's dispatcher by pool id (on the node's I/O thread). One per node, made by ``node.service``."""

    def __init__(self, node: Any) -> None:
        self._pools: Dict[int, Dispatcher] = {}
        self._lock = threading.Lock()
        node.register_handler(P.OP, self._route)

    def add(self, disp: Dispatcher) -> None:
        with self._lock:
            self._pools[disp.pool_id] = disp

    def remove(self, disp: Dispatcher) -> None:
        with self._lock:
            self._pools.pop(disp.pool_id, None)

    def _route(self, ident: bytes, frames: List[Any]) -> None:
        head = P.read_header(frames)
        disp = self._pools.get(head.pool_id)
        if disp is not None:
            disp.on_message(ident, head.kind, head.arg, head.key, frames)
