"""Managers: a server process that hosts objects, and proxies that reach them from any roving process.

``roving.Manager()`` returns a started :class:`SyncManager` whose server is a roving Process — a job of
the configured backend, so it runs wherever the backend puts it. Its typeids are multiprocessing's:
Queue, JoinableQueue, list, dict, Namespace, Value, Array, Lock, RLock, Semaphore, BoundedSemaphore,
Event, Condition, Barrier, Pool. :meth:`BaseManager.register` adds custom types, as in multiprocessing.

Guarantees:

* Proxies are picklable: pass them to any roving process of the session (or to a program that connects
  with the manager's ``address`` and ``authkey``).
* Each thread has its own authenticated connection to the server, and the server runs each connection's
  calls in order on a thread of its own, so a blocking call (``queue.get()``) blocks only its caller.
* When the server process has ended, every proxy call raises :class:`~roving.transport.rpc.ServerGone` (a
  ``ConnectionError``): at once in the process that started the manager (it sees the process end), and
  within a few seconds elsewhere (pings go unanswered) — never a hang.
* :class:`AsyncManager` creates proxies whose method calls return a :class:`Handle` at once; the calls
  run concurrently in the server, and each handle gets its own call's result (matched by call id) in
  whatever order the handles are collected.
* A started manager's server stops at ``shutdown()``, or when the manager is garbage-collected, or at
  exit, whichever comes first (as multiprocessing's Finalize does): a program that never calls
  ``shutdown()`` still exits.
* Objects are reference-counted by the proxies alive in all processes and freed at the server when the
  last one goes (as in multiprocessing, a proxy in flight inside a message does not hold a reference).
"""
from __future__ import annotations

import array
import atexit
import itertools
import logging
import queue
import threading
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import ProcessError
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .transport import rpc as _rpc
from . import config as _config
from . import process as _process
from .transport import node as _node
from .transport import session as _session
from .transport import timeouts
from .transport.serialize import dumps, loads

log = logging.getLogger(__name__)

__all__ = ["BaseManager", "SyncManager", "AsyncManager", "BaseProxy", "Token", "Namespace", "Value",
           "Array", "RemoteError", "ServerGone", "Handle", "asynchronous", "Manager"]

OP = b"mgr"
ServerGone = _rpc.ServerGone
_PROXY = 2  # answer status: the result is a new shared object (method_to_typeid)


class RemoteError(Exception):
    """An exception raised in the manager's server that could not be sent back as itself."""

    def __str__(self) -> str:
        return "\n" + "-" * 75 + "\n" + str(self.args[0]) + "-" * 75


class Token:
    """Identifies a shared object: its typeid, the server's address and its id there."""

    __slots__ = ("typeid", "address", "id")

    def __init__(self, typeid: str, address: str, id: int) -> None:
        self.typeid, self.address, self.id = typeid, address, id

    def __getstate__(self) -> tuple:
        return self.typeid, self.address, self.id

    def __setstate__(self, state: tuple) -> None:
        self.typeid, self.address, self.id = state

    def __repr__(self) -> str:
        return f"Token(typeid={self.typeid!r}, address={self.address!r}, id={self.id})"


# -- server -----------------------------------------------------------------------------------

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
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="roving-manager-async")
        self.stop = threading.Event()
        super().__init__(node, OP)

    def serve(self, ident: bytes, req_id: int, kind: int, frames: List[Any]) -> None:
        if kind == _rpc.CALL_CONCURRENT:
            self._pool.submit(self._run, ident, req_id, kind, frames)
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
                return _PROXY, (typeid, oid, exposed)
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
    import time
    time.sleep(0.1)
    node.close()


# -- client -----------------------------------------------------------------------------------

_started: Dict[str, "_process.Process"] = {}  # address -> server process, in the process that started it
_callers = threading.local()
_async_callers: Dict[Tuple[str, bytes], _rpc.Caller] = {}
_async_lock = threading.Lock()


