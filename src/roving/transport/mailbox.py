"""The state of one queue or one pipe direction, held by the process that created it.

A :class:`Mailbox` is plain data guarded by its node's lock: every method must be called with that lock
held. Readers that wait are kept in arrival order and served first come, first served: an item goes
straight to the longest-waiting reader, so no item ever sits at a reader that is not reading. Writers of a
bounded mailbox that find it full wait in order too, with their item already here.

Waiters are either threads of this process (:class:`LocalWaiter`) or requests of another process that
the node answers over the transport; the mailbox does not know which.
"""
from __future__ import annotations

import collections
import dataclasses
from _thread import allocate_lock as _allocate_lock
from typing import Any, Deque, Dict, List, Optional, Tuple

Frames = List[Any]

#: Holder keys of pipe ends in transit between processes start with this.
TRANSIT = b"transit-"
#: First frame of the item that marks where a pipe direction moved to a direct stream
#: (:mod:`roving.transport.link`); the second frame is the stream's token.
SWITCH = b"\x00roving-switch"

# Reply statuses, shared with the wire protocol.
OK, EMPTY, FULL, EOF, ERROR = 0, 1, 2, 3, 4


@dataclasses.dataclass(frozen=True)
class Access:
    """Who, besides the process that holds a mailbox, may use it (checked by :class:`.boxes.Boxes`).

    The default is every trusted member of the session, as multiprocessing's objects are shared.
    ``owner``: only the process with that node id may (a child's start-up mailboxes: no other process
    can take what was left there for it). ``untrusted``: untrusted members (:attr:`.identity.Peer.trusted`)
    may put items and ask the size, nothing more; the bytes they may leave waiting are bounded by
    ``untrusted_bytes`` (a writer that would pass the bound has its item refused and is counted in
    :attr:`Mailbox.overflowed`). ``stamp``: every item's first frame is the node id of the process that
    put it, as its connection authenticated it (this process's own for a local put): a reader knows who
    wrote each item without trusting anything the item says.
    An untrusted mailbox is always stamped (the bound is kept per writer).
    """
    owner: Optional[str] = None
    untrusted: bool = False
    untrusted_bytes: int = 256 << 20
    stamp: bool = False

    def __post_init__(self) -> None:
        if self.untrusted and not self.stamp:
            raise ValueError("a mailbox open to untrusted writers must stamp their items")


SHARED = Access()


class _Gate(list):
    """The item that stops a pipe direction's readers while its direct stream is taken down."""

    __slots__ = ("token", "owner")

    def __init__(self, token: bytes, owner: Any) -> None:
        super().__init__([SWITCH, token])
        self.token, self.owner = token, owner


class Waiter:
    """Someone blocked on a mailbox; ``fulfil`` is called exactly once, with the node lock held."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False

    def fulfil(self, status: int, frames: Optional[Frames] = None) -> None:
        raise NotImplementedError


class LocalWaiter(Waiter):
    """A thread of this process waiting on a lock that ``fulfil`` releases (the cheapest wake-up)."""

    __slots__ = ("_lock", "status", "frames")

    def __init__(self) -> None:
        self.done = False
        self._lock = _allocate_lock()
        self._lock.acquire()
        self.status = EMPTY
        self.frames: Optional[Frames] = None

    def fulfil(self, status: int, frames: Optional[Frames] = None) -> None:
        self.done = True
        self.status, self.frames = status, frames
        self._lock.release()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds (-1: forever); True once fulfilled."""
        return self._lock.acquire(True, timeout)


