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
* When the server process has ended, every proxy call raises :class:`~roving.transport.errors.ServerGone` (a
  ``ConnectionError``): at once in the process that started the manager (it sees the process end), and
  within a few seconds elsewhere (pings go unanswered) — never a hang.
* :class:`AsyncManager` creates proxies whose method calls return a :class:`Handle` at once; each
  proxy's calls run in the server in the order they were made, one after another (as a connection's
  would), the calls of different proxies concurrently; each handle gets its own call's result (matched
  by call id) in whatever order the handles are collected.
* A started manager's server stops at ``shutdown()``, or when the manager is garbage-collected, or at
  exit, whichever comes first (as multiprocessing's Finalize does): a program that never calls
  ``shutdown()`` still exits.
* Objects are reference-counted by the proxies alive in all processes and freed at the server when the
  last one goes (as in multiprocessing, a proxy in flight inside a message does not hold a reference).

This module is the managers themselves and what SyncManager hosts; the server process is
:mod:`roving._manager_server`, the proxies and handles :mod:`roving._manager_proxy` (their public names
are importable from here, as from multiprocessing.managers).
"""
from __future__ import annotations

import array
import atexit
import logging
import queue
import threading
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from .errors import RovingError
from .transport import rpc as _rpc
from . import config as _config
from . import process as _process
# The proxies, MakeProxyType and public_methods are importable from here, as from multiprocessing.managers.
from ._manager_proxy import OP  # noqa: F401  (the managers' operation, importable here as before)
from ._manager_proxy import (ArrayProxy, AcquirerProxy, AsyncProxy, AutoProxy, BarrierProxy,  # noqa: F401
                             BaseListProxy, BasePoolProxy, BaseProxy, ConditionProxy, DictProxy, EventProxy,
                             Handle, IteratorProxy, ListProxy, MakeProxyType, NamespaceProxy, PoolProxy,
                             RemoteError, Token, ValueProxy, asynchronous, note_started, request,
                             use_by_default)
from ._manager_server import public_methods, run_server  # noqa: F401
from .transport import session as _session

log = logging.getLogger(__name__)

__all__ = ["BaseManager", "SyncManager", "AsyncManager", "BaseProxy", "Token", "Namespace", "Value",
           "Array", "RemoteError", "ServerGone", "Handle", "asynchronous", "Manager"]

ServerGone = _rpc.ServerGone



# -- objects SyncManager hosts -------------------------------------------------------------------

class Namespace:
    """A plain object whose attributes are the shared state."""

    def __init__(self, **kwds: object) -> None:
        self.__dict__.update(kwds)

    def __repr__(self) -> str:
        items = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if not k.startswith("_"))
        return f"Namespace({items})"


class Value:
    def __init__(self, typecode: object, value: object, lock: bool = True) -> None:
        self._typecode, self._value = typecode, value

    def get(self) -> Any:
        return self._value

    def set(self, value: object) -> None:
        self._value = value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._typecode!r}, {self._value!r})"

    value = property(get, set)


def Array(typecode: str, sequence: Iterable[Union[int, float, str]], lock: bool = True) -> array.array:
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

    def __init__(self, address: Union[str, Tuple[str, int], None] = None, authkey: Optional[bytes] = None,
                 serializer: str = "pickle",
                 ctx: object = None, *, shutdown_timeout: float = 1.0) -> None:
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

    def start(self, initializer: Optional[Callable[..., object]] = None, initargs: Sequence[object] = ()) -> None:
        """Start the server as a roving Process (a job of the configured backend); returns once it serves."""
        if self._state == "started":
            raise RovingError("Already started server")
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
        self._process = _process.Process(target=run_server, args=(registry, self._authkey, reply,
                                                                  initializer, tuple(initargs)),
                                         name=f"{type(self).__name__}-server")
        self._process.start()
        try:
            self._address = reply.get(timeout=_config.current().connect_timeout + 30)
        except queue.Empty:
            self._process.kill()
            raise RuntimeError(f"the manager's server did not start within its connect timeout; see the "
                               f"output of {self._process.name}") from None
        note_started(self._address, self._process)
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
        request(self._address, self._key(), "count")
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

    def _server(self) -> str:
        """The server's address, once started or connected (RuntimeError before, or after shutdown)."""
        self._check()
        assert self._address is not None  # known from start() or connect() on
        return self._address

    def _create(self, typeid: str, *args: Any, **kwds: Any) -> Tuple[int, Tuple[str, ...]]:
        return request(self._server(), self._key(), "create", typeid, args, kwds)

    def _number_of_objects(self) -> int:
        """How many shared objects the server holds now."""
        return request(self._server(), self._key(), "count")

    def _proxy(self, typeid: str, proxytype: Optional[type], *args: Any, **kwds: Any) -> Any:
        oid, exposed = self._create(typeid, *args, **kwds)
        proxytype = proxytype or AutoProxy
        return proxytype(Token(typeid, self._server(), oid), manager=self, authkey=self._authkey,
                         exposed=exposed, incref=False)

    @classmethod
    def register(cls, typeid: str, callable: Optional[Callable[..., object]] = None, proxytype: Optional[type] = None,
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
            def temp(self: BaseManager, *args: Any, **kwds: Any) -> Any:
                return self._proxy(typeid, proxytype, *args, **kwds)
            temp.__name__ = typeid
            setattr(cls, typeid, temp)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._state} at {self._address}>"


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
use_by_default(SyncManager._registry)



class AsyncManager(SyncManager):
    """A SyncManager whose objects come as :class:`AsyncProxy`: every call returns a :class:`Handle`."""

    def _proxy(self, typeid: str, proxytype: Optional[type], *args: Any, **kwds: Any) -> Any:
        return AsyncProxy(super()._proxy(typeid, proxytype, *args, **kwds))


def Manager(*, ctx: object = None) -> SyncManager:
    """A started :class:`SyncManager`; see :func:`multiprocessing.Manager`."""
    manager = SyncManager()
    manager.start()
    return manager


# The finalizer of each server this process started (those already run are pruned at each start).
_running: List[weakref.finalize] = []


def _stop_server(process: "_process.Process", address: str, authkey: bytes, timeout: float) -> None:
    """Ask the server at ``address`` to stop, wait up to ``timeout`` + 5 s, then terminate it."""
    try:
        if not _process.ended(process) and not _rpc.is_dead(address):
            request(address, authkey, "shutdown")
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