def _alive_check(address: str) -> Optional[Callable[[], bool]]:
    proc = _started.get(address)
    if proc is None:
        return None
    return lambda: proc._exitcode is None


def _caller(address: str, authkey: bytes) -> _rpc.Caller:
    cache = getattr(_callers, "by_address", None)
    if cache is None:
        cache = _callers.by_address = {}
    caller = cache.get((address, authkey))
    if caller is None:
        caller = cache[(address, authkey)] = _rpc.Caller(
            address, authkey, OP, "the manager's server",
            connect_timeout=min(10.0, _config.current().connect_timeout), alive=_alive_check(address))
    return caller


def _async_caller(address: str, authkey: bytes) -> _rpc.Caller:
    with _async_lock:
        caller = _async_callers.get((address, authkey))
        if caller is None:
            caller = _async_callers[(address, authkey)] = _rpc.Caller(
                address, authkey, OP, "the manager's server",
                connect_timeout=min(10.0, _config.current().connect_timeout), alive=_alive_check(address))
        return caller


def _result(status: int, frames: List[Any], authkey: Optional[bytes]) -> Any:
    result = loads(frames)
    if status == _rpc.ERR:
        raise result
    return result


def _request(address: str, authkey: bytes, *request: Any) -> Any:
    status, frames = _caller(address, authkey).call(dumps(request))
    return _result(status, frames, authkey)


