"""Objects homed at one process and used from any: the base of :mod:`roving.synchronize` (locks & co) and
:mod:`roving.sharedctypes` (Value, Array).

An object's state lives in the process that created it (its *home*), like a queue's items, and is served
by that process's node I/O thread: the node's ``sync`` service, a :class:`Home` (made on first use by
``node.service``, see :func:`home`). Other processes, and the home itself, operate on it with requests over
authenticated connections, through a :class:`Homed` handle, which is picklable. So:

* each operation is one round trip to the home (about 0.1 ms on one machine), not a system call;
* every timeout is kept by the home (:meth:`Home.later`), so a waiter that gave up is never handed
  anything afterwards;
* an object lives as long as its home process; when that process has ended, every operation raises
  :class:`~roving.transport.errors.ServerGone` (a ``ConnectionError``) within a few seconds instead of hanging.

A module adds a kind of object with :func:`register_kind`: a factory of the home-side state, which then
serves the operations its handles send (:meth:`State.serve`, with the home's lock held).
"""
from __future__ import annotations

import heapq
import itertools
import pickle
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .transport import rpc as _rpc
from . import config as _config
from .stdlib_process import refuse_standard_start
from .transport import session as _session
from .transport import timeouts

__all__ = ["OP", "Waiter", "State", "Home", "home", "register_kind", "picklable_error", "who", "Homed"]

OP = b"sync"
#: The key of the home in its node's services (``node.service``).
SERVICE = "sync"

#: An answer to serve: (status, result), or None when it comes later (:meth:`Home.fulfil`).
Answer = Optional[Tuple[int, Any]]


# -- the home: server side --------------------------------------------------------------------

class Waiter:
    """One request waiting at the home for its answer: who asked (process/thread), and what to send."""

    __slots__ = ("ident", "req_id", "done", "who", "count", "result", "cond_timeout")

    def __init__(self, ident: bytes, req_id: int, who: str = "", count: int = 1, result: Any = True) -> None:
        self.ident, self.req_id, self.done = ident, req_id, False
        self.who, self.count, self.result = who, count, result


class State:
    """The home side of one homed object."""

    def serve(self, home: "Home", method: str, w: Waiter, timeout: float, args: Tuple[Any, ...]) -> Answer:
        """Run ``method`` (home.lock held, on the node's I/O thread: never blocks). Answer now with
        (status, result), or return None and answer later with ``home.fulfil(w, ...)``. An exception
        raised goes back to the caller."""
        raise ValueError(f"unknown operation {method!r}")


_kinds: Dict[str, Callable[..., State]] = {}


def register_kind(kind: str, factory: Callable[..., State]) -> None:
    """Homes make objects of ``kind`` with ``factory(home, *args)`` (args: what the handle's ``_create``
    was given). Called at import by the module that defines the kind; a process that holds a handle of a
    kind has imported that module, so its home knows the kind."""
    _kinds[kind] = factory


