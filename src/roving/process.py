"""Process: a job-backed process with the interface of :class:`multiprocessing.Process`.

``start()`` pickles the process object (target, arguments and all), leaves it in a mailbox of this
process's endpoint, and asks the configured backend for a job running ``python -m roving._child``. The
child fetches the object over the authenticated transport, takes on the parent's ``sys.path``, and calls
``run()``. Functions and classes defined in ``__main__`` travel by value (cloudpickle); everything else by
reference, so the child imports their modules.

Guarantees:

* Anything that cannot be pickled is a :class:`~roving.transport.serialize.SerializationError` from
  ``start()`` that names the offending target or argument, and is of the type pickle raised too; no job
  is created. ``start()`` then drops the target and arguments (the child has its copy), as
  multiprocessing does.
* A child ends once its target returned and its non-daemonic threads have ended, as in multiprocessing.
* A joined and closed Process (or one merely dropped after it ended) is freed: nothing of roving's holds it.
* A child whose target raises prints the traceback to its stderr and ends with exit code 1; ``SystemExit``
  sets the exit code as in :mod:`multiprocessing`; a child killed by signal N has exit code ``-N``.
* A child exits within ``parent_timeout`` seconds (default 5) of its parent's death, also after ``kill -9``.
* At normal exit the parent terminates its daemonic children and joins the others.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import weakref
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from . import backends
from . import boot as _boot
from . import config as _config
from . import crashlog
from . import environment as _environment
from . import observe
from ._sentinels import watcher as _sentinel_watcher
from .system import private as _private
from .errors import ProcessStartError
from .stdlib_process import ParentProcess as _ParentProcess
from .stdlib_process import stand_in
from .process_payload import Payload
from .transport import identity as _identity
from .transport import node as _node
from .transport import session as _session
from .transport import timeouts

log = logging.getLogger(__name__)

__all__ = ["Process", "ProcessStartError", "current_process", "parent_process", "active_children", "cpu_count"]


_counter = itertools.count(1)
_children: Set["Process"] = set()
_children_lock = threading.Lock()
_sentinel_lock = threading.Lock()


class Process(Payload):
    """A process run as a job of the configured backend. See :class:`multiprocessing.Process`."""

    _start_method = None

    def __init__(self, group: None = None, target: Optional[Callable[..., object]] = None,
                 name: Optional[str] = None, args: Iterable[object] = (),
                 kwargs: Optional[Mapping[str, object]] = None, *, daemon: Optional[bool] = None,
                 resources: Optional[backends.ResourceMapping] = None, trusted: bool = True) -> None:
        """``resources`` (roving's addition): what this process's job asks the backend for, as any of
        ``cpu``, ``memory`` (bytes or a string like ``"2G"``), ``gpu``; the rest from the configuration.
        ``trusted`` (roving's addition; only the session's root may pass False): False starts a process
        that must be assumed to run code of its own (a pipeline node on someone else's machine): its
        credentials are marked untrusted, so that every process of the session serves it only the
        mailboxes made for it or opened to untrusted writers, and nothing it sends is unpickled there
        (:class:`roving.transport.mailbox.Access`)."""
        if group is not None:
            raise ValueError("group argument must be None for now")
        parent = current_process()
        self._identity: Tuple[int, ...] = (*parent._identity, next(_counter))
        self._config = _config.current()
        self._target = target
        self._args = tuple(args)
        self._kwargs = dict(kwargs or {})
        self._name = name or "Process-" + ":".join(str(i) for i in self._identity)
        self._daemonic = parent.daemon if daemon is None else bool(daemon)
        unknown = set(resources or ()) - {"cpu", "memory", "gpu"}
        if unknown:
            raise ValueError(f"unknown resources {sorted(unknown)}: use cpu, memory, gpu")
        self._resources: Dict[str, Any] = dict(resources or {})
        self._trusted = bool(trusted)
        self._parent_pid: Optional[int] = os.getpid()
        self._parent_name = parent.name
        self._uid: Optional[str] = None
        self._job: Optional[backends.Job] = None
        self._backend: Optional[backends.Backend] = None
        self._exitcode: Optional[int] = None
        self._sentinel: Optional[int] = None
        self._closed = False
        self._released = False
        self._unreached = False  # ended before it fetched its work: join() raises ProcessStartError
        self._stop_asked = False  # terminate() or kill() was called: its end is no crash
        self._boot: Optional[_boot.Prepared] = None  # its start-up checks' mailboxes (roving.boot)
        self._environment: Optional[_environment.Report] = None  # what the child said of its environment
        self._environment_error: Optional[_environment.EnvironmentMismatchError] = None  # join() raises it
        self._finishing = threading.Lock()  # one _finished at a time: its callers return once it is done

    # -- what runs in the child ------------------------------------------------------------
    def run(self) -> None:
        """The work of the process: calls the target. Override in a subclass, as with multiprocessing."""
        target = getattr(self, "_target", None)
        if target:
            target(*self._args, **self._kwargs)

    # -- control from the parent -----------------------------------------------------------
    def start(self) -> None:
        """Create the job. Returns once the backend has accepted it (it may still be pending).

        Raises SerializationError (also of the type pickle raised) naming what cannot be pickled,
        AssertionError when started twice (as multiprocessing does), ValueError when closed, OSError
        when the backend refuses.
        """
        spec = self._prepare()
        try:
            self._backend = backends.get(self._config.backend)
            job = self._backend.create_job(spec)
        except BaseException:
            self._unprepare()
            raise
        self._started(job)

    def _prepare(self) -> backends.JobSpec:
        """Everything of start() before the backend is asked: the payload left in a mailbox, the spec."""
        self._check_closed()
        assert self._job is None, "cannot start a process twice"
        assert self._parent_pid == os.getpid(), "can only start a process object created by current process"
        assert not _is_daemonic_child(), "daemonic processes are not allowed to have children"
        _reap_finished()
        session = _session.current()
        node = session.node()
        self._uid = _session.new_uid()
        payload = self._pickle_self()
        box = node.mailboxes.new_box(access=_node.Access(owner=self._uid))  # no other process can take it
        node.mailboxes.call_local(_node.PUT, box, 0, payload)
        self._payload_box = box
        cfg = self._config
        try:  # its start-up information, with the checks it makes before it unpickles
            self._boot = _boot.prepare(node, cfg, backends.get(cfg.backend).shares_filesystem(), self._uid, box)
        except BaseException:
            node.mailboxes.drop_box(box)
            raise
        env = dict(os.environ)
        env.update(session.child_env(self._boot.info, self._trusted))
        env["PYTHONPATH"] = os.pathsep.join(self._boot.paths)
        want = {"cpu": cfg.cpu, "memory": cfg.memory, "gpu": cfg.gpu, **self._resources}
        resources = backends.Resources(
            want["cpu"], _config.parse_memory(want["memory"]) if want["memory"] else None, want["gpu"])
        return backends.JobSpec(
            name=self._name, command=[self._boot.python, "-m", "roving._child"], env=env, cwd=os.getcwd(),
            session=session.job_session(), resources=resources, output=cfg.child_output,
            log_path=self._log_path())

    def _log_path(self) -> str:
        """The child's log file (``child_output="files"``): in ``log_dir``, or, where another user took that
        folder's name first, in a private folder of this process's own (roving.system.private)."""
        cfg = self._config
        folder = _private.private_dir_or_own(cfg.log_dir) if cfg.child_output == "files" else cfg.log_dir
        return os.path.join(folder, f"{self._name}.log")

    def _unprepare(self) -> None:
        """The backend refused: the payload is dropped, the process can be started again."""
        node = _session.current().node()
        node.mailboxes.drop_box(self._payload_box)
        del self._payload_box
        if self._boot is not None:  # made in _prepare, before the backend was asked
            _boot.drop(node, self._boot)
        self._backend = None

    def _job_backend(self) -> backends.Backend:
        """The backend of this process's job (set with the job, so there is one when there is a job)."""
        assert self._backend is not None, "the process has no job"
        return self._backend

    def _started(self, job: backends.Job) -> None:
        """The backend accepted ``job``: watch it, and let go of the target and arguments."""
        self._job = job
        backend = self._job_backend()
        self._sentinel = backend.sentinel(job)
        # a Process freed without close() still gives its sentinel back (the finalizer holds no reference)
        self._sentinel_finalizer = weakref.finalize(self, _sentinel_watcher().close_fd, self._sentinel)
        self._sentinel_finalizer.atexit = False
        # As multiprocessing's start() does: the child has its own copy (in the payload), so the parent
        # lets go of the target and arguments at once; large arguments are not kept, nor a cycle
        # through a target that refers to this Process.
        del self._target, self._args, self._kwargs
        with _children_lock:
            _children.add(self)
        cfg = self._config
        assert self._uid is not None  # given in start(), before the job was made
        observe.process_started(self._uid, self._name, backend.name, str(job.id),
                                {"cpu": cfg.cpu, "memory": cfg.memory, "gpu": cfg.gpu, **self._resources},
                                _this_host() if backend.name == "local" else "")
        _sentinel_watcher().watch(self._sentinel, self, _reaped)

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait until the process ends, or ``timeout`` seconds pass (then exitcode stays None).

        Raises :class:`ProcessStartError` (naming the address it was to reach) when the process ended
        with an error before it fetched its work from this one; exitcode is set all the same."""
        self._check_closed()
        assert self._parent_pid == os.getpid(), "can only join a child process"
        assert self._job is not None, "can only join a started process"
        self._wait(timeout)
        if self._environment_error is not None:
            error, self._environment_error = self._environment_error, None  # raised once
            raise error
        if self._unreached:
            self._unreached = False  # said once, as a failed start would be
            raise ProcessStartError(self._unreached_message(self._exitcode))

    def _wait(self, timeout: Optional[float]) -> None:
        """join() without its error: for roving's own joins (reaping, exit, a pool's upkeep)."""
        if self._exitcode is None:
            assert self._job is not None, "can only wait for a started process"
            code = self._job_backend().wait(self._job, timeouts.limit(timeout))
            if code is not None:
                self._finished(code)

    def is_alive(self) -> bool:
        self._check_closed()
        if self is _current:  # the main process, or a child asking about itself
            return True
        if self._job is None or self._exitcode is not None:
            return False
        status = self._job_backend().job_status(self._job)
        if status.state is backends.JobState.EXITED:
            self._finished(status.exitcode)
            return False
        return True

    def terminate(self) -> None:
        """Ask the process to stop (SIGTERM on the local backend)."""
        self._check_closed()
        if self._job is not None:
            self._stop_asked = True
            self._job_backend().terminate_job(self._job, force=False)

    def kill(self) -> None:
        """Stop the process at once (SIGKILL on the local backend)."""
        self._check_closed()
        if self._job is not None:
            self._stop_asked = True
            self._job_backend().terminate_job(self._job, force=True)

    def revoke_credentials(self) -> None:
        """Revoke the credentials this process was issued (roving's own, not multiprocessing's): in this
        process (its parent), its open connections are closed and new ones refused from now on — what
        a copy of its credentials on a machine that was cut off, or in a stranger's hands, could still
        reach. Does nothing before start()."""
        if self._uid is not None:
            _identity.revoke(self._uid)

    def close(self) -> None:
        """Release the process's resources. ValueError if it is still running."""
        if self._closed:
            return
        if self._job is not None:
            if self._exitcode is None and self.is_alive():
                raise ValueError("Cannot close a process while it is still running. "
                                 "You should first call join() or terminate().")
            self._release()
        self._closed = True

    def _release(self) -> None:
        """Free the sentinel and the backend's handle of an ended process; exitcode stays readable.

        The Pool does this for workers it has replaced, so that a long-lived pool holds no descriptor
        per worker it ever had.
        """
        if self._job is not None and self._exitcode is not None and not self._released:
            self._released = True
            self._drop_sentinel()
            self._job_backend().forget(self._job)

    def _drop_sentinel(self) -> None:
        """Stop watching the sentinel and close it (the watcher closes it, after unregistering)."""
        finalizer = getattr(self, "_sentinel_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        with _sentinel_lock:
            fd, self._sentinel = self._sentinel, None
        if fd is not None:
            _sentinel_watcher().close_fd(fd)

    def _work_unfetched(self) -> bool:
        """Whether the child never took its work from this process (it never reached it)."""
        box = getattr(self, "_payload_box", None)
        return box is not None and _session.current().node().mailboxes.items_in(box) > 0

    def _unreached_message(self, code: Optional[int]) -> str:
        node = _session.current().node()
        return (f"{self._name} exited with code {code} before it fetched its work from this process at "
                f"{node.address} (chosen by {node.why}): it could not reach that address, or could not "
                f"start Python and roving (its output says which). If its machine cannot reach this one "
                "there, set the roving options host= and advertise= to an address it can reach.")

    def _finished(self, code: Optional[int]) -> None:
        # the sentinel's watcher and a join() can both see the end: the second returns once the first
        # has done all of it (the child out of active_children, its crash log kept)
        with self._finishing:
            self._finish(code)

    def _finish(self, code: Optional[int]) -> None:
        if self._exitcode is not None:
            return
        report = self._environment_report()
        if report is not None and any(d.fatal for d in report.differences):
            self._environment_error = report.error(self._name)
        self._unreached = (self._environment_error is None and code is not None and code > 0
                           and self._work_unfetched())
        self._exitcode = code
        assert self._uid is not None  # given in start(); only a started process finishes
        cause = self._unreached_message(code) if self._unreached else ""
        observe.process_ended(self._uid, code, cause)
        if code and not self._stop_asked:  # a crash: its last output is kept (roving logs --failed)
            cfg = self._config
            crashlog.keep(self._name, _session.current().tag, str(self._job.id) if self._job else "",
                          self._backend.name if self._backend else cfg.backend, code, cause, cfg.child_output,
                          self._log_path())
        with _children_lock:
            _children.discard(self)
        node = _session.current().started_node()
        if node is not None:
            # pipe ends are held under the holder's uid as bytes (the HOLD frame): release those
            node.mailboxes.release_everywhere(self._uid.encode())
            node.mailboxes.drop_box(self._payload_box)
            if self._boot is not None:
                _boot.drop(node, self._boot)

    def _environment_report(self) -> Optional[_environment.Report]:
        """The child's environment report, once it has left it (None before, or with env_check off)."""
        if self._environment is None:
            try:
                self._environment = _boot.report(_session.current().started_node(), self._boot)
            except ValueError as exc:
                log.warning("%s left an environment report that cannot be read: %s", self._name, exc)
        return self._environment

    @property
    def environment(self) -> Optional[_environment.Report]:
        """What the child said of its environment when it started, against this process's (its fingerprint
        and each difference, see roving.environment and the ``env_check`` option); None until it has, and
        with ``env_check="off"``."""
        self._check_closed()
        return self._environment_report()

    def _check_closed(self) -> None:
        if self._closed:
            raise ValueError("process object is closed")

    # -- attributes ------------------------------------------------------------------------
    @property
    def exitcode(self) -> Optional[int]:
        """None while running; the exit code once ended (``-N`` if killed by signal N)."""
        self._check_closed()
        if self._exitcode is None and self._job is not None:
            self.is_alive()
        return self._exitcode

    @property
    def node_id(self) -> Optional[str]:
        """(roving's addition) The node id its credentials name, which every connection it makes
        authenticates (:mod:`roving.transport.identity`); None before it is started."""
        return self._uid

    @property
    def pid(self) -> Optional[int]:
        self._check_closed()
        if self is _current:  # the main process, or a child asking about itself
            return os.getpid()
        if self._job is None:
            return None
        return self._job_backend().pid(self._job)

    ident = pid

    @property
    def name(self) -> str:
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError("name must be a string")
        self._name = value
        if self is _current and self is not _main_process:
            import multiprocessing.process as mp_process

            # as _become(): the standard library's agrees (a private name typeshed does not declare)
            mp_process._current_process._name = value  # type: ignore[attr-defined]

    @property
    def daemon(self) -> bool:
        return self._daemonic

    @daemon.setter
    def daemon(self, value: bool) -> None:
        assert self._job is None, "process has already started"
        self._daemonic = bool(value)

    @property
    def authkey(self) -> bytes:
        """The session secret that authenticates this process's connections."""
        return _session.current().secret

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the process ends."""
        self._check_closed()
        if self._sentinel is None:
            raise ValueError("process not started")
        return self._sentinel

    @property
    def job(self) -> Optional[backends.Job]:
        """The backend's job behind this process (roving's addition)."""
        return self._job

    def __repr__(self) -> str:
        if self is _main_process:
            status = "started"
        elif self._closed:
            status = "closed"
        elif self._job is None:
            status = "initial"
        elif self._exitcode is not None:
            status = "stopped"
        else:
            status = "started"
        extra = f" exitcode={self._exitcode}" if self._exitcode not in (None, 0) else ""
        return f"<{type(self).__name__} name={self._name!r} {status}{extra}{' daemon' if self._daemonic else ''}>"


class _MainProcess(Process):
    def __init__(self) -> None:
        self._identity = ()
        self._name = "MainProcess"
        self._daemonic = False
        self._parent_pid = None
        self._job = None
        self._uid = None
        self._exitcode = None
        self._closed = False
        self._config = None  # type: ignore[assignment]  # the main process makes no job to configure

    def close(self) -> None:
        pass


_main_process = _MainProcess()
_current: Process = _main_process
_parent: Optional[_ParentProcess] = None


def reap(proc: Process, timeout: Optional[float]) -> None:
    """Wait up to ``timeout`` for ``proc`` to end, as :meth:`Process.join` does but without raising its
    errors: for roving's own joins of processes it started (a pool's upkeep, a manager's shutdown)."""
    proc._wait(timeout)


def release(proc: Process) -> None:
    """Free the sentinel and the backend's handle of an ended process; its exitcode stays readable. A pool
    does this for workers it replaced, so that a long-lived pool holds no descriptor per worker it ever had."""
    proc._release()


def ended(proc: Process) -> bool:
    """Whether ``proc`` is known to have ended (its exit code is in), without asking its backend."""
    return proc._exitcode is not None


def start_many(procs: Sequence[Process]) -> List[Optional[Exception]]:
    """Start several processes as one submission to their backend (:meth:`Backend.submit_many`): on Slurm
    one job array, on Docker and Kubernetes several creations at once. One entry per process, in order:
    None when it started, else the exception (OSError when refused) that kept it from starting; such a
    process can be started again. SerializationError (as from :meth:`Process.start`) is raised before
    anything is submitted. All of ``procs`` must be of the same configured backend."""
    if not procs:
        return []
    names = {p._config.backend for p in procs}
    if len(names) > 1:
        raise ValueError(f"start_many: the processes are of several backends ({sorted(names)}); start them apart")
    specs: List[backends.JobSpec] = []
    try:
        for p in procs:
            specs.append(p._prepare())
    except BaseException:
        for p in procs[:len(specs)]:
            p._unprepare()
        raise
    backend = backends.get(procs[0]._config.backend)
    for p in procs:
        p._backend = backend
    try:
        jobs = backend.submit_many(specs)
    except BaseException:
        for p in procs:
            p._unprepare()
        raise
    if len(jobs) != len(procs):
        raise RuntimeError(f"backend {backend.name}: submit_many returned {len(jobs)} results for {len(procs)} jobs")
    out: List[Optional[Exception]] = []
    for p, job in zip(procs, jobs):
        if isinstance(job, Exception):
            p._unprepare()
            out.append(job)
        else:
            p._started(job)
            out.append(None)
    return out


def _become(proc: Process, parent: _ParentProcess) -> None:
    """In a child: make ``proc`` this process and ``parent`` its parent, for roving and for the
    standard library's ``multiprocessing.current_process()``/``parent_process()`` (which libraries and
    logging's ``processName`` read): the same name and identity. The standard library's object keeps
    its own authkey (the session secret must not reach what a child starts with the standard library)
    and ``daemon`` False (so a library may still start its own multiprocessing children in a worker)."""
    global _current, _parent
    _current, _parent = proc, parent
    stand_in(proc.name, proc._identity, parent)


_join_threads_at_end = True


def end_without_joining_threads() -> None:
    """In a child: end, once the target returns, without waiting for this process's non-daemonic
    threads. For roving's servers whose worker threads may be blocked in calls for clients that will
    never finish (multiprocessing's manager server uses daemonic threads for the same reason)."""
    global _join_threads_at_end
    _join_threads_at_end = False


def joins_threads_at_end() -> bool:
    """Whether a child waits for its non-daemonic threads when its target returns (the default)."""
    return _join_threads_at_end


def current_process() -> Process:
    """The Process object of the calling process (``MainProcess`` in the program that started it all)."""
    return _current


def parent_process() -> Optional[_ParentProcess]:
    """The parent of this process, or None in the main process."""
    return _parent


def _is_daemonic_child() -> bool:
    return _current is not _main_process and _current.daemon


def active_children() -> List[Process]:
    """The children of this process that are still running (reaps those that ended)."""
    _reap_finished()
    with _children_lock:
        return list(_children)


def _reap_finished() -> None:
    with _children_lock:
        children = list(_children)
    for child in children:
        child.is_alive()


def cpu_count() -> int:
    """CPUs the configured backend offers."""
    return backends.get(_config.current().backend).cpu_count()


def stop_asked(proc: Process) -> bool:
    """Whether this process asked ``proc`` to stop (``terminate()``, ``kill()``): an end of its own, which
    a pool does not report as a worker the cluster ended or one that failed to start."""
    return proc._stop_asked


def end_status(proc: Process) -> Optional[backends.JobStatus]:
    """How an ended ``proc``'s job ended, as its backend tells it (its ``out_of_memory`` in particular),
    or None while it runs, before it started, or once its job handle was released. Asks the backend: for
    a pool reporting a worker that died, not for a hot path."""
    if proc._job is None or proc._released or proc._exitcode is None:
        return None
    status = proc._job_backend().job_status(proc._job)
    return status if status.state is backends.JobState.EXITED else None


def environment_error(proc: Process) -> Optional[_environment.EnvironmentMismatchError]:
    """The error an ended ``proc`` left because its environment differs from this process's where
    ``env_check`` does not allow it (it did not run), or None; for a pool deciding whether to go on."""
    return proc._environment_error


def _this_host() -> str:
    import socket

    return socket.gethostname()


def _reaped(proc: Process) -> None:
    """The sentinel watcher's call when a child's sentinel fires: take note of its end."""
    proc._wait(5)


_exiting = False


def exiting() -> bool:
    """Whether this process has begun its exit (its exit handler ends its children): a pool then starts
    no replacement for the workers that ends."""
    return _exiting


def _at_exit() -> None:
    """As multiprocessing does at exit: terminate daemonic children, join the others."""
    global _exiting
    _exiting = True
    with _children_lock:
        children = list(_children)
    for child in children:
        if child.daemon and child._exitcode is None:
            child.terminate()
    for child in children:
        try:
            child._wait(None if not child.daemon else 5)
            if child._exitcode is None:
                child.kill()
                child._wait(5)
        except Exception:
            pass
    crashlog.flush()
    session = _session.existing()
    if session is not None:
        session.close()


atexit.register(_at_exit)