class BaseProxy:
    """A reference to an object in a manager's server; method calls run there.

    Subclasses list the methods they may call in ``_exposed_`` and call them with :meth:`_callmethod`,
    as with :class:`multiprocessing.managers.BaseProxy`.
    """

    _exposed_: Optional[Tuple[str, ...]] = None
    _method_to_typeid_: Optional[Dict[str, str]] = None

    def __init__(self, token: Token, serializer: Any = None, manager: Any = None, authkey: Optional[bytes] = None,
                 exposed: Optional[Sequence[str]] = None, incref: bool = True, manager_owned: bool = False) -> None:
        self._token = token
        self._authkey = authkey
        self._custom_authkey = authkey is not None
        self._exposed_runtime = tuple(exposed) if exposed is not None else None
        self._manager = manager
        if incref:
            _request(token.address, self._key(), "incref", token.id)
        self._finalizer = weakref.finalize(self, _decref, token.address, self._key(), token.id)
        self._finalizer.atexit = False

    def _key(self) -> bytes:
        return self._authkey if self._authkey is not None else _session.current().secret

    def _callmethod(self, methodname: str, args: Tuple[Any, ...] = (), kwds: Optional[Dict[str, Any]] = None) -> Any:
        """Call ``methodname`` on the referent; raises what it raised there."""
        caller = _caller(self._token.address, self._key())
        status, frames = caller.call(dumps(("call", self._token.id, methodname, tuple(args), dict(kwds or {}))))
        return self._answer(status, frames)

    def _answer(self, status: int, frames: List[Any]) -> Any:
        if status == _PROXY:
            typeid, oid, exposed = loads(frames)
            proxytype = _proxytype_for(typeid, self._manager)
            return proxytype(Token(typeid, self._token.address, oid), manager=self._manager,
                             authkey=self._authkey, exposed=exposed, incref=False)
        return _result(status, frames, self._authkey)

    def _getvalue(self) -> Any:
        """A copy of the referent."""
        return self._callmethod("#GETVALUE")

    def __reduce__(self) -> Any:
        authkey = self._authkey if self._custom_authkey else None
        cls = AutoProxy if type(self).__dict__.get("_by_exposed") else type(self)
        return _rebuild_proxy, (cls, self._token, authkey, self._exposed_runtime)

    def __deepcopy__(self, memo: Any) -> Any:
        return self._getvalue()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} object, typeid {self._token.typeid!r} at {id(self):#x}>"

    def __str__(self) -> str:
        try:
            return self._callmethod("__repr__")
        except Exception:
            return repr(self)[:-1] + "; '__str__()' failed>"


def _rebuild_proxy(cls: type, token: Token, authkey: Optional[bytes], exposed: Any) -> BaseProxy:
    return cls(token, authkey=authkey, exposed=exposed, incref=True)


def _decref(address: str, authkey: bytes, oid: int) -> None:
    try:
        if not _rpc.is_dead(address):
            _async_caller(address, authkey).tell(dumps(("decref", oid)))
    except Exception:  # the server or this process is going away
        pass


_auto_types: Dict[Tuple[str, Tuple[str, ...]], type] = {}


def MakeProxyType(name: str, exposed: Sequence[str]) -> type:
    """A proxy class whose methods call the referent's methods ``exposed``."""
    exposed = tuple(exposed)
    cls = _auto_types.get((name, exposed))
    if cls is not None:
        return cls
    namespace: Dict[str, Any] = {"_exposed_": exposed}
    for meth in exposed:
        def method(self, *args, _meth=meth, **kwds):
            return self._callmethod(_meth, args, kwds)
        method.__name__ = meth
        namespace[meth] = method
    cls = _auto_types[(name, exposed)] = type(name, (BaseProxy,), namespace)
    return cls


class AutoProxy(BaseProxy):
    """Becomes a proxy type with the referent's exposed methods on creation."""

    def __new__(cls, token: Token, serializer: Any = None, manager: Any = None, authkey: Optional[bytes] = None,
                exposed: Optional[Sequence[str]] = None, incref: bool = True, manager_owned: bool = False):
        if exposed is None:
            exposed = _request(token.address, authkey or _session.current().secret, "call", token.id,
                               "#EXPOSED", (), {})
        proxytype = MakeProxyType(f"AutoProxy[{token.typeid}]", exposed)
        proxytype._by_exposed = True  # not importable by name: rebuilt from its exposed methods
        proxy = BaseProxy.__new__(proxytype)
        proxy.__init__(token, manager=manager, authkey=authkey, exposed=exposed, incref=incref)
        return proxy


def _proxytype_for(typeid: str, manager: Any) -> type:
    registry = manager._registry if manager is not None else SyncManager._registry
    entry = registry.get(typeid)
    return entry[3] if entry is not None and entry[3] is not None else AutoProxy


# -- proxies of SyncManager's types ---------------------------------------------------------------

class IteratorProxy(BaseProxy):
    _exposed_ = ("__next__", "send", "throw", "close")

    def __iter__(self):
        return self

    def __next__(self, *args):
        return self._callmethod("__next__", args)

    def send(self, *args):
        return self._callmethod("send", args)

    def throw(self, *args):
        return self._callmethod("throw", args)

    def close(self, *args):
        return self._callmethod("close", args)


class AcquirerProxy(BaseProxy):
    _exposed_ = ("acquire", "release")

    def acquire(self, blocking: bool = True, timeout: Optional[float] = None) -> bool:
        timeout = timeouts.limit(timeout)
        args = (blocking,) if timeout is None else (blocking, timeout)
        return self._callmethod("acquire", args)

    def release(self) -> None:
        return self._callmethod("release")

    def __enter__(self) -> bool:
        return self._callmethod("acquire")

    def __exit__(self, *exc: Any) -> None:
        return self._callmethod("release")


class ConditionProxy(AcquirerProxy):
    _exposed_ = ("acquire", "release", "wait", "notify", "notify_all")

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._callmethod("wait", (timeouts.limit(timeout),))

    def notify(self, n: int = 1) -> None:
        return self._callmethod("notify", (n,))

    def notify_all(self) -> None:
        return self._callmethod("notify_all")

    def wait_for(self, predicate: Callable[[], Any], timeout: Optional[float] = None) -> Any:
        import time
        result = predicate()
        deadline = timeouts.deadline(timeout)
        while not result:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            self.wait(left)
            result = predicate()
        return result


class EventProxy(BaseProxy):
    _exposed_ = ("is_set", "set", "clear", "wait")

    def is_set(self) -> bool:
        return self._callmethod("is_set")

    def set(self) -> None:
        return self._callmethod("set")

    def clear(self) -> None:
        return self._callmethod("clear")

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._callmethod("wait", (timeouts.limit(timeout),))


class BarrierProxy(BaseProxy):
    _exposed_ = ("__getattribute__", "wait", "abort", "reset")

    def wait(self, timeout: Optional[float] = None) -> int:
        return self._callmethod("wait", (timeouts.limit(timeout),))

    def abort(self) -> None:
        return self._callmethod("abort")

    def reset(self) -> None:
        return self._callmethod("reset")

    @property
    def parties(self) -> int:
        return self._callmethod("__getattribute__", ("parties",))

    @property
    def n_waiting(self) -> int:
        return self._callmethod("__getattribute__", ("n_waiting",))

    @property
    def broken(self) -> bool:
        return self._callmethod("__getattribute__", ("broken",))


class NamespaceProxy(BaseProxy):
    _exposed_ = ("__getattribute__", "__setattr__", "__delattr__")

    def __getattr__(self, key: str) -> Any:
        if key[0] == "_":
            return object.__getattribute__(self, key)
        return object.__getattribute__(self, "_callmethod")("__getattribute__", (key,))

    def __setattr__(self, key: str, value: Any) -> None:
        if key[0] == "_":
            return object.__setattr__(self, key, value)
        return object.__getattribute__(self, "_callmethod")("__setattr__", (key, value))

    def __delattr__(self, key: str) -> None:
        if key[0] == "_":
            return object.__delattr__(self, key)
        return object.__getattribute__(self, "_callmethod")("__delattr__", (key,))


class ValueProxy(BaseProxy):
    _exposed_ = ("get", "set")

    def get(self) -> Any:
        return self._callmethod("get")

    def set(self, value: Any) -> None:
        return self._callmethod("set", (value,))

    value = property(get, set)


def _sequence_proxy(name: str, exposed: Tuple[str, ...]) -> type:
    return MakeProxyType(name, exposed)


BaseListProxy = MakeProxyType("BaseListProxy", (
    "__add__", "__contains__", "__delitem__", "__getitem__", "__len__", "__mul__", "__reversed__", "__rmul__",
    "__setitem__", "append", "count", "extend", "index", "insert", "pop", "remove", "reverse", "sort",
    "__imul__"))


class ListProxy(BaseListProxy):
    """A shared list. It has no ``__iter__``, as multiprocessing's has none: ``iter()`` walks the shared
    list by index, one ``__getitem__`` call a step, so each step sees the list as it is then."""

    def __iadd__(self, value: Any) -> "ListProxy":
        self._callmethod("extend", (value,))
        return self

    def __imul__(self, value: Any) -> "ListProxy":
        self._callmethod("__imul__", (value,))
        return self


DictProxy = MakeProxyType("DictProxy", (
    "__contains__", "__delitem__", "__getitem__", "__iter__", "__len__", "__setitem__", "clear", "copy", "get",
    "items", "keys", "pop", "popitem", "setdefault", "update", "values"))
DictProxy._method_to_typeid_ = {"__iter__": "Iterator"}

ArrayProxy = MakeProxyType("ArrayProxy", ("__len__", "__getitem__", "__setitem__"))

BasePoolProxy = MakeProxyType("PoolProxy", (
    "apply", "apply_async", "close", "imap", "imap_unordered", "join", "map", "map_async", "starmap",
    "starmap_async", "terminate"))
BasePoolProxy._method_to_typeid_ = {
    "apply_async": "AsyncResult", "map_async": "AsyncResult", "starmap_async": "AsyncResult",
    "imap": "Iterator", "imap_unordered": "Iterator"}


class PoolProxy(BasePoolProxy):
    def __enter__(self) -> "PoolProxy":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.terminate()


# -- objects SyncManager hosts -------------------------------------------------------------------

class Namespace:
    """A plain object whose attributes are the shared state."""

    def __init__(self, **kwds: Any) -> None:
        self.__dict__.update(kwds)

    def __repr__(self) -> str:
        items = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if not k.startswith("_"))
        return f"Namespace({items})"


