"""The local backend's starter: a process that imports roving's child code and the modules of
``local_preload`` once, then forks each local child from itself (what ``multiprocessing``'s forkserver
with ``set_forkserver_preload`` does for its processes, here for roving's jobs).

A fresh interpreter pays for its imports at every start: about 0.4 s of CPU for roving's child, 2-3 s
more for a child that unpickles a target importing torch (a SkipPipe stage). A forked child starts with
them imported, in milliseconds, and shares their memory with the starter until it writes to it.

What a forked child gets, as a fresh ``python -m roving._child`` would: its own environment, working
directory, argv, stdin/stdout/stderr (passed to the starter as file descriptors), SIGINT as
KeyboardInterrupt, a reseeded ``random`` (and ``numpy.random``, when the starter imported numpy), and the
working directory first on ``sys.path``. What it shares with its siblings: the interpreter's string hash
seed and whatever state a preloaded module made at import (torch imports no CUDA and runs no thread pool
at import; a module that opens sockets or starts threads at import is not one to preload). The
interpreter's own start-up settings (``PYTHON*`` variables: PYTHONPATH, PYTHONHASHSEED, ...) are the
starter's: the backend keeps one starter per set of them, and a child whose command is not this
interpreter running ``roving._child`` is started as a fresh process as before.

The protocol, over a ``SOCK_SEQPACKET`` socket pair (private to the two processes, so no stranger
reaches it; JSON, nothing is unpickled): the starter says ``{"ready": ...}`` once its imports are done
(or ``{"failed": why}``); a request ``{"start": n, "argv", "env", "cwd"}`` carries the child's three
standard streams as descriptors, and is answered ``{"started": n, "pid"}`` (or ``{"refused": n, "why"}``);
each child's end is ``{"ended": pid, "code"}`` (``code``: as ``Popen.returncode``, -N for signal N).
The starter exits when its socket closes (its parent ended), leaving running children to the backend's
reaper as a fresh process's would be.
"""
from __future__ import annotations

import errno
import gc
import io
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import StarterError

#: The child code every starter imports; the backend uses a starter only for this module's commands.
CHILD_MODULE = "roving._child"
#: The largest request (a child's environment and argv as JSON).
_MAX_MESSAGE = 1 << 20
#: Seconds a starter has to import what it preloads (torch: seconds; on a loaded machine, more).
READY_TIMEOUT = 120.0
#: The starter's command (``python -c``: run as ``-m`` this module would be imported twice, once by its
#: package, and runpy would warn on the terminal).
_STARTER_MAIN = "import sys; from roving.backends.local.starter import main; main(sys.argv[1:])"


def interpreter_settings(env: Dict[str, str]) -> Tuple[Tuple[str, str], ...]:
    """The variables of ``env`` that a Python interpreter reads as it starts (``PYTHON*``): a starter's
    children get its values of them, so the backend keeps one starter per distinct set."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith("PYTHON")))


# -- the backend's side --------------------------------------------------------------------------------

class ForkedChild:
    """A child the starter forked: what the local backend uses of ``subprocess.Popen`` (``pid``,
    ``returncode``, ``poll``, ``wait``, ``send_signal``, ``stdout``/``stderr`` when piped). Not this
    process's child: its exit status comes from the starter."""

    def __init__(self, pid: int, stdout: Any = None, stderr: Any = None) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None
        self.stdout, self.stderr = stdout, stderr
        self._ended = threading.Event()

    def _end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> Optional[int]:
        return self.returncode

    def exited(self) -> bool:
        """Whether its process has ended, the starter's word of it come or not yet (its pidfd says so
        at once: the sentinel a caller waited on is that pidfd)."""
        if self.returncode is not None:
            return True
        try:
            fd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            return True
        except OSError:  # no pidfd here: the starter's word is all there is
            return False
        try:
            poller = select.poll()  # (select.select refuses a descriptor above 1023: a parent of many)
            poller.register(fd, select.POLLIN)
            return bool(poller.poll(0))
        finally:
            os.close(fd)

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired([CHILD_MODULE], timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)  # ProcessLookupError if it has just ended, as Popen's


