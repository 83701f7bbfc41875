"""Entry point of every roving child process: ``python -m roving._child``.

Fetches the Process object from the parent over the authenticated transport, watches the parent's
liveness, runs the process, and exits with multiprocessing's exit codes.
"""
from __future__ import annotations

import logging
import os
import select
import sys
import threading
import time
import traceback
from typing import Callable, Optional, Tuple

from . import config as _config
from . import boot as _boot
from . import process as _process
from .transport import node as _node
from .transport import session as _session
from .transport.guard import raise_open_files
from .transport.serialize import loads

log = logging.getLogger("roving.child")
_stop_watching = threading.Event()


def _watch_parent(info: dict, cfg: _config.Config) -> None:
    """Exit when the parent is gone: it stops answering pings for ``parent_timeout``, or (local backend)
    its process exited. On this machine a parent slow to answer but working (busy: starting a thousand
    workers on two cores) is not taken for a dead one: it is given up only once it has also made no
    progress (no CPU time used; stopped) for ``parent_timeout``; and one seen working is not pinged."""
    endpoint = _session.current().endpoint(info["parent"])
    local = bool(info.get("local"))
    parent_gone = _exit_of(info.get("parent_pid")) if local else None
    working = _working(info.get("parent_pid")) if local else None
    # Here the parent's exit is seen at once (its pidfd), so pings, which only find a parent stopped or
    # hung, need not be as often: a third of parent_timeout (a thousand children pinging every second
    # cost them and the parent half a core).
    ping_every = max(cfg.heartbeat_interval, cfg.parent_timeout / 3) if parent_gone is not None else 0.0
    last_answer = last_ping = time.monotonic()
    while not _stop_watching.wait(cfg.heartbeat_interval):
        if parent_gone is not None and parent_gone():
            _die("its parent process exited")
        now = time.monotonic()
        if now - last_ping < ping_every:
            continue
        last_ping = now
        # a parent seen working is not asked
        if (working is not None and working()) or endpoint.ping(cfg.heartbeat_interval):
            last_answer = time.monotonic()
        elif time.monotonic() - last_answer > cfg.parent_timeout:
            _die(f"its parent has not answered for {cfg.parent_timeout:g} s")


def _working(pid: Optional[int]) -> Optional[Callable[[], bool]]:
    """What tells whether local process ``pid`` has used CPU time since the last call and is not
    stopped (/proc/PID/stat's state and times), or None where that cannot be read."""
    def sample() -> Optional[Tuple[str, int]]:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return fields[0].decode(), int(fields[11]) + int(fields[12])  # state, utime + stime

    if pid is None or sample() is None:
        return None
    last = [sample()]

    def working() -> bool:
        now, before = sample(), last[0]
        last[0] = now
        return (now is not None and before is not None and now[0] not in "TtZX" and now[1] > before[1])
    return working


def _exit_of(pid: Optional[int]) -> Optional[Callable[[], bool]]:
    """What tells whether local process ``pid`` (the parent, which may not be this process's own parent
    when the local backend's starter forked it) has exited: its pidfd, else whether this process was
    re-parented (or, forked by the starter, whether ``pid`` is still there)."""
    if pid is None:
        return None
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        poller = select.poll()  # (select.select refuses a descriptor above 1023)
        poller.register(fd, select.POLLIN)
        return lambda: bool(poller.poll(0))
    if os.getppid() == pid:
        return lambda: os.getppid() != pid

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False
    return gone


def _die(why: str) -> None:
    try:
        sys.stderr.write(f"roving: {_process.current_process().name} exits because {why}\n")
        sys.stderr.flush()
    finally:
        os._exit(1)


def main() -> int:
    raise_open_files()  # at boot, before the first connection (a login's soft limit is often 1024)
    session = _session.current()
    info = _session.child_info()
    if info is None:
        raise RuntimeError("roving._child runs only in a process roving started (its environment tells it "
                           "its parent)")
    timeout = float(info.get("connect_timeout") or _config.current().connect_timeout)
    try:  # the environment check and the program's code, before anything of the parent's is unpickled
        refused = _boot.before_work(session.endpoint(info["parent"], timeout), info, timeout)
    except OSError as exc:
        sys.stderr.write(_unreachable(info, timeout, exc))
        return 1
    if refused:
        sys.stderr.write(refused)
        return 1
    try:
        status, frames = session.endpoint(info["parent"], timeout).call(_node.GET, info["box"], timeout)
    except OSError as exc:
        sys.stderr.write(_unreachable(info, timeout, exc))
        return 1
    if status != _node.OK:
        sys.stderr.write("roving: the child could not fetch its work from its parent\n")
        return 1
    try:
        proc = loads(frames)
    except BaseException:  # ImportError of the target's module, typically
        sys.stderr.write("roving: the child could not load its target:\n")
        traceback.print_exc()
        return 1
    _config.adopt(proc._config)
    if proc._config.backend == "slurm":
        _note_time_limit_warning(proc._config.worker_grace + 10)
    watcher = threading.Thread(target=_watch_parent, args=(info, proc._config),
                               name="roving-parent-watch", daemon=True)
    watcher.start()
    _process._become(proc, _process._ParentProcess(proc._parent_name, info.get("parent_pid"), info["parent"]))
    try:
        code = _run(proc)
        # As multiprocessing's children do: the process ends once its non-daemonic threads have ended
        # (and concurrent.futures' executors are told to finish), while the parent is still watched.
        if _process.joins_threads_at_end():
            threading._shutdown()  # type: ignore[attr-defined]  # (private: not in typeshed's stub)
        return code
    finally:
        _stop_watching.set()
        watcher.join(proc._config.heartbeat_interval * 2 + 1)


def _note_time_limit_warning(seconds: float) -> None:
    """Slurm jobs are submitted with ``--signal=B:USR1@N`` (the warning a pool worker leaves on): in any
    other child, that signal only says so, rather than end it at once (USR1's default). The program may
    set a handler of its own."""
    import signal

    def note(signum: int, frame: object) -> None:
        os.write(2, f"roving: Slurm's warning (SIGUSR1): this job reaches its time limit in about "
                    f"{seconds:.0f} s\n".encode())

    try:
        signal.signal(signal.SIGUSR1, note)
    except (ValueError, OSError):  # not the main thread, or no such signal here
        pass


def _unreachable(info: dict, timeout: float, exc: OSError) -> str:
    """What a child that cannot reach its parent says: the address it tried, how the parent chose it,
    and what to set."""
    import socket

    parent = info["parent"]
    return (f"roving: this child (on {socket.gethostname()}) could not reach its parent at {parent} within "
            f"connect_timeout={timeout:g} s: {exc}\n"
            f"roving: the parent chose that address by {info.get('parent_why', 'its host/advertise options')}; "
            "if this machine cannot reach it, set the roving options host= and advertise= (ROVING_HOST, "
            "ROVING_ADVERTISE) in the parent to an address of its machine that this one can reach, and open "
            "its ports (port_range) in any firewall between them\n")


def _run(proc: _process.Process) -> int:
    """Run the process as multiprocessing does: exit code 0, SystemExit's code, or 1 with a traceback."""
    try:
        proc.run()
        return 0
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        sys.stderr.write(str(code) + "\n")
        return 1
    except BaseException:
        sys.stderr.write(f"Process {proc.name}:\n")
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    code = main()
    try:
        from . import connection

        connection.close_all()  # the pipe ends this process held: their readers see EOF
        _process._at_exit()  # children of this child, then flush connections
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