class Value:
    def __init__(self, typecode: Any, value: Any, lock: bool = True) -> None:
        self._typecode, self._value = typecode, value

    def get(self) -> Any:
        return self._value

    def set(self, value: Any) -> None:
        self._value = value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._typecode!r}, {self._value!r})"

    value = property(get, set)


def Array(typecode: str, sequence: Iterable[Any], lock: bool = True) -> array.array:
    return array.array(typecode, sequence)


def _pool(*args: Any, **kwds: Any) -> Any:
    from .pool import Pool
    return Pool(*args, **kwds)


# -- managers -----------------------------------------------------------------------------------

class BaseManager:
    """A server process hosting shared objects, and the way to create proxies to them.

    ``address``: to :meth:`connect` to a running manager (its :attr:`address`); ``authkey``: the key its
    connections are authenticated with (default: this roving session's secret).
    """

    _registry: Dict[str, tuple] = {}

    def __init__(self, address: Any = None, authkey: Optional[bytes] = None, serializer: str = "pickle",
                 ctx: Any = None, *, shutdown_timeout: float = 1.0) -> None:
        if authkey is not None and not isinstance(authkey, bytes):
            raise TypeError("authkey should be a bytes string")
        if isinstance(address, tuple):
            address = f"tcp://{address[0]}:{address[1]}"
        self._address: Optional[str] = address
        self._authkey = authkey
        self._process: Optional[_process.Process] = None
        self._state = "initial"
        self._shutdown_timeout = shutdown_timeout

    @property
    def address(self) -> Optional[str]:
        return self._address

    def _key(self) -> bytes:
        return self._authkey if self._authkey is not None else _session.current().secret

    def start(self, initializer: Optional[Callable[..., Any]] = None, initargs: Sequence[Any] = ()) -> None:
        """Start the server as a roving Process (a job of the configured backend); returns once it serves."""
        if self._state == "started":
            raise ProcessError("Already started server")
        if self._state == "shutdown":
            raise RuntimeError("Manager has shut down")
        if self._address is not None:
            raise ValueError("roving binds a manager's server to the backend's address itself: pass "
                             "'address' only to connect() to a running manager")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        from .queues import Queue
        reply = Queue()
        registry = {typeid: entry[:3] for typeid, entry in self._registry.items()}
        self._process = _process.Process(target=_run_server, args=(registry, self._authkey, reply,
                                                                  initializer, tuple(initargs)),
                                         name=f"{type(self).__name__}-server")
        self._process.start()
        try:
            self._address = reply.get(timeout=_config.current().connect_timeout + 30)
        except queue.Empty:
            self._process.kill()
            raise RuntimeError(f"the manager's server did not start within its connect timeout; see the "
                               f"output of {self._process.name}") from None
        _started[self._address] = self._process
        self._state = "started"
        # As multiprocessing's Finalize: the server stops when this manager is collected, or at exit,
        # whichever comes first, even if shutdown() is never called.
        self._finalizer = weakref.finalize(self, _stop_server, self._process, self._address, self._key(),
                                           self._shutdown_timeout)
        self._finalizer.atexit = False  # _shutdown_all runs it, before roving joins its children
        _running[:] = [f for f in _running if f.alive] + [self._finalizer]

    def connect(self) -> None:
        """Use the running manager at ``address`` (authenticated with ``authkey``)."""
        if self._address is None:
            raise ValueError("connect() needs the address of a running manager")
        _request(self._address, self._key(), "count")
        self._state = "connected"

    def shutdown(self) -> None:
        """Stop the server (its objects are gone; their proxies then raise ServerGone)."""
        if self._state != "started":
            return
        self._state = "shutdown"
        _run_now(self._finalizer)

    def join(self, timeout: Optional[float] = None) -> None:
        if self._process is not None:
            self._process.join(timeout)

    def __enter__(self) -> "BaseManager":
        if self._state == "initial":
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _check(self) -> None:
        if self._state not in ("started", "connected"):
            raise RuntimeError("Unable to use a manager that is not started or connected" if self._state == "initial"
                               else "Manager has shut down")

    def _create(self, typeid: str, *args: Any, **kwds: Any) -> Tuple[int, Tuple[str, ...]]:
        self._check()
        return _request(self._address, self._key(), "create", typeid, args, kwds)

    def _number_of_objects(self) -> int:
        """How many shared objects the server holds now."""
        return _request(self._address, self._key(), "count")

    def _proxy(self, typeid: str, proxytype: Optional[type], *args: Any, **kwds: Any) -> Any:
        oid, exposed = self._create(typeid, *args, **kwds)
        proxytype = proxytype or AutoProxy
        return proxytype(Token(typeid, self._address, oid), manager=self, authkey=self._authkey,
                         exposed=exposed, incref=False)

    @classmethod
    def register(cls, typeid: str, callable: Optional[Callable[..., Any]] = None, proxytype: Optional[type] = None,
                 exposed: Optional[Sequence[str]] = None, method_to_typeid: Optional[Dict[str, str]] = None,
                 create_method: bool = True) -> None:
        """Register a type (or a callable returning objects) to host; see multiprocessing's register."""
        if not isinstance(typeid, str) or not typeid.isidentifier():
            raise ValueError(f"typeid must be an identifier string, not {typeid!r}")
        if "_registry" not in cls.__dict__:
            cls._registry = dict(cls._registry)
        proxytype = proxytype or AutoProxy
        exposed = exposed or getattr(proxytype, "_exposed_", None)
        method_to_typeid = method_to_typeid or getattr(proxytype, "_method_to_typeid_", None) or {}
        for key, value in method_to_typeid.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"method_to_typeid must map names to typeids, got {key!r}: {value!r}")
        cls._registry[typeid] = (callable, tuple(exposed) if exposed is not None else None,
                                 dict(method_to_typeid), proxytype)
        if create_method:
            def temp(self, *args, **kwds):
                return self._proxy(typeid, proxytype, *args, **kwds)
            temp.__name__ = typeid
            setattr(cls, typeid, temp)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._state} at {self._address}>"


