"""The server side of managers: the process that hosts shared objects and runs their methods.

A server is a node of its own (authenticated with the manager's authkey). Calls of one connection run in
order on a thread of that connection, so a blocking call blocks only its caller. Asynchronous calls come
in lanes, one per asynchronous proxy (:data:`~roving._manager_proxy.LANE`): a lane's calls run in the
order they were sent, one after another, as a connection's would; different lanes run concurrently on a
thread pool. An object is freed when the last proxy to it in any process goes.
"""
from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from .transport import rpc as _rpc
from . import process as _process
from ._manager_proxy import OP, PROXY, BaseProxy, RemoteError
from .transport import node as _node
from .transport import session as _session
from .transport.serialize import dumps, loads

log = logging.getLogger(__name__)


def public_methods(obj: Any) -> List[str]:
    return [name for name in dir(obj) if name[0] != "_" and callable(getattr(obj, name, None))]


class _Server(_rpc.Server):
    """Hosts objects in the manager's process. Runs on the node's I/O thread only to route messages."""

    def __init__(self, node: Any, registry: Dict[str, tuple]) -> None:
        self.registry = registry
        self.objects: Dict[int, Any] = {}
        self.exposed: Dict[int, Tuple[str, ...]] = {}
        self.typeids: Dict[int, str] = {}
        self.refs: Dict[int, int] = {}
        self.lock = threading.Lock()
        self._ids = itertools.count(1)
        self._queues: Dict[bytes, "queue.SimpleQueue"] = {}
        # The asynchronous calls waiting in each lane that has one running, by (connection, lane).
        self._lanes: Dict[Tuple[bytes, bytes], Deque[Tuple[int, List[Any]]]] = {}
        self._lanes_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="roving-manager-async")
        self.stop = threading.Event()
        super().__init__(node, OP)

    def serve(self, ident: bytes, req_id: int, kind: int, frames: List[Any]) -> None:
        if kind == _rpc.CALL_CONCURRENT:
            lane = (ident, bytes(frames[0].bytes))
            with self._lanes_lock:
                waiting = self._lanes.get(lane)
                if waiting is not None:  # the lane runs: this call goes after those before it
                    waiting.append((req_id, frames[1:]))
                    return
                self._lanes[lane] = collections.deque()
            self._pool.submit(self._run_lane, ident, lane, req_id, frames[1:])
            return
        # Calls of one connection run in order, on that connection's thread.
        with self.lock:
            q = self._queues.get(ident)
            if q is None:
                q = self._queues[ident] = queue.SimpleQueue()
                threading.Thread(target=self._connection, args=(ident, q), daemon=True,
                                 name="roving-manager-conn").start()
            q.put((req_id, kind, frames))

    def _connection(self, ident: bytes, q: "queue.SimpleQueue") -> None:
        while True:
            try:
                req_id, kind, frames = q.get(timeout=60)
            except queue.Empty:
                with self.lock:  # idle: end this thread, unless a message came in meanwhile
                    if q.empty():
                        self._queues.pop(ident, None)
                        return
                continue
            self._run(ident, req_id, kind, frames)

    def _run_lane(self, ident: bytes, lane: Tuple[bytes, bytes], req_id: int, frames: List[Any]) -> None:
        """Run a lane's calls one after another, in the order they came, until none waits."""
        while True:
            self._run(ident, req_id, _rpc.CALL_CONCURRENT, frames)
            with self._lanes_lock:
                waiting = self._lanes[lane]
                if not waiting:
                    del self._lanes[lane]
                    return
                req_id, frames = waiting.popleft()

    def _run(self, ident: bytes, req_id: int, kind: int, frames: List[Any]) -> None:
        try:
            request = loads(frames)
            status, result = self._handle(*request)
        except BaseException as exc:  # everything goes back to the caller
            status, result = _rpc.ERR, exc
        if kind == _rpc.TELL:
            if status == _rpc.ERR:
                log.warning("roving manager: %r", result)
            return
        try:
            out = dumps(result)
        except Exception as exc:
            status, out = _rpc.ERR, dumps(RemoteError(
                "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))))
        if status == _rpc.ERR and isinstance(result, BaseException):
            try:
                out = dumps(result)
            except Exception:
                out = dumps(RemoteError("".join(traceback.format_exception(
                    type(result), result, result.__traceback__))))
        self.answer(ident, req_id, status, out)

    def _new(self, typeid: str, obj: Any, exposed: Optional[Sequence[str]]) -> Tuple[int, Tuple[str, ...]]:
        with self.lock:
            oid = next(self._ids)
            self.objects[oid] = obj
            self.exposed[oid] = tuple(exposed) if exposed is not None else tuple(public_methods(obj))
            self.typeids[oid] = typeid
            self.refs[oid] = 1
            return oid, self.exposed[oid]

    def _here(self, value: Any) -> Any:
        """A proxy of a lock of this server, as a constructor's argument, stands for the lock itself:
        Condition(Lock()) then waits on the lock, not through a proxy back to this server. Any other
        proxy stays a proxy, so the object made holds the same shared object (dict(d=other_dict))."""
        if isinstance(value, BaseProxy) and value._token.address == self.node.address:
            obj = self.objects.get(value._token.id)
            if callable(getattr(obj, "acquire", None)) and callable(getattr(obj, "release", None)):
                return obj
        return value

    def _handle(self, what: str, *args: Any) -> Tuple[int, Any]:
        if what == "call":
            oid, method, call_args, kwds = args
            obj = self.objects.get(oid)
            if obj is None:
                raise KeyError(f"no shared object with id {oid} (it was freed, or the manager restarted)")
            if method == "#GETVALUE":
                return _rpc.OK, obj
            if method == "#EXPOSED":
                return _rpc.OK, self.exposed[oid]
            if method in ("__repr__", "__str__"):
                return _rpc.OK, getattr(obj, method)()
            if method not in self.exposed[oid]:
                raise AttributeError(f"method {method!r} of {type(obj).__name__} object is not in the list "
                                     f"of allowed methods {list(self.exposed[oid])}")
            # A proxy in a method's arguments stays a proxy (it holds its own reference here), so
            # that a shared object stored in another (a dict in a dict, a Queue in a list) comes back
            # out as a proxy of the same object, as in multiprocessing.
            result = getattr(obj, method)(*call_args, **kwds)
            typeid = self.registry[self.typeids[oid]][2].get(method) if self.typeids[oid] in self.registry \
                else None
            if typeid:
                exposed = self.registry[typeid][1]
                oid, exposed = self._new(typeid, result, exposed)
                return PROXY, (typeid, oid, exposed)
            if isinstance(result, (type({}.keys()), type({}.values()), type({}.items()))):
                result = list(result)
            return _rpc.OK, result
        if what == "create":
            typeid, call_args, kwds = args
            entry = self.registry.get(typeid)
            if entry is None:
                raise ValueError(f"typeid {typeid!r} is not registered with this manager")
            factory, exposed = entry[0], entry[1]
            obj = factory(*map(self._here, call_args), **{k: self._here(v) for k, v in kwds.items()})
            return _rpc.OK, self._new(typeid, obj, exposed)
        if what == "incref":
            with self.lock:
                if args[0] not in self.refs:
                    raise KeyError(f"no shared object with id {args[0]}: it was freed")
                self.refs[args[0]] += 1
            return _rpc.OK, None
        if what == "decref":
            with self.lock:
                self.refs[args[0]] -= 1
                if self.refs[args[0]] <= 0:
                    for table in (self.refs, self.objects, self.exposed, self.typeids):
                        table.pop(args[0], None)
            return _rpc.OK, None
        if what == "count":
            return _rpc.OK, len(self.objects)
        if what == "shutdown":
            self.stop.set()
            return _rpc.OK, None
        raise ValueError(f"unknown manager request {what!r}")


def _serve(registry: Dict[str, tuple], authkey: Optional[bytes], reply: Any) -> None:
    """The manager server process: a node of its own (with the manager's authkey), until shutdown."""
    node = _node.Node.at(authkey or _session.current().secret, _session.current().address())
    server = _Server(node, registry)
    reply.put(node.address)
    server.stop.wait()
    _process.end_without_joining_threads()  # calls still blocked in the server's threads must not hold it
    # Give the answer to shutdown() time to leave before the process ends.
    time.sleep(0.1)
    node.close()


def run_server(registry: Dict[str, tuple], authkey: Optional[bytes], reply: Any,
               initializer: Optional[Callable[..., Any]], initargs: tuple) -> None:
    """The target of a manager's server process: ``initializer(*initargs)``, then serve until shutdown."""
    if initializer is not None:
        initializer(*initargs)
    _serve(registry, authkey, reply)
