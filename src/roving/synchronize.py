"""Lock, RLock, Semaphore, BoundedSemaphore, Event, Condition and Barrier across roving processes.

multiprocessing's primitives are POSIX semaphores, which only processes of one machine share. roving's
work between processes on any backend: each is a homed object (:mod:`roving._homed`): its state lives in
the process that created it (its *home*), like a queue's items, and is served by that process's node I/O
thread; other processes (and the home itself) operate on it with requests over authenticated
connections. This module holds both halves of each primitive: its state at the home (``_Sem``, ``_Cond``,
``_Event``, ``_Barrier``) and the handle users hold (``Lock`` ...). So:

* each ``acquire``/``release``/``wait``/``set`` is one round trip to the home (about 0.1 ms on one
  machine), not a system call;
* waiters are served in the order they started waiting (FIFO), and every timeout is kept by the home,
  so a waiter that gave up is never handed the lock afterwards;
* a primitive lives as long as its home process; when that process has ended, every operation raises
  :class:`~roving.transport.rpc.ServerGone` (a ``ConnectionError``) within a few seconds instead of hanging.

Owner semantics follow multiprocessing: a lock's owner is (process, thread); ``RLock.release`` by a
non-owner raises ``AssertionError``; releasing an unlocked ``Lock`` or a ``BoundedSemaphore`` past its
initial value raises ``ValueError``; ``Condition.wait``/``notify`` without holding the lock raise
``RuntimeError``. Primitives are picklable, so they can be passed to any roving process.
"""
from __future__ import annotations

import functools
import pickle
import threading
import time
from collections import deque
from threading import BrokenBarrierError
from typing import Any, Callable, Deque, List, Optional, Tuple, TypeVar

from .transport import rpc as _rpc
from . import process as _process
from ._homed import OP  # noqa: F401  (the homes' operation, importable here as before)
from ._homed import Answer, Home, Homed, State, Waiter, caller, home, picklable_error, register_kind, who
from .transport import session as _session
from .transport import timeouts

__all__ = ["Lock", "RLock", "Semaphore", "BoundedSemaphore", "Event", "Condition", "Barrier"]

#: what a ``Condition.wait_for`` predicate returns (and the wait returns)
T = TypeVar("T")

# Statuses beyond OK/ERR.
_RUN_ACTION = 2


# -- the home: server side --------------------------------------------------------------------

class _Primitive(State):
    """The state of a primitive at its home; its operations are :func:`_serve`'s."""

    def serve(self, home: Home, method: str, w: Waiter, timeout: float, args: Tuple[Any, ...]) -> Answer:
        return _serve(self, home, method, w, timeout, args)


class _Sem(_Primitive):
    """Lock (maxvalue 1, owned), RLock (recursive, owned) and (bounded) semaphores."""

    def __init__(self, kind: str, value: int = 1, maxvalue: Optional[int] = None) -> None:
        self.kind, self.value, self.maxvalue = kind, value, maxvalue
        self.owner: Optional[str] = None
        self.count = 0
        self.queue: Deque[Waiter] = deque()

    def _free(self) -> bool:
        return self.owner is None if self.kind == "rlock" else self.value > 0

    def _take(self, who: str, count: int) -> None:
        if self.kind == "rlock":
            self.owner, self.count = who, count
        else:
            self.value -= 1
            if self.kind == "lock":
                self.owner = who

    def acquire(self, home: Home, w: Waiter, timeout: float) -> Optional[Tuple[int, Any]]:
        if self.kind == "rlock" and self.owner == w.who:
            self.count += 1
            return _rpc.OK, True
        if self._free() and not self.queue:
            self._take(w.who, w.count)
            return _rpc.OK, True
        if timeout == 0:
            return _rpc.OK, False
        self.queue.append(w)
        if timeout > 0:
            home.later(timeout, lambda: self._expire(home, w))
        return None

    def _expire(self, home: Home, w: Waiter) -> None:
        if not w.done:
            self.queue.remove(w)
            home.fulfil(w, _rpc.OK, False)

    def is_mine(self, who: str) -> bool:
        return self.owner == who

    def release(self, home: Home, who: str, full: bool = False) -> int:
        """Release once (``full``: an RLock entirely); returns the recursion count released."""
        released = 1
        if self.kind == "rlock":
            if self.owner != who:
                raise AssertionError("attempt to release recursive lock not owned by thread")
            if full:
                released, self.count = self.count, 0
            else:
                self.count -= 1
            if self.count:
                return released
            self.owner = None
        elif self.kind == "lock":
            if self.value >= 1:
                raise ValueError("semaphore or lock released too many times")
            self.value, self.owner = 1, None
        else:
            if self.maxvalue is not None and self.value >= self.maxvalue:
                raise ValueError("semaphore or lock released too many times")
            self.value += 1
        self.hand_off(home)
        return released

    def hand_off(self, home: Home) -> None:
        while self.queue and self._free():
            w = self.queue.popleft()
            self._take(w.who, w.count)
            home.fulfil(w, _rpc.OK, w.result, undeliverable=functools.partial(self._take_back, home, w))

    def _take_back(self, home: Home, w: Waiter) -> None:
        """The waiter's process left before the grant reached it: release in its name."""
        with home.lock:
            if self.kind in ("lock", "rlock") and self.owner != w.who:
                return
            self.release(home, w.who, full=True)

    def info(self) -> Tuple[Any, ...]:
        return self.kind, self.value, self.owner, self.count, len(self.queue)