def _run_server(registry: Dict[str, tuple], authkey: Optional[bytes], reply: Any,
                initializer: Optional[Callable[..., Any]], initargs: tuple) -> None:
    if initializer is not None:
        initializer(*initargs)
    _serve(registry, authkey, reply)


class SyncManager(BaseManager):
    """A manager with multiprocessing's SyncManager typeids."""


for _typeid, _callable, _proxy in (
        ("Queue", queue.Queue, None), ("JoinableQueue", queue.Queue, None),
        ("Event", threading.Event, EventProxy), ("Lock", threading.Lock, AcquirerProxy),
        ("RLock", threading.RLock, AcquirerProxy), ("Semaphore", threading.Semaphore, AcquirerProxy),
        ("BoundedSemaphore", threading.BoundedSemaphore, AcquirerProxy),
        ("Condition", threading.Condition, ConditionProxy), ("Barrier", threading.Barrier, BarrierProxy),
        ("Pool", _pool, PoolProxy), ("list", list, ListProxy), ("dict", dict, DictProxy),
        ("Value", Value, ValueProxy), ("Array", Array, ArrayProxy), ("Namespace", Namespace, NamespaceProxy)):
    SyncManager.register(_typeid, _callable, _proxy)
SyncManager.register("Iterator", proxytype=IteratorProxy, create_method=False)
SyncManager.register("AsyncResult", create_method=False)


