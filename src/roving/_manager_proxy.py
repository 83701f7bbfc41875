"""The client side of managers: tokens, proxies (a reference to an object in a manager's server whose
method calls run there) and the asynchronous handles of :class:`~roving.managers.AsyncManager`.

Each thread has its own authenticated connection to a server (asynchronous calls share one per server).
When the server process has ended every call raises :class:`~roving.transport.errors.ServerGone`: at once in the
process that started it (:func:`note_started`), within a few seconds elsewhere. Proxies are picklable and
reference-counted at the server (see :mod:`roving.managers`). Public names are re-exported by
:mod:`roving.managers`, where users import them.
"""
from __future__ import annotations

import itertools
import struct
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .transport import rpc as _rpc
from . import config as _config
from . import process as _process
from .stdlib_process import refuse_standard_start
from .transport import session as _session
from .transport import timeouts
from .errors import RemoteError  # noqa: F401  (importable here, where it was defined before)
from .transport.serialize import dumps, loads

OP = b"mgr"
PROXY = 2  # answer status: the result is a new shared object (method_to_typeid)
#: The first frame of an asynchronous call (kind CALL_CONCURRENT): its proxy's lane, unique in the
#: process; the server runs a lane's calls in order, different lanes concurrently.
LANE = struct.Struct("<Q")
_lanes = itertools.count(1)


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


# -- connections to servers and proxies ------------------------------------------------------

_started: Dict[str, Any] = {}  # address -> server process (a roving Process), in the process that started it
_callers = threading.local()
_async_callers: Dict[Tuple[str, bytes], _rpc.Caller] = {}
_async_lock = threading.Lock()


def note_started(address: str, process: Any) -> None:
    """The manager's server at ``address`` is ``process``, started here: calls to it fail at once when
    it has ended."""
    _started[address] = process


def _alive_check(address: str) -> Optional[Callable[[], bool]]:
    proc = _started.get(address)
    if proc is None:
        return None
    return lambda: not _process.ended(proc)


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


def request(address: str, authkey: bytes, *request: Any) -> Any:
    """One request to the manager's server at ``address``; its result, or its error raised here."""
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
            request(token.address, self._key(), "incref", token.id)
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
        if status == PROXY:
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
        if authkey is None:  # the session's: a process that knows the manager's authkey may use it
            refuse_standard_start(f"manager proxy ({self._token.typeid})")
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
            exposed = request(token.address, authkey or _session.current().secret, "call", token.id,
                               "#EXPOSED", (), {})
        proxytype = MakeProxyType(f"AutoProxy[{token.typeid}]", exposed)
        proxytype._by_exposed = True  # not importable by name: rebuilt from its exposed methods
        proxy = BaseProxy.__new__(proxytype)
        proxy.__init__(token, manager=manager, authkey=authkey, exposed=exposed, incref=incref)
        return proxy


_default_registry: Dict[str, tuple] = {}


def use_by_default(registry: Dict[str, tuple]) -> None:
    """Proxies that came without their manager (unpickled) find typeids in ``registry`` (SyncManager's)."""
    global _default_registry
    _default_registry = registry


def _proxytype_for(typeid: str, manager: Any) -> type:
    registry = manager._registry if manager is not None else _default_registry
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

    The calls of one AsyncProxy run in the server in the order they were made, each after the one
    before it has returned (as a connection's calls do): ``env.reset()`` then ``env.step(a)`` steps
    the reset environment, and a call that blocks (``queue.get()``) holds back the proxy's later
    calls. Calls of different AsyncProxy objects run concurrently, also when they reach the same
    object (``asynchronous(aproxy.sync)`` is a second one). ``proxy.sync`` is the ordinary (waiting)
    proxy. Operators are reached by name: ``aproxy.__getitem__(key)``.
    """

    def __init__(self, proxy: BaseProxy) -> None:
        self.sync = proxy
        self._lane = LANE.pack(next(_lanes))

    def __getattr__(self, name: str) -> Callable[..., Handle]:
        proxy, lane = self.sync, self._lane
        exposed = proxy._exposed_runtime or proxy._exposed_ or ()
        if name not in exposed:
            raise AttributeError(f"{proxy._token.typeid} proxies expose no method {name!r}")

        def call(*args: Any, **kwds: Any) -> Handle:
            caller = _async_caller(proxy._token.address, proxy._key())
            req_id = caller.submit([lane, *dumps(("call", proxy._token.id, name, args, kwds))],
                                   _rpc.CALL_CONCURRENT)
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