class _Cond(_Primitive):
    def __init__(self, lock: _Sem) -> None:
        self.lock = lock
        self.waiters: Deque[Waiter] = deque()

    def info(self) -> int:
        return len(self.waiters)

    def _check_owned(self, who: str, what: str) -> None:
        if not self.lock.is_mine(who):
            raise RuntimeError(f"cannot {what} on un-acquired lock")

    def wait(self, home: Home, w: Waiter, timeout: float) -> None:
        self._check_owned(w.who, "wait")
        w.count = self.lock.release(home, w.who, full=True)
        self.waiters.append(w)
        if timeout >= 0:
            home.later(timeout, lambda: self._expire(home, w))

    def _expire(self, home: Home, w: Waiter) -> None:
        if w in self.waiters:
            self.waiters.remove(w)
            self._reacquire(home, w, False)

    def _reacquire(self, home: Home, w: Waiter, result: bool) -> None:
        w.result = result
        if self.lock._free() and not self.lock.queue:
            self.lock._take(w.who, w.count)
            home.fulfil(w, _rpc.OK, result)
        else:
            self.lock.queue.append(w)

    def notify(self, home: Home, who: str, n: Optional[int]) -> None:
        self._check_owned(who, "notify")
        count = len(self.waiters) if n is None else n
        while self.waiters and count > 0:
            self._reacquire(home, self.waiters.popleft(), True)
            count -= 1


class _Event(_Primitive):
    def __init__(self) -> None:
        self.flag = False
        self.waiters: List[Waiter] = []

    def wait(self, home: Home, w: Waiter, timeout: float) -> Optional[Tuple[int, Any]]:
        if self.flag or timeout == 0:
            return _rpc.OK, self.flag
        self.waiters.append(w)
        if timeout > 0:
            home.later(timeout, lambda: self._expire(home, w))
        return None

    def _expire(self, home: Home, w: Waiter) -> None:
        if not w.done:
            self.waiters.remove(w)
            home.fulfil(w, _rpc.OK, False)

    def set(self, home: Home) -> None:
        self.flag = True
        waiters, self.waiters = self.waiters, []
        for w in waiters:
            home.fulfil(w, _rpc.OK, True)


class _Barrier(_Primitive):
    def __init__(self, parties: int, has_action: bool) -> None:
        self.parties, self.has_action = parties, has_action
        self.waiters: List[Waiter] = []
        self.broken = False
        self.action_runner: Optional[Waiter] = None
        # Callers of the next round that arrive while the action of this one runs.
        self.early: List[Tuple[Waiter, float]] = []

    def wait(self, home: Home, w: Waiter, timeout: float) -> Optional[Tuple[int, Any]]:
        if self.broken:
            raise BrokenBarrierError
        if self.action_runner is not None:
            self.early.append((w, timeout))
            return None
        w.result = len(self.waiters)
        self.waiters.append(w)
        if len(self.waiters) == self.parties:
            if self.has_action:
                self.action_runner = w
                home.fulfil(w, _RUN_ACTION, None)
            else:
                self._release(home)
            return None
        if timeout >= 0:
            home.later(timeout, lambda: self._expire(home, w))
        return None

    def _expire(self, home: Home, w: Waiter) -> None:
        if not w.done and w in self.waiters:
            self.abort(home)

    def _release(self, home: Home) -> None:
        waiters, self.waiters, self.action_runner = self.waiters, [], None
        for w in waiters:
            if not w.done:
                home.fulfil(w, _rpc.OK, w.result)
        early, self.early = self.early, []
        for w, timeout in early:
            self.wait(home, w, timeout)

    def action_done(self, home: Home, w: Waiter, ok: bool) -> Tuple[int, Any]:
        runner = self.action_runner
        if runner is None:
            raise BrokenBarrierError
        index = runner.result
        if ok:
            self._release(home)
            return _rpc.OK, index
        self.abort(home)
        return _rpc.OK, index

    def abort(self, home: Home) -> None:
        self.broken = True
        waiters, self.waiters, self.action_runner = self.waiters, [], None
        waiters += [w for w, _ in self.early]
        self.early = []
        for w in waiters:
            if not w.done:
                home.fulfil(w, _rpc.ERR, picklable_error(BrokenBarrierError()))

    def reset(self, home: Home) -> None:
        if self.waiters:
            self.abort(home)
        self.broken = False


