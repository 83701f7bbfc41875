"""Large read-only data shared with every worker: written once per machine, mapped without a copy.

``handle = roving.shared(obj)`` writes ``obj`` (a numpy array first of all; any picklable object works)
once into a POSIX shared-memory segment and returns a small picklable handle. Pass the handle to workers
(as a Process or Pool argument, through a queue...); ``handle.get()`` there returns the object rebuilt
over the shared memory: numpy arrays are read-only views (``writeable=False``), not copies.

Guarantees:

* Once per machine. On the machine that created it, every process maps the same segment. On another
  machine, the first process that needs it fetches it from the creating process over the authenticated
  transport and writes it into a segment there; the other processes on that machine wait for that copy
  and map it. (On the local backend every process shares the creator's machine: nothing is fetched.)
* Freed when the last user lets go. Every process using a segment holds a shared ``flock`` on it; a
  process lets go when its handle and every object it got from ``get()`` are garbage (or it exits); the
  last one to let go removes the segment. The creator is a user until its handle is dropped or
  :meth:`Shared.release` is called: keep the handle while workers may still start using the data.
  Processes killed with SIGKILL let go too (the kernel drops their locks); only if *every* user of a
  segment is killed that way does the segment outlive them.
* A process that asks for data whose every user has let go gets a clear ``LookupError``.
* Nothing a stranger wrote is unpickled. Segments are opened without following links and must be regular
  files owned by this user and writable by no one else (they are created 0600); the segment's header
  holds a random check value that travels in the handle, compared before anything is read. A file that
  fails any of this (planted by another local user under a released or not yet created name, say) is
  a ``LookupError``; nothing in it is unpickled.
"""
from __future__ import annotations

import errno
import fcntl
import hmac
import mmap
import os
import pickle
import socket
import stat
import struct
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

import _posixshmem

from .errors import RovingError
from .transport import rpc as _rpc
from . import config as _config
from .transport import session as _session
from .transport.serialize import dumps, loads

__all__ = ["shared", "Shared"]

OP = b"shd"
_MAGIC = b"ROVSHD02"
_FILLING, _READY, _DEAD = 0, 1, 2
_CHECK = 16  # bytes of the random check value shared by a handle and its segment
_HEAD = struct.Struct(f"<8sQQ{_CHECK}s")  # magic, state, frames, check; then (offset, length) per frame
_PAIR = struct.Struct("<QQ")
_ALIGN = 64
_CHUNK = 32 << 20
_IN_FLIGHT = 4

_machine: Optional[str] = None


def machine_id() -> str:
    """This machine: host name and boot id (containers of one host share shared memory only if they
    share /dev/shm; a backend that isolates it gives each container its own hostname)."""
    global _machine
    if _machine is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:
            boot = ""
        _machine = f"{socket.gethostname()}/{boot}"
    return _machine