class Starter:
    """One starter process (the module doc), started at once; ``start`` forks a child from it.
    Thread-safe. ``close`` (or this process's exit) ends it; children still running keep running."""

    def __init__(self, preload: Sequence[str], env: Dict[str, str], timeout: float = READY_TIMEOUT) -> None:
        self.preload = tuple(preload)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _STARTER_MAIN, str(theirs.fileno()), *self.preload],
                env=env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), close_fds=True)
        except OSError as exc:
            ours.close()
            raise StarterError(f"cannot start the local backend's starter ({sys.executable!r}): {exc}") from exc
        finally:
            theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: Dict[int, List[Any]] = {}  # request -> [event, answer]
        self._children: Dict[int, ForkedChild] = {}
        self._early: Dict[int, int] = {}  # pid -> code, ended before its start was answered here
        self._gone: Optional[str] = None
        ours.settimeout(timeout)
        try:
            hello = _decode(ours.recv(_MAX_MESSAGE))
        except (OSError, ValueError) as exc:
            self._abandon()
            raise StarterError(f"the local backend's starter (pid {self.proc.pid}) did not say it was ready "
                               f"within {timeout:.0f} s: {exc}") from exc
        if hello is None or "failed" in hello:
            self._abandon()
            why = "it exited" if hello is None else hello["failed"]
            raise StarterError(f"the local backend's starter could not preload {list(self.preload)}: {why}")
        ours.settimeout(None)
        self._reader = threading.Thread(target=self._read, name="roving-local-starter", daemon=True)
        self._reader.start()

    def _abandon(self) -> None:
        """A starter that never became ready: ended and reaped."""
        self._sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def start(self, argv: Sequence[str], env: Dict[str, str], cwd: Optional[str],
              fds: Tuple[int, int, int], timeout: float = 30.0) -> int:
        """Fork a child running ``argv`` (``python -m roving._child ...``) in ``env`` and ``cwd``, with
        ``fds`` as its stdin, stdout and stderr; its pid. Raises StarterError if the starter is gone or
        refused."""
        event = threading.Event()
        with self._lock:
            if self._gone:
                raise StarterError(self._gone)
            n = self._next = self._next + 1
            self._waiting[n] = [event, None]
        request = json.dumps({"start": n, "argv": list(argv), "env": env, "cwd": cwd}).encode()
        try:
            socket.send_fds(self._sock, [request], list(fds))
        except OSError as exc:
            with self._lock:
                self._waiting.pop(n, None)
            raise StarterError(f"the local backend's starter (pid {self.proc.pid}) is gone: {exc}") from exc
        if not event.wait(timeout):
            raise StarterError(f"the local backend's starter (pid {self.proc.pid}) did not answer within "
                               f"{timeout:.0f} s")
        with self._lock:
            answer = self._waiting.pop(n)[1]
        if answer is None or "refused" in answer:
            raise StarterError(self._gone if answer is None else
                               f"the local backend's starter could not fork: {answer['why']}")
        return int(answer["pid"])

    def adopt(self, child: ForkedChild) -> None:
        """Report ``child``'s end to it (its pid came from ``start``)."""
        with self._lock:
            code = self._early.pop(child.pid, None)
            if code is None:
                self._children[child.pid] = child
        if code is not None:
            child._end(code)

    def _read(self) -> None:
        while True:
            try:
                msg = _decode(self._sock.recv(_MAX_MESSAGE))
            except (OSError, ValueError):
                msg = None
            if msg is None:
                self._lost()
                self._sock.close()
                try:
                    self.proc.wait(10)  # it exits right after its socket closes
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                return
            with self._lock:
                if "ended" in msg:
                    pid, code = int(msg["ended"]), int(msg["code"])
                    child = self._children.pop(pid, None)
                    if child is None:
                        self._early[pid] = code
                else:
                    child = None
                    waiting = self._waiting.get(int(msg.get("started", msg.get("refused", -1))))
                    if waiting is not None:
                        waiting[1] = msg
                        waiting[0].set()
            if child is not None:
                child._end(code)

    def _lost(self) -> None:
        """The starter is gone: its children's ends can no longer be told, so each one still running is
        watched by its pidfd (its exit code is then unknown: reported as -SIGKILL)."""
        with self._lock:
            self._gone = self._gone or (f"the local backend's starter (pid {self.proc.pid}) exited "
                                        f"(code {self.proc.poll()})")
            children, self._children = list(self._children.values()), {}
            for event, _ in self._waiting.values():
                event.set()
        for child in children:
            threading.Thread(target=_watch_orphan, args=(child,), name="roving-local-orphan", daemon=True).start()

    @property
    def alive(self) -> bool:
        """Whether it takes requests (not closed, not gone)."""
        return self._gone is None

    def close(self) -> None:
        """Ask for no more children: the starter ends once those it forked have (their ends are still
        told here), and at once if none runs."""
        with self._lock:
            self._gone = self._gone or "the local backend's starter was closed"
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _watch_orphan(child: ForkedChild) -> None:
    try:
        fd = os.pidfd_open(child.pid)
    except OSError:  # already gone
        child._end(-signal.SIGKILL)
        return
    try:
        sel = selectors.DefaultSelector()
        sel.register(fd, selectors.EVENT_READ)
        sel.select()
        sel.close()
    finally:
        os.close(fd)
    child._end(-signal.SIGKILL)


def _decode(data: bytes) -> Optional[Dict[str, Any]]:
    if not data:
        return None
    msg = json.loads(data)
    if not isinstance(msg, dict):
        raise ValueError(f"not a message: {data[:80]!r}")
    return msg


# -- the starter process -----------------------------------------------------------------------------------