def _serve(obj: Any, home: Home, method: str, w: Waiter, timeout: float, args: Tuple[Any, ...]) -> Answer:
    """The operations of the primitives, by name (home.lock held)."""
    if method == "acquire":
        return obj.acquire(home, w, timeout)
    if method == "release":
        obj.release(home, w.who)
        return _rpc.OK, None
    if method == "info":
        return _rpc.OK, obj.info()
    if method == "wait":  # Condition, Event, Barrier
        if isinstance(obj, _Cond):
            obj.wait(home, w, timeout)
            return None
        return obj.wait(home, w, timeout)
    if method == "notify":
        obj.notify(home, w.who, args[0])
        return _rpc.OK, None
    if method == "set":
        obj.set(home)
        return _rpc.OK, None
    if method == "clear":
        obj.flag = False
        return _rpc.OK, None
    if method == "is_set":
        return _rpc.OK, obj.flag
    if method == "action_done":
        return obj.action_done(home, w, args[0])
    if method == "abort":
        obj.abort(home)
        return _rpc.OK, None
    if method == "reset":
        obj.reset(home)
        return _rpc.OK, None
    if method == "barrier_info":
        return _rpc.OK, (len(obj.waiters), obj.broken)
    raise ValueError(f"unknown operation {method!r}")


for _kind in ("lock", "rlock", "sem"):
    register_kind(_kind, lambda home, *args, _kind=_kind: _Sem(_kind, *args))
register_kind("cond", lambda home, lock_id: _Cond(home.objects[lock_id]))
register_kind("event", lambda home: _Event())
register_kind("barrier", lambda home, parties, has_action: _Barrier(parties, has_action))


# -- client side ------------------------------------------------------------------------------

def _timeout(block: bool, timeout: Optional[float]) -> float:
    return timeouts.to_wire(block, timeout)


class _SemLock(Homed):
    def acquire(self, block: bool = True, timeout: Optional[float] = None) -> bool:
        """Acquire; with ``block`` False or a ``timeout``, return False if not acquired in time."""
        wait = _timeout(block, timeout)
        me = who()

        def give_back(status: int, frames: List[Any]) -> None:  # granted after this caller left
            if status == _rpc.OK and pickle.loads(frames[0].bytes):  # noqa: S301  (the home's answer, over an authenticated connection)
                caller(self._address).tell([pickle.dumps(("release", self._id, me, 0, ()))])

        return self._call("acquire", timeout=wait, on_late=give_back)

    def release(self) -> None:
        self._call("release")

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _info(self) -> Tuple[Any, ...]:
        return self._call("info")

    def _owner_name(self, owner: Optional[str]) -> str:
        """The owner as multiprocessing's reprs name it, seen from the calling thread."""
        if owner == who():
            name = _process.current_process().name
            if threading.current_thread().name != "MainThread":
                name += "|" + threading.current_thread().name
            return name
        if owner is None:
            return "None"
        if owner.split("/", 1)[0] == _session.current().uid:
            return "SomeOtherThread"
        return "SomeOtherProcess"


class Lock(_SemLock):
    """A non-recursive lock; see :class:`multiprocessing.Lock`."""

    _kind = "lock"

    def __init__(self, *, ctx: object = None) -> None:
        self._create(1, 1)

    def __repr__(self) -> str:
        try:
            name = self._owner_name(self._info()[2])
        except Exception:
            name = "unknown"
        return f"<Lock(owner={name})>"


class RLock(_SemLock):
    """A recursive lock owned by one thread of one process; see :class:`multiprocessing.RLock`."""

    _kind = "rlock"

    def __init__(self, *, ctx: object = None) -> None:
        self._create(1, None)

    def __repr__(self) -> str:
        try:
            _, _, owner, count, _ = self._info()
            name = self._owner_name(owner)
            if owner is None:
                count = 0
            elif owner != who():
                count = "nonzero"
        except Exception:
            name, count = "unknown", "unknown"
        return f"<RLock({name}, {count})>"