def _layout(frames: List[Any]) -> Tuple[int, List[Tuple[int, int]]]:
    head = _HEAD.size + _PAIR.size * len(frames)
    offset = -(-head // 4096) * 4096
    spans = []
    for frame in frames:
        n = memoryview(frame).nbytes
        spans.append((offset, n))
        offset += -(-max(n, 1) // _ALIGN) * _ALIGN
    return offset, spans


def _write_header(mm: mmap.mmap, state: int, spans: List[Tuple[int, int]], check: bytes) -> None:
    _HEAD.pack_into(mm, 0, _MAGIC, state, len(spans), check)
    for i, span in enumerate(spans):
        _PAIR.pack_into(mm, _HEAD.size + i * _PAIR.size, *span)


class _Stranger(RovingError, LookupError):
    """The file under a segment's name is not one this user's roving wrote."""


def _open(name: str, flags: int) -> int:
    """Open a segment without following links; it must be a regular file of this user that no one else
    may write (raises _Stranger, a LookupError, otherwise)."""
    try:
        fd = _posixshmem.shm_open(name, flags | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _Stranger(f"/dev/shm{name} is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Stranger(f"/dev/shm{name} is not a regular file")
        if st.st_uid != os.getuid():
            raise _Stranger(f"/dev/shm{name} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
        if st.st_mode & 0o022:
            raise _Stranger(f"/dev/shm{name} may be written by others (mode {stat.S_IMODE(st.st_mode):o})")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _state(fd: int, check: bytes) -> int:
    """The segment's state; raises _Stranger when its check value is not the handle's."""
    head = os.pread(fd, _HEAD.size, 0)
    if len(head) < _HEAD.size:
        return _FILLING
    magic, state, _, theirs = _HEAD.unpack(head)
    if magic != _MAGIC:
        return _FILLING
    if not hmac.compare_digest(theirs, check):
        raise _Stranger("its check value is not the handle's")
    return state


def _let_go(fd: int, name: str) -> None:
    """A user is done. Whoever then finds no other user (an exclusive lock succeeds) removes the segment.

    Our own lock is dropped first and a fresh one tried, so that two users leaving at once cannot both
    fail to see the other gone.
    """
    try:
        os.close(fd)
    except OSError:
        pass
    try:
        fd = _open(name, os.O_RDWR)
    except (OSError, LookupError):
        return  # already removed (or replaced by a file that is not ours: left alone)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, struct.pack("<Q", _DEAD), 8)  # a process opening it just now will not use it
        _posixshmem.shm_unlink(name)
    except OSError:  # BlockingIOError: others still use it; FileNotFoundError: removed meanwhile
        pass
    finally:
        os.close(fd)


_finalizers: List[weakref.finalize] = []
_hooked: set = set()


def _let_go_later(obj: Any, fn: Any, *args: Any) -> weakref.finalize:
    """Call ``fn(*args)`` when ``obj`` is garbage, or at the latest when this process's session ends (a
    roving child exits without running atexit handlers, but it closes its node)."""
    fin = weakref.finalize(obj, fn, *args)
    _finalizers[:] = [f for f in _finalizers if f.alive]
    _finalizers.append(fin)
    node = _session.current().node()
    if id(node) not in _hooked:
        _hooked.add(id(node))
        node.at_close(_let_go_all)
    return fin


def _let_go_all() -> None:
    for fin in list(_finalizers):
        fin()


def _map(name: str, locked: int) -> mmap.mmap:
    """A read-only mapping through an open file of its own: mmap keeps its file open, and a flock stays
    while any reference to the locked open file remains, so the lock's file must not be the mapping's.
    It must be the very file ``locked`` has open (already checked)."""
    fd = _open(name, os.O_RDONLY)
    try:
        if not _same_file(fd, locked):
            raise _Stranger(f"/dev/shm{name} was replaced while it was opened")
        return mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


class _Mapping:
    """One process's read-only mapping of a segment, with the shared lock that marks it a user."""

    def __init__(self, fd: int, name: str) -> None:
        self.name = name
        self.mm = _map(name, fd)
        head = self.mm[:_HEAD.size]
        _, _, n, _ = _HEAD.unpack(head)
        self.spans = [_PAIR.unpack_from(self.mm, _HEAD.size + i * _PAIR.size) for i in range(n)]
        # The segment stays while the mmap object lives: every array from get() keeps it alive.
        _let_go_later(self.mm, _let_go, fd, name)

    def load(self) -> Any:
        view = memoryview(self.mm)
        return loads([view[off:off + n] for off, n in self.spans])


# segment name -> this process's mapping (weak: it goes when neither handles nor objects use it)
_mappings: "weakref.WeakValueDictionary[str, mmap.mmap]" = weakref.WeakValueDictionary()
_spans: Dict[str, List[Tuple[int, int]]] = {}
_attach_lock = threading.Lock()


class Shared:
    """A handle on data shared with :func:`shared`; small and picklable. ``get()`` returns the data."""

    def __init__(self, token: str, owner: str, machine: str, nbytes: int, check: bytes) -> None:
        self._token, self._owner, self._machine, self.nbytes = token, owner, machine, nbytes
        self._check = check  # the segment's header must hold the same value before anything is read
        self._mm: Optional[mmap.mmap] = None
        self._creator: Optional[weakref.finalize] = None

    def __getstate__(self) -> tuple:
        return self._token, self._owner, self._machine, self.nbytes, self._check

    def __setstate__(self, state: tuple) -> None:
        type(self).__init__(self, *state)

    def __repr__(self) -> str:
        return f"<roving.Shared {self._token} {self.nbytes} bytes>"

    @property
    def _name(self) -> str:
        # A copy fetched to another machine has a name of its own (and never meets the original).
        return f"/rv-{self._token}" if self._machine == machine_id() else f"/rv-{self._token}-copy"

    def get(self, timeout: Optional[float] = None) -> Any:
        """The shared object, rebuilt over this machine's shared memory (arrays are read-only views).

        The first call on a machine other than the creator's fetches the data (once for that machine);
        others there wait for it, up to ``timeout`` seconds (None: the configured connect timeout, plus
        the transfer). Raises LookupError if every user has let go of the data, or if the file under
        its name is not this data's (not this user's, writable by others, a link, another check value):
        then nothing of it is unpickled.
        """
        if self._mm is None:
            self._mm = self._attach(timeout)
        return _load(self._mm, _spans[self._name])

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        import numpy
        obj = self.get()
        return numpy.asarray(obj, dtype=dtype)

    def release(self) -> None:
        """This handle lets go (objects already returned by get() keep the data until they are gone)."""
        self._mm = None
        if self._creator is not None:
            self._creator()

    def _attach(self, timeout: Optional[float]) -> mmap.mmap:
        with _attach_lock:
            name = self._name
            mm = _mappings.get(name)
            if mm is not None:
                return mm
            deadline = time.monotonic() + (timeout if timeout is not None
                                           else _config.current().connect_timeout + self.nbytes / 50e6)
            while True:
                try:
                    mapping = self._try_open(name)
                    if mapping is None and self._machine != machine_id():
                        mapping = self._try_fetch(name)
                    gone = mapping is None and self._machine == machine_id() and not _exists(name)
                except _Stranger as e:
                    raise LookupError(f"shared data {self._token} cannot be used: {e}; "
                                      "nothing of it was read") from None
                if mapping is not None:
                    _mappings[name] = mapping.mm
                    _spans[name] = mapping.spans
                    return mapping.mm
                if gone:
                    raise LookupError(f"shared data {self._token} is gone: every process that used it "
                                      "(its creator included) has let go of it")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"shared data {self._token} did not become ready in time")
                time.sleep(0.01)

    def _try_open(self, name: str) -> Optional[_Mapping]:
        try:
            fd = _open(name, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a fetcher fills it
            if _state(fd, self._check) != _READY:
                os.close(fd)
                return None
            return _Mapping(fd, name)
        except BaseException:
            os.close(fd)
            raise

    def _try_fetch(self, name: str) -> Optional[_Mapping]:
        try:
            fd = _open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return None  # another process of this machine fetches it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            _fetch_into(fd, self._owner, self._token)
            if _state(fd, self._check) != _READY:
                raise LookupError(f"shared data {self._token} arrived incomplete")
            fcntl.flock(fd, fcntl.LOCK_SH)  # ready: from fetcher to user
            return _Mapping(fd, name)
        except BaseException:
            try:
                _posixshmem.shm_unlink(name)
            finally:
                os.close(fd)
            raise


def _exists(name: str) -> bool:
    try:
        os.close(_open(name, os.O_RDONLY))
        return True
    except FileNotFoundError:
        return False


def _load(mm: mmap.mmap, spans: List[Tuple[int, int]]) -> Any:
    view = memoryview(mm)
    return loads([view[off:off + n] for off, n in spans])


def _fetch_into(fd: int, owner: str, token: str) -> None:
    session = _session.current()
    caller = _rpc.Caller(owner, session.secret, OP, "the process that created this shared data",
                         connect_timeout=_config.current().connect_timeout)
    try:
        status, frames = caller.call([pickle.dumps((token, -1, 0))])
        if status != _rpc.OK:
            raise LookupError(bytes(frames[0]).decode())
        size = struct.unpack("<Q", frames[0].bytes)[0]
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        try:
            pending: List[Tuple[int, int]] = []
            offset = 0
            while offset < size or pending:
                while offset < size and len(pending) < _IN_FLIGHT:
                    n = min(_CHUNK, size - offset)
                    pending.append((caller.submit([pickle.dumps((token, offset, n))]), offset))
                    offset += n
                req_id, at = pending.pop(0)
                answer = caller.collect(req_id)
                assert answer is not None  # no timeout: an answer, or ConnectionLost
                status, frames = answer
                if status != _rpc.OK:
                    raise LookupError(bytes(frames[0]).decode())
                chunk = frames[0].buffer
                mm[at:at + len(chunk)] = chunk
        finally:
            mm.close()
    finally:
        caller.close()


class _Server(_rpc.Server):
    """Serves the bytes of segments this process created, to processes on other machines."""

    def __init__(self, node: Any) -> None:
        self.segments: Dict[str, mmap.mmap] = {}
        self.fetches: Dict[str, int] = {}
        super().__init__(node, OP)

    def serve(self, ident: bytes, req_id: int, kind: int, frames: List[Any]) -> None:
        token, offset, n = pickle.loads(frames[0].bytes)  # noqa: S301  (a request from an authenticated peer: the node drops the frames of others)
        mm = self.segments.get(token)
        if mm is None:
            self.answer(ident, req_id, _rpc.ERR, [b"the creator of this shared data has let go of it"])
            return
        if offset < 0:
            self.fetches[token] = self.fetches.get(token, 0) + 1
            self.answer(ident, req_id, _rpc.OK, [struct.pack("<Q", len(mm))])
            return
        self.answer(ident, req_id, _rpc.OK, [memoryview(mm)[offset:offset + n]])


def _server() -> _Server:
    return _session.current().node().service("shared", _Server)


def _creator_let_go(server: _Server, token: str, fd: int, name: str) -> None:
    mm = server.segments.pop(token, None)
    if mm is not None:
        try:
            mm.close()
        except BufferError:  # a transfer still uses it; it closes when garbage
            pass
    _let_go(fd, name)


def shared(obj: object) -> Shared:
    """Write ``obj`` once into shared memory and return a picklable handle for workers.

    Large buffers (numpy arrays, bytes, PyTorch CPU tensors) are copied once, straight into the segment;
    the rest of the object is pickled. Raises SerializationError if ``obj`` cannot be pickled and
    OSError if shared memory is short.
    """
    frames = dumps(obj)
    size, spans = _layout(frames)
    token, check = os.urandom(8).hex(), os.urandom(_CHECK)
    name = f"/rv-{token}"
    fd = _open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        try:
            for (offset, n), frame in zip(spans, frames):
                mm[offset:offset + n] = memoryview(frame).cast("B")
            _write_header(mm, _READY, spans, check)
        finally:
            mm.close()
        fcntl.flock(fd, fcntl.LOCK_SH)
        server = _server()
        server.segments[token] = _map(name, fd)
    except BaseException:
        _posixshmem.shm_unlink(name)
        os.close(fd)
        raise
    handle = Shared(token, server.node.address, machine_id(), size, check)
    handle._creator = _let_go_later(handle, _creator_let_go, server, token, fd, name)
    return handle