# -- asynchronous calls --------------------------------------------------------------------------

class Handle:
    """The result of one asynchronous call, collected with :meth:`result`."""

    def __init__(self, proxy: BaseProxy, caller: _rpc.Caller, req_id: int) -> None:
        self._proxy, self._caller, self._req_id = proxy, caller, req_id
        self._answer: Optional[Tuple[int, List[Any]]] = None

    def result(self, timeout: Optional[float] = None) -> Any:
        """The call's result (or its exception raised here). TimeoutError if not done in ``timeout`` s."""
        if self._answer is None:
            self._answer = self._caller.collect(self._req_id, timeout)
            if self._answer is None:
                raise TimeoutError(f"the call did not finish within {timeout} s")
        return self._proxy._answer(*self._answer)

    get = result

    def done(self) -> bool:
        """True once the result has arrived (does not wait)."""
        if self._answer is None:
            self._answer = self._caller.collect(self._req_id, 0)
        return self._answer is not None

    ready = done


class AsyncProxy:
    """Calls the methods of a proxy's referent without waiting: each returns a :class:`Handle`.

    Calls run concurrently in the server, so their order is not guaranteed. ``proxy.sync`` is the
    ordinary (waiting) proxy. Operators are reached by name: ``aproxy.__getitem__(key)``.
    """

    def __init__(self, proxy: BaseProxy) -> None:
        self.sync = proxy

    def __getattr__(self, name: str) -> Callable[..., Handle]:
        proxy = self.sync
        exposed = proxy._exposed_runtime or proxy._exposed_ or ()
        if name not in exposed:
            raise AttributeError(f"{proxy._token.typeid} proxies expose no method {name!r}")

        def call(*args: Any, **kwds: Any) -> Handle:
            caller = _async_caller(proxy._token.address, proxy._key())
            req_id = caller.submit(dumps(("call", proxy._token.id, name, args, kwds)), _rpc.CALL_CONCURRENT)
            return Handle(proxy, caller, req_id)
        call.__name__ = name
        return call

    def __reduce__(self) -> Any:
        return AsyncProxy, (self.sync,)

    def __repr__(self) -> str:
        return f"<AsyncProxy of {self.sync!r}>"