class Semaphore(_SemLock):
    """A counting semaphore; see :class:`multiprocessing.Semaphore`."""

    _kind = "sem"

    def __init__(self, value: int = 1, *, ctx: object = None) -> None:
        if value < 0:
            raise ValueError("semaphore initial value must be >= 0")
        self._maxvalue = self._max(value)
        self._create(int(value), self._maxvalue)

    @staticmethod
    def _max(value: int) -> Optional[int]:
        return None

    def get_value(self) -> int:
        return self._info()[1]

    def __repr__(self) -> str:
        try:
            value: Any = self.get_value()
        except Exception:
            value = "unknown"
        return f"<{type(self).__name__}(value={value})>"


class BoundedSemaphore(Semaphore):
    """A semaphore that may not be released above its initial value (ValueError)."""

    @staticmethod
    def _max(value: int) -> Optional[int]:
        return int(value)

    def __repr__(self) -> str:
        try:
            kind, value, _, _, _ = self._info()
        except Exception:
            value = "unknown"
        return f"<{type(self).__name__}(value={value}, maxvalue={self._maxvalue})>"


class Condition(Homed):
    """A condition variable over a roving Lock or RLock (a new RLock by default).

    The condition's waiters live at the lock's home, so wait() releases the lock and joins the waiters
    in one step: a notify() cannot slip in between.
    """

    _kind = "cond"

    def __init__(self, lock: Optional[_SemLock] = None, *, ctx: object = None) -> None:
        if lock is None:
            lock = RLock()
        if not isinstance(lock, (Lock, RLock)):
            raise TypeError(f"Condition needs a roving Lock or RLock, not {type(lock).__name__}")
        self._lock = lock
        if lock._address == home().node.address:
            self._create(lock._id)
        else:
            self._create(lock._id, at=lock._address)

    def acquire(self, block: bool = True, timeout: Optional[float] = None) -> bool:
        return self._lock.acquire(block, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Release the lock, wait for a notify (or ``timeout``), re-acquire; False if timed out."""
        return self._call("wait", timeout=_timeout(True, timeout))

    def wait_for(self, predicate: Callable[[], T], timeout: Optional[float] = None) -> T:
        result = predicate()
        deadline = timeouts.deadline(timeout)
        while not result:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.wait(left)
            else:
                self.wait()
            result = predicate()
        return result

    def notify(self, n: int = 1) -> None:
        self._call("notify", n)

    def notify_all(self) -> None:
        self._call("notify", None)

    notifyAll = notify_all

    def __repr__(self) -> str:
        try:
            waiting: Any = self._call("info")
        except Exception:
            waiting = "unknown"
        return f"<Condition({self._lock!r}, {waiting})>"


class Event(Homed):
    """An event flag; see :class:`multiprocessing.Event`."""

    _kind = "event"

    def __init__(self, *, ctx: object = None) -> None:
        self._create()

    def is_set(self) -> bool:
        return self._call("is_set")

    def set(self) -> None:
        self._call("set")

    def clear(self) -> None:
        self._call("clear")

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the flag is set or ``timeout`` passes; returns the flag."""
        return self._call("wait", timeout=_timeout(True, timeout))

    def __repr__(self) -> str:
        return f"<{type(self).__qualname__} at {id(self):#x} {'set' if self.is_set() else 'unset'}>"


class Barrier(Homed):
    """A barrier for ``parties`` callers; see :class:`multiprocessing.Barrier`.

    ``action`` (picklable) runs in the process of the last caller to arrive, before any is released; if
    it raises, the barrier breaks. A ``wait`` that times out breaks the barrier for everyone, as in
    :mod:`threading`.
    """

    _kind = "barrier"

    def __init__(self, parties: int, action: Optional[Callable[[], object]] = None,
                 timeout: Optional[float] = None, *, ctx: object = None) -> None:
        if parties < 1:
            raise ValueError("parties must be > 0")
        self._parties, self._action, self._default_timeout = int(parties), action, timeout
        self._create(self._parties, action is not None)

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for all parties; returns this caller's arrival index (0..parties-1)."""
        if timeout is None:
            timeout = self._default_timeout
        status, index = self._call("wait", timeout=_timeout(True, timeout), raw=True)
        if status == _RUN_ACTION:
            try:
                assert self._action is not None  # the home asks only a barrier that has one
                self._action()
            except BaseException:
                self._call("action_done", False)
                raise
            index = self._call("action_done", True)
        return index

    def abort(self) -> None:
        self._call("abort")

    def reset(self) -> None:
        self._call("reset")

    @property
    def parties(self) -> int:
        return self._parties

    @property
    def n_waiting(self) -> int:
        return self._call("barrier_info")[0]

    @property
    def broken(self) -> bool:
        return self._call("barrier_info")[1]