class Mailbox:
    """A FIFO of serialized items with waiting readers, waiting writers and (for pipes) end-of-file."""

    def __init__(self, maxsize: int = 0, track_writers: bool = False, access: Access = SHARED) -> None:
        self.maxsize = maxsize if maxsize > 0 else 0
        self.access = access
        #: Bytes of the items waiting here by untrusted writer (each bounded by ``access.untrusted_bytes``).
        self.untrusted_held: Dict[str, int] = {}
        #: Untrusted writers whose items were refused for that bound, with how many were.
        self.overflowed: Dict[str, int] = {}
        self.items: Deque[Frames] = collections.deque()
        self.getters: Deque[Waiter] = collections.deque()
        self.pollers: List[Waiter] = []
        self.putters: Deque[Tuple[Waiter, Frames]] = collections.deque()
        self.joiners: List[Waiter] = []
        self.unfinished = 0
        # Pipes: who may still write. End-of-file once nobody can and nothing is left.
        self.track_writers = track_writers
        self.writers: Dict[bytes, int] = {}
        self.released_early: set = set()
        # Pipes: while a direct stream is taken down, a gate stands where its messages belong.
        # Readers stop in front of it; what the stream still carried is inserted before it.
        self.gates = 0

    # -- state ---------------------------------------------------------------------------------
    def full(self) -> bool:
        return bool(self.maxsize) and len(self.items) >= self.maxsize

    def at_eof(self) -> bool:
        return self.track_writers and not self.writers and not self.items

    def _ready(self) -> bool:
        """An item can be read now (the oldest is not a gate)."""
        return bool(self.items) and type(self.items[0]) is not _Gate

    # -- writers -------------------------------------------------------------------------------
    def put(self, frames: Frames, waiter: Optional[Waiter] = None) -> int:
        """Store or hand over ``frames``. Returns OK, FULL (no waiter given) or -1 (waiter queued)."""
        if self.full() or self.putters:
            if waiter is None:
                return FULL
            self.putters.append((waiter, frames))
            return -1
        self._accept(frames)
        return OK

    def _accept(self, frames: Frames) -> None:
        self.unfinished += 1
        while self.getters and not self.gates:
            getter = self.getters.popleft()
            if not getter.done:
                getter.fulfil(OK, frames)
                return
        self.items.append(frames)
        if self.access.untrusted:
            self._held(frames, 1)
        if self._ready():
            self._wake_pollers(OK)

    def put_front(self, frames: Frames) -> None:
        """Return an item that a reader took but could not deliver; it becomes the next one read."""
        self.items.appendleft(frames)
        if self.access.untrusted:
            self._held(frames, 1)
        self._serve_ready()

    def admits(self, writer: str, size: int) -> bool:
        """Whether the untrusted ``writer`` may leave ``size`` bytes more here (``access.untrusted_bytes``);
        a refusal is counted in :attr:`overflowed`."""
        if self.untrusted_held.get(writer, 0) + size <= self.access.untrusted_bytes:
            return True
        self.overflowed[writer] = self.overflowed.get(writer, 0) + 1
        return False

    def _held(self, item: Frames, sign: int) -> None:
        """Count an item (stamped: its first frame is its writer) in or out of its writer's bytes held."""
        if type(item) is _Gate:
            return
        writer = bytes(item[0]).decode(errors="replace")
        left = self.untrusted_held.get(writer, 0) + sign * sum(len(f) for f in item[1:])
        if left > 0:
            self.untrusted_held[writer] = left
        else:
            self.untrusted_held.pop(writer, None)

    def _serve_ready(self) -> None:
        """Hand readable items to waiting readers, then tell pollers if one is left."""
        while self.getters and self._ready():
            getter = self.getters.popleft()
            if not getter.done:
                frames = self.items.popleft()
                if self.access.untrusted:
                    self._held(frames, -1)
                getter.fulfil(OK, frames)
        if self._ready():
            self._wake_pollers(OK)

    def _admit_putters(self) -> None:
        while self.putters and not self.full():
            waiter, frames = self.putters.popleft()
            if waiter.done:
                continue
            waiter.fulfil(OK)
            self._accept(frames)

    # -- readers -------------------------------------------------------------------------------
    def get(self, waiter: Optional[Waiter] = None) -> Tuple[int, Optional[Frames]]:
        """Take the oldest item: (OK, frames), (EOF, None), (EMPTY, None) or (-1, None) when queued."""
        if self._ready():
            frames = self.items.popleft()
            if self.access.untrusted:
                self._held(frames, -1)
            self._admit_putters()
            return OK, frames
        if self.at_eof():
            return EOF, None
        if waiter is None:
            return EMPTY, None
        self.getters.append(waiter)
        return -1, None

    def poll(self, waiter: Optional[Waiter] = None) -> int:
        """OK when an item is ready, EOF, EMPTY, or -1 when ``waiter`` was queued."""
        if self._ready() or self.putters:
            return OK
        if self.at_eof():
            return EOF
        if waiter is None:
            return EMPTY
        self.pollers.append(waiter)
        return -1

    def _wake_pollers(self, status: int) -> None:
        pollers, self.pollers = self.pollers, []
        for poller in pollers:
            if not poller.done:
                poller.fulfil(status)

    # -- joinable queues -----------------------------------------------------------------------
    def task_done(self) -> int:
        if self.unfinished <= 0:
            return ERROR
        self.unfinished -= 1
        if self.unfinished == 0:
            joiners, self.joiners = self.joiners, []
            for joiner in joiners:
                if not joiner.done:
                    joiner.fulfil(OK)
        return OK

    def join(self, waiter: Optional[Waiter] = None) -> int:
        if self.unfinished == 0:
            return OK
        if waiter is None:
            return EMPTY
        self.joiners.append(waiter)
        return -1

    # -- pipe ends -----------------------------------------------------------------------------
    def hold(self, key: bytes) -> None:
        """``key`` (a process) can write: readers wait instead of seeing end-of-file."""
        if key in self.released_early:
            self.released_early.discard(key)  # its release overtook it: nothing is held
            return
        self.writers[key] = self.writers.get(key, 0) + 1

    def release(self, key: bytes, all_holds: bool = False) -> None:
        if key not in self.writers and key.startswith(TRANSIT):
            # A pipe end in transit is held by its sender and released by its receiver, over two
            # different connections: the release can arrive first. Remember it for the hold.
            self.released_early.add(key)
            return
        count = self.writers.get(key, 0)
        if count <= 1 or all_holds:
            self.writers.pop(key, None)
        else:
            self.writers[key] = count - 1
        if self.at_eof():
            self.release_waiters_at_eof()

    def close_gate(self, token: bytes, owner: str, consumed: bool) -> None:
        """Stop readers where the messages of the direct stream ``token`` belong, until :meth:`open_gate`.

        ``consumed``: the stream's reader had read the stream's switch item, so everything now here is
        newer than the stream and the gate goes first. Otherwise the gate takes the switch item's place,
        or, if the writer has not put it yet, the last place (all the writer puts from now on is newer).
        ``owner`` is the process relaying the stream; :meth:`open_gates_of` opens its gates if it dies.
        """
        gate = _Gate(token, owner)
        self.gates += 1
        if consumed:
            self.items.appendleft(gate)
            return
        for i, frames in enumerate(self.items):
            if len(frames) == 2 and bytes(frames[0]) == SWITCH and bytes(frames[1]) == token:
                self.items[i] = gate
                return
        self.items.append(gate)

    def _gate_at(self, token: bytes) -> int:
        for i, item in enumerate(self.items):
            if type(item) is _Gate and item.token == token:
                return i
        return -1

    def insert_at_gate(self, token: bytes, frames: Frames) -> None:
        """Store an item the direct stream carried, in front of its gate (last if there is none)."""
        self.unfinished += 1
        i = self._gate_at(token)
        if i < 0:
            self.items.append(frames)
        else:
            self.items.insert(i, frames)
        self._serve_ready()

    def open_gate(self, token: bytes) -> None:
        """Let readers past the gate of stream ``token``."""
        i = self._gate_at(token)
        if i >= 0:
            del self.items[i]
            self.gates -= 1
        self._serve_ready()
        if self.at_eof():
            self.release_waiters_at_eof()

    def open_gates_of(self, owner: str) -> None:
        """Open the gates that ``owner`` (a process that ended) was to open."""
        for item in [i for i in self.items if type(i) is _Gate and i.owner == owner]:
            self.open_gate(item.token)

    def release_waiters_at_eof(self) -> None:
        while self.getters:
            getter = self.getters.popleft()
            if not getter.done:
                getter.fulfil(EOF)
        self._wake_pollers(EOF)

    def cancel(self, waiter: Waiter, status: int) -> None:
        """Give up on ``waiter`` (its time ran out): it is answered with ``status`` and forgotten."""
        if waiter.done:
            return
        waiter.fulfil(status)
        for queue in (self.getters, self.pollers, self.joiners):
            try:
                queue.remove(waiter)
            except ValueError:
                pass
        for entry in list(self.putters):
            if entry[0] is waiter:
                self.putters.remove(entry)