def asynchronous(proxy: BaseProxy) -> AsyncProxy:
    """The same shared object, with methods that return handles instead of waiting."""
    if not isinstance(proxy, BaseProxy):
        raise TypeError(f"expected a manager proxy, not {type(proxy).__name__}")
    return AsyncProxy(proxy)


class AsyncManager(SyncManager):
    """A SyncManager whose objects come as :class:`AsyncProxy`: every call returns a :class:`Handle`."""

    def _proxy(self, typeid: str, proxytype: Optional[type], *args: Any, **kwds: Any) -> Any:
        return AsyncProxy(super()._proxy(typeid, proxytype, *args, **kwds))


def Manager(*, ctx: Any = None) -> SyncManager:
    """A started :class:`SyncManager`; see :func:`multiprocessing.Manager`."""
    manager = SyncManager()
    manager.start()
    return manager


# The finalizer of each server this process started (those already run are pruned at each start).
_running: List[weakref.finalize] = []


def _stop_server(process: "_process.Process", address: str, authkey: bytes, timeout: float) -> None:
    """Ask the server at ``address`` to stop, wait up to ``timeout`` + 5 s, then terminate it."""
    try:
        if process._exitcode is None and not _rpc.is_dead(address):
            _request(address, authkey, "shutdown")
    except (ConnectionError, OSError):
        pass
    process.join(timeout + 5)
    if process.exitcode is None:
        process.terminate()
        process.join(5)
    _rpc.mark_dead(address)


def _run_now(finalizer: weakref.finalize) -> None:
    """Run ``finalizer`` once, even at exit (where weakref's own exit hook has disabled calling it)."""
    info = finalizer.detach()
    if info is not None:
        _, func, args, kwargs = info
        func(*args, **kwargs)


def _shutdown_all() -> None:
    """At exit, before roving joins its children: stop the managers still running (as multiprocessing)."""
    for finalizer in list(_running):
        try:
            _run_now(finalizer)
        except Exception:
            log.exception("roving: a manager's server could not be stopped at exit")


atexit.register(_shutdown_all)