def picklable_error(exc: BaseException) -> BaseException:
    """``exc``, or a RuntimeError naming it when it cannot be pickled (to send it back)."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class Home(_rpc.Server):
    """The objects created in (or homed at) this process, served by its node's I/O thread."""

    def __init__(self, node: Any) -> None:
        self.lock = threading.Lock()
        self.objects: Dict[int, State] = {}
        self._ids = itertools.count(1)
        self._timers: List[Tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._timer_wake = threading.Condition(self.lock)
        threading.Thread(target=self._run_timers, name="roving-sync-timers", daemon=True).start()
        super().__init__(node, OP)

    # called with self.lock held
    def later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` in ``delay`` seconds on the home's timer thread, with the lock held."""
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._seq), fn))
        self._timer_wake.notify()

    def fulfil(self, w: Waiter, status: int, result: Any,
               undeliverable: Optional[Callable[[], None]] = None) -> None:
        """Answer ``w`` (``undeliverable()`` runs if its process has gone, to take back what it was given)."""
        w.done = True
        self.answer(w.ident, w.req_id, status, [pickle.dumps(result)], undeliverable)

    def _run_timers(self) -> None:
        with self.lock:
            while True:
                if not self._timers:
                    self._timer_wake.wait()
                    continue
                due = self._timers[0][0] - time.monotonic()
                if due > 0:
                    self._timer_wake.wait(due)
                    continue
                _, _, fn = heapq.heappop(self._timers)
                try:
                    fn()
                except Exception:
                    _rpc.log.exception("roving: a synchronization timeout could not be handled")

    def create(self, kind: str, args: Tuple[Any, ...]) -> int:
        """A new object of ``kind`` (see :func:`register_kind`); its id here."""
        factory = _kinds.get(kind)
        if factory is None:
            raise ValueError(f"unknown kind {kind!r}")
        obj = factory(self, *args)
        with self.lock:
            oid = next(self._ids)
            self.objects[oid] = obj
        return oid

    def serve(self, ident: bytes, req_id: int, kind: int, frames: List[Any]) -> None:
        method, oid, who, timeout, args = pickle.loads(frames[0].bytes)  # noqa: S301  (a request from an authenticated peer: the node drops the frames of others)
        timeout = timeouts.from_wire(timeout)
        w = Waiter(ident, req_id, who)
        try:
            if method == "new":
                out: Answer = (_rpc.OK, self.create(*args))
            else:
                with self.lock:
                    obj = self.objects.get(oid)
                    if obj is None:
                        raise ValueError("no such synchronization object at this process")
                    out = obj.serve(self, method, w, timeout, args)
        except Exception as exc:
            if kind != _rpc.TELL:
                self.fulfil(w, _rpc.ERR, picklable_error(exc))
            return
        if out is not None and kind != _rpc.TELL:
            self.fulfil(w, *out)


def home() -> Home:
    """This process's home of homed objects (started on first use)."""
    return _session.current().node().service(SERVICE, Home)


# -- client side ------------------------------------------------------------------------------

_callers = threading.local()


def caller(address: str) -> _rpc.Caller:
    """This thread's connection to the home at ``address``."""
    cache = getattr(_callers, "by_address", None)
    if cache is None:
        cache = _callers.by_address = {}
    found = cache.get(address)
    if found is None:
        session = _session.current()
        found = cache[address] = _rpc.Caller(address, session.secret, OP, "the process that homes this "
                                             "synchronization object",
                                             connect_timeout=min(10.0, _config.current().connect_timeout))
    return found


def who() -> str:
    """The calling process and thread, as homes name an owner or a waiter."""
    return f"{_session.current().uid}/{threading.get_ident()}"


class Homed:
    """A handle on an object homed at some process; picklable (its state is the home's address and the
    object's id there). A subclass names its ``_kind`` and calls :meth:`_create` once."""

    _kind = ""

    def __getstate__(self) -> Dict[str, Any]:
        refuse_standard_start(type(self).__name__)
        return self.__dict__

    def _create(self, *args: Any, at: Optional[str] = None) -> None:
        """Make the object at this process's home, or (``at``) at the home with that address."""
        if at is None:
            h = home()
            self._address, self._id = h.node.address, h.create(self._kind, args)
        else:
            self._address = at
            self._id = self._call("new", self._kind, args)

    def _call(self, method: str, *args: Any, timeout: float = -1,
              on_late: Optional[Callable[[int, List[Any]], None]] = None, raw: bool = False) -> Any:
        """``method(*args)`` at the home; its result, or its exception raised here (``raw``: (status,
        result), for statuses of the kind's own). ``timeout`` is the home's (wire form, -1: none)."""
        payload = pickle.dumps((method, getattr(self, "_id", 0), who(), timeout, args))
        status, frames = caller(self._address).call([payload], on_late=on_late)
        result = pickle.loads(frames[0].bytes)  # noqa: S301  (the home's answer, over an authenticated connection)
        if status == _rpc.ERR:
            raise result
        return (status, result) if raw else result