def _serve(fd: int, preload: Sequence[str]) -> Optional[Tuple[Dict[str, Any], List[int]]]:
    """The starter's loop; returns, in a forked child only, its request and descriptors."""
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is for the program, not for this
    try:
        import importlib
        importlib.import_module(CHILD_MODULE)
        for name in (*_CHILD_LATER, *preload):
            importlib.import_module(name)
        _warm_crypto()
    except BaseException as exc:  # said to the backend, which raises it
        sock.send(json.dumps({"failed": f"{type(exc).__name__}: {exc}"}).encode())
        return None
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    # What the starter made so far is shared with every child until one writes to it; the collector
    # writes to every object it tracks (its header) as it walks them, so the children's collections
    # would copy all of it: frozen, it is never walked again (gc.freeze, as forking servers do).
    gc.collect()
    gc.freeze()
    sock.send(json.dumps({"ready": sorted(preload)}).encode())
    sys.stdout.flush()
    sys.stderr.flush()
    children: set = set()  # pids forked and not yet reaped
    accepting = True
    try:
        while accepting or children:
            for key, _ in sel.select():
                if key.fileobj is sock:
                    try:
                        data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 3)
                    except OSError:
                        data, fds = b"", []
                    if not data:  # no more requests: on until the children have ended, telling their ends
                        sel.unregister(sock)
                        accepting = False
                        _reap(sock, children)
                        continue
                    child = _fork(sock, data, fds, children)
                    if child is not None:
                        sel.close()
                        sock.close()
                        os.close(wake_r)
                        os.close(wake_w)
                        return child
                else:
                    try:
                        os.read(wake_r, 4096)
                    except BlockingIOError:
                        pass
                    _reap(sock, children)
        return None
    finally:
        signal.set_wakeup_fd(-1)


#: Modules every child imports after its start (to run ``roving._child``, to resolve its parent's
#: address): imported in the starter, their memory is shared instead of each child's own.
_CHILD_LATER = ("runpy", "email.parser", "encodings.idna")


def _warm_crypto() -> None:
    """Use the key exchange and signatures every child uses once, so that the cryptography library's
    lazy initialisation (about 4 MB) is done here, shared, rather than in each child."""
    from cryptography.hazmat.primitives.asymmetric import ed25519, x25519

    ours, theirs = x25519.X25519PrivateKey.generate(), x25519.X25519PrivateKey.generate()
    ours.exchange(theirs.public_key())
    key = ed25519.Ed25519PrivateKey.generate()
    key.public_key().verify(key.sign(b"roving"), b"roving")


def _fork(sock: socket.socket, data: bytes, fds: List[int],
          children: set) -> Optional[Tuple[Dict[str, Any], List[int]]]:
    try:
        req = json.loads(data)
        n = req["start"]
    except (ValueError, KeyError, TypeError) as exc:
        for fd in fds:
            os.close(fd)
        _send(sock, {"refused": -1, "why": f"bad request: {exc}"})
        return None
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        _send(sock, {"refused": n, "why": f"{len(fds)} descriptors, not 3"})
        return None
    try:
        pid = os.fork()
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        _send(sock, {"refused": n, "why": str(exc)})
        return None
    if pid == 0:
        signal.set_wakeup_fd(-1)
        return req, fds
    children.add(pid)
    for fd in fds:
        os.close(fd)
    _send(sock, {"started": n, "pid": pid})
    _reap(sock, children)
    return None


def _reap(sock: socket.socket, children: set) -> None:
    """Reap every child that has ended, telling the backend (while it listens) each one's code."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send(sock, {"ended": pid, "code": os.waitstatus_to_exitcode(status)})


def _send(sock: socket.socket, msg: Dict[str, Any]) -> None:
    try:
        sock.send(json.dumps(msg).encode())
    except OSError as exc:  # the backend has gone: nobody is left to tell
        if exc.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
            raise


def _become(req: Dict[str, Any], fds: List[int]) -> None:
    """In a forked child: take on the request's streams, environment, directory and argv, then run
    ``roving._child`` as ``__main__``, as ``python -m`` would."""
    import runpy

    for target, fd in enumerate(fds):
        if fd != target:
            os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if req.get("cwd"):
        os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=os.isatty(stream.fileno()),
                               write_through=bool(os.environ.get("PYTHONUNBUFFERED")))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # (``random`` reseeds itself at fork)
    sys.argv = [""] + list(req["argv"][3:])  # (run_module puts the module's file first)
    sys.path[0] = os.getcwd()  # `python -m` puts the working directory first
    # as under `python -m`, the child module runs as __main__ only (its imports stay imported)
    sys.modules.pop(CHILD_MODULE, None)
    package, _, name = CHILD_MODULE.rpartition(".")
    if hasattr(sys.modules.get(package), name):
        delattr(sys.modules[package], name)
    runpy.run_module(CHILD_MODULE, run_name="__main__", alter_sys=True)


def main(argv: Sequence[str]) -> None:
    """The starter process (``argv``: its socket's descriptor, then the modules to preload); in each
    child it forks, the child's own run of ``roving._child``."""
    child = _serve(int(argv[0]), argv[1:])
    if child is not None:
        _become(*child)
