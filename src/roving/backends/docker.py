"""The docker backend: each job is a container of the configured ``image`` (Docker SDK for Python).

* The container runs ``python -m roving._child`` with the variables roving needs and those named in
  ``forward_env`` (never the rest of the parent's environment), the working directory
  bind-mounted at the same path (and used as the working directory), the ``docker_volumes`` mounts,
  ``--network host`` by default (``docker_network``), ``nano_cpus``/``mem_limit`` from the process
  resources and a GPU device request for ``gpu``. It runs under Docker's init (tini), which passes
  signals on, so ``terminate_job`` (SIGTERM) and ``force`` (SIGKILL) give exit codes -15 and -9.
* The session secret is not in the container's environment or spec: it is a file (0600, in a private
  0700 folder of the host, removed when the container is) mounted read-only at ``/run/roving-session``.
* Containers carry the labels ``roving.session``, ``roving.name``, ``roving.user`` and ``roving.owner`` (a
  keyed hash only this user's key makes: `roving cancel --all` matches it, :func:`.containers.owner_label`); one
  thread follows the engine's ``die`` events of this session for every container's exit code, then the
  container is removed.
* Output: followed and printed with the process name as prefix, or written to the process's log file.
* ``Process.pid`` is the host's number for the child's Python process (the one Docker's init runs), as
  ``os.kill``, ``psutil`` and ``/proc`` on this machine know it, when the engine runs on this machine;
  None with a remote engine. Inside its container the child has the container's own number
  (``os.getpid()`` there is another).
* When this process exits, normally or killed, its containers still there are removed.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import re
import shutil
import socket
import struct
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union
from urllib.parse import urlparse

from .. import config as _config
from . import throttle
from .base import Backend, Job, JobInfo, JobSpec, JobState, JobStatus, user_name
from .containers import container_env, owner_label
from .errors import DockerError, UnknownJobError
from .output import LineSplitter
from ..system.private import open_private
from .reaper import Reaper

if TYPE_CHECKING:
    import docker

log = logging.getLogger(__name__)
_KEEP_LOG = 1 << 20  # bytes of output kept per container for logs() after it is removed
_OUTPUT_WAIT_S = 5.0  # how long shutdown waits for the output followers of the containers it removes
_SECRET_MOUNT = "/run/roving-session"  # where a container finds the folder holding the session secret


def network_gateway(name: str, attrs: dict) -> Optional[Tuple[str, str]]:
    """This machine's address on the local Docker network ``name`` (``attrs``: what the engine says of it),
    and where it came from; None when the network has no IPv4 subnet.

    The IPAM ``Gateway`` when Docker reports one. Docker 20.10 reports none for a network made with
    ``--subnet`` alone, though its bridge (``com.docker.network.bridge.name``, else ``br-`` and the first 12
    digits of the network's id) holds the gateway all the same: then the bridge's address, when it is in the
    subnet; else the subnet's first host address, which is what Docker gives the bridge by default.
    """
    for entry in (attrs.get("IPAM") or {}).get("Config") or ():
        if entry.get("Gateway"):
            return entry["Gateway"], f"the gateway of Docker network {name} ({entry['Gateway']})"
    for entry in (attrs.get("IPAM") or {}).get("Config") or ():
        try:
            subnet = ipaddress.ip_network(entry.get("Subnet") or "", strict=False)
        except ValueError:
            continue
        if subnet.version != 4:
            continue
        bridge = (attrs.get("Options") or {}).get("com.docker.network.bridge.name") or f"br-{attrs.get('Id', '')[:12]}"
        address = interface_address(bridge)
        if address is not None and ipaddress.ip_address(address) in subnet:
            return address, f"the address of Docker network {name}'s bridge {bridge} ({address})"
        first = str(next(subnet.hosts()))
        return first, f"the first address of Docker network {name}'s subnet {subnet} ({first}; no gateway reported)"
    return None


def interface_address(device: str) -> Optional[str]:
    """The IPv4 address of this machine's network interface ``device``, or None (no such interface, no
    IPv4 address, or not Linux)."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return None
    request = struct.pack("256s", device.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            answer = fcntl.ioctl(probe.fileno(), 0x8915, request)  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])


_TRANSIENT = re.compile(r"timeout|timed out|too many|temporarily|try again|overloaded|busy", re.I)


def _sdk() -> Any:
    try:
        import docker
    except ImportError:
        raise DockerError("the docker backend needs the Docker SDK for Python: pip install 'roving[docker]'") from None
    return docker


def _remote_engine() -> bool:
    """Whether the configured engine is another machine's (``docker_url`` or ``DOCKER_HOST`` over a network)."""
    cfg = _config.current()
    url = cfg.docker_url or os.environ.get("DOCKER_HOST", "")
    return "://" in url and urlparse(url).scheme in ("tcp", "http", "https", "ssh")


def _exitcode(code: int) -> int:
    # tini (docker's init) exits 128+N when its child was killed by signal N
    return -(code - 128) if 128 < code < 160 else code


class _Container:
    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.status = JobStatus(JobState.RUNNING)
        self.output = bytearray()
        self.output_done = threading.Event()
        self.ended = threading.Event()
        self.secret_dir: Optional[str] = None  # the host folder of its secret file, removed with it
        self.init_pid: Optional[int] = None  # the host pid of the container's init (a local engine's)
        self.pid: Optional[int] = None  # the host pid of the child's Python process, once found


def _run_by_init(init_pid: int) -> Optional[int]:
    """The host pid of the roving child that Docker's init ``init_pid`` runs, read from this machine's
    /proc; None when /proc does not show it (not forked yet, or ended) or shows other processes under
    those numbers (an engine in another pid namespace than this process's)."""
    try:
        with open(f"/proc/{init_pid}/cmdline", "rb") as f:
            if os.path.basename(f.read().split(b"\0")[0]) not in (b"docker-init", b"tini"):
                return None
        with open(f"/proc/{init_pid}/task/{init_pid}/children") as f:
            children = [int(word) for word in f.read().split()]
        for child in children:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"roving._child" in f.read().split(b"\0"):
                    return child
    except (OSError, ValueError):
        pass
    return None


def _secret_folder(secret: str) -> str:
    """A new private folder (0700) holding the file ``secret`` (0600) with the session secret."""
    folder = tempfile.mkdtemp(prefix="roving-secret-")
    fd = os.open(os.path.join(folder, "secret"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    return folder


class DockerBackend(Backend):
    name = "docker"

    def __init__(self) -> None:
        self._client = None
        self._lock = threading.Lock()
        self._jobs: Dict[str, _Container] = {}
        self._events_for: set = set()  # the session tags whose containers' ends are followed
        self._reaper = Reaper(self.name)

    # -- the engine ------------------------------------------------------------------------------
    def client(self) -> "docker.DockerClient":
        """The SDK's client, connected and checked on first use; DockerError if the engine is not there."""
        if self._client is None:
            docker = _sdk()
            url = _config.current().docker_url
            try:
                client = (docker.DockerClient(base_url=url, timeout=20, max_pool_size=128) if url
                          else docker.from_env(timeout=20, max_pool_size=128))
                client.ping()
            except Exception as exc:
                where = url or os.environ.get("DOCKER_HOST") or "the local socket"
                raise DockerError(f"the Docker engine at {where} is not reachable ({exc}); is dockerd "
                                  "running, and docker_url / DOCKER_HOST right?") from None
            self._client = client
        return self._client

    def _start_events(self, tag: str) -> None:
        """Follow the ends of the containers of session ``tag`` (once per session: there is one per
        process but for `roving run`'s)."""
        with self._lock:
            if tag in self._events_for:
                return
            self._events_for.add(tag)
        client = self.client()
        since = int(time.time()) - 1
        events = client.events(since=since, decode=True, filters={
            "type": "container", "event": "die", "label": f"roving.session={tag}"})
        threading.Thread(target=self._follow_events, args=(events,), name="roving-docker-events",
                         daemon=True).start()

    def _follow_events(self, events: Iterable[Dict[str, Any]]) -> None:
        for event in events:
            cid = event.get("id") or event.get("Actor", {}).get("ID")
            code = int(event.get("Actor", {}).get("Attributes", {}).get("exitCode", "-9"))
            if cid in self._jobs:
                try:
                    threading.Thread(target=self._ended, args=(cid, code), daemon=True).start()
                except RuntimeError:  # no thread to spare: handle it here rather than lose the event
                    self._ended(cid, code)

    def _ended(self, cid: str, code: int) -> None:
        job = self._jobs[cid]
        if job.ended.is_set():
            return
        client = self.client()
        try:
            if job.spec.output == "files":
                data = client.api.logs(cid, stdout=True, stderr=True)
                with open_private(job.spec.log_file()) as f:
                    f.write(data)
                job.output[:] = data[-_KEEP_LOG:]
            elif job.spec.output == "prefix":
                job.output_done.wait(10)
        except Exception:
            log.debug("roving: could not read the output of container %s", cid, exc_info=True)
        job.status = JobStatus(JobState.EXITED, _exitcode(code), out_of_memory=self._oom_killed(cid))
        job.ended.set()
        self._reaper.done(cid)
        self._remove(cid)

    def _oom_killed(self, cid: str) -> bool:
        """Whether the engine says the kernel killed container ``cid`` for memory (``State.OOMKilled``),
        read before the container is removed."""
        try:
            return bool(self.client().api.inspect_container(cid)["State"].get("OOMKilled"))
        except Exception:  # gone already: the engine no longer says
            return False

    def _remove(self, cid: str) -> None:
        state = self._jobs.get(cid)
        # A container this process did not start (`roving cancel`, the reaper of a killed parent): its
        # secret's folder is the one mounted at _SECRET_MOUNT.
        folder = state.secret_dir if state is not None else self._secret_folder_of(cid)
        try:
            self.client().api.remove_container(cid, force=True)
        except Exception:  # already gone
            pass
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
            self._reaper.folder_gone(folder)
            if state is not None:
                state.secret_dir = None

    def _secret_folder_of(self, cid: str) -> Optional[str]:
        try:
            mounts = self.client().api.inspect_container(cid).get("Mounts") or []
        except Exception:
            return None
        for m in mounts:
            source = m.get("Source", "")
            if (m.get("Destination") == _SECRET_MOUNT and os.path.dirname(source) == tempfile.gettempdir()
                    and os.path.basename(source).startswith("roving-secret-")):
                return source
        return None

    # -- jobs ------------------------------------------------------------------------------------
    def create_job(self, spec: JobSpec) -> Job:
        cfg = _config.current()
        docker = _sdk()
        if not cfg.image:
            raise DockerError("the docker backend needs an image: set the roving option `image` "
                              "(or use `roving run --build`)")
        client = self.client()
        tag = spec.session.tag
        self._start_events(tag)
        res = spec.resources
        info = self._info()
        if res.memory and res.memory > info.get("MemTotal", res.memory):
            raise DockerError(f"{spec.name} asks for {res.memory / 2**30:.1f} GiB of memory; the Docker "
                              f"host has {info['MemTotal'] / 2**30:.1f} GiB")
        if res.cpu > info.get("NCPU", res.cpu):
            raise DockerError(f"{spec.name} asks for {res.cpu:g} CPUs; the Docker host has {info['NCPU']}")
        device_requests = [docker.types.DeviceRequest(count=res.gpu, capabilities=[["gpu"]])] if res.gpu else None
        volumes = {spec.cwd: {"bind": spec.cwd, "mode": "rw"}} if cfg.docker_mount_cwd else {}
        for item in cfg.docker_volumes:
            parts = item.split(":")
            if len(parts) < 2:
                raise DockerError(f"bad docker_volumes entry {item!r}: use host:container[:ro]")
            volumes[os.path.abspath(parts[0])] = {"bind": parts[1], "mode": parts[2] if len(parts) > 2 else "rw"}
        env, secret = container_env(spec, cfg.forward_env)
        secret_dir = _secret_folder(secret) if secret else None
        if secret_dir:
            self._reaper.folder(secret_dir)  # removed by the watcher if this process is killed
            volumes[secret_dir] = {"bind": _SECRET_MOUNT, "mode": "ro"}
            env[spec.session.secret_file_env] = f"{_SECRET_MOUNT}/secret"
        try:
            container = self._when_not_busy(f"creating a container for {spec.name}", lambda: client.containers.create(
                cfg.image, command=spec.command, environment=env, working_dir=spec.cwd, volumes=volumes,
                network_mode=cfg.docker_network, init=True, nano_cpus=int(res.cpu * 1e9),
                mem_limit=res.memory or None, device_requests=device_requests, detach=True,
                labels={"roving.session": tag, "roving.name": spec.name, "roving.user": user_name(),
                        "roving.owner": owner_label()},
                name=f"roving-{tag}-{spec.name.replace(':', '-')}-{os.urandom(3).hex()}"))
        except BaseException as exc:
            if secret_dir:
                shutil.rmtree(secret_dir, ignore_errors=True)
                self._reaper.folder_gone(secret_dir)
            if isinstance(exc, docker.errors.ImageNotFound):
                raise DockerError(f"the image {cfg.image!r} is not on the Docker host; build it (`roving "
                                  "run --build`, or docker build) or pull it") from None
            if isinstance(exc, docker.errors.APIError):
                raise DockerError(f"Docker refused to create a container for {spec.name}: "
                                  f"{exc.explanation or exc}") from None
            raise
        job_state = _Container(spec)
        job_state.secret_dir = secret_dir
        with self._lock:
            self._jobs[container.id] = job_state
        self._reaper.add(container.id)
        try:
            self._when_not_busy(f"starting the container of {spec.name}", container.start)
        except docker.errors.APIError as exc:
            self._remove(container.id)
            self._reaper.done(container.id)
            with self._lock:
                self._jobs.pop(container.id, None)
            raise DockerError(f"Docker could not start {spec.name}: {exc.explanation or exc}") from None
        if spec.output == "prefix":
            threading.Thread(target=self._follow_output, args=(container.id, job_state),
                             name=f"roving-docker-output-{spec.name}", daemon=True).start()
        if not _remote_engine():  # known now, as multiprocessing's pid is after start(), even if it ends soon
            try:
                job_state.init_pid = int(client.api.inspect_container(container.id)["State"]["Pid"]) or None
            except Exception:  # ended and removed already
                log.debug("roving: no pid for container %s", container.id, exc_info=True)
            if job_state.init_pid:
                job_state.pid = _run_by_init(job_state.init_pid)
        return Job(self, container.id)

    def submit_many(self, specs: Sequence[JobSpec]) -> List[Union[Job, Exception]]:
        """Containers created and started concurrently, at most :data:`throttle.CONCURRENCY` at a time."""
        if len(specs) > 1:
            try:  # once, before the threads: the client, the engine's size, the session's event stream
                self.client()
                self._info()
                self._start_events(specs[0].session.tag)
            except Exception as exc:
                return [exc] * len(specs)
        return throttle.concurrently(self.create_job, specs)

    @staticmethod
    def _when_not_busy(what: str, call: Callable[[], Any]) -> Any:
        """``call()``, retried with back-off while the engine answers 429 or 5xx (busy, overloaded)."""
        docker = _sdk()

        def busy(exc: Exception) -> Optional[str]:
            code = getattr(getattr(exc, "response", None), "status_code", None)
            if not isinstance(exc, docker.errors.APIError) or code is None:
                return None
            words = str(exc.explanation or exc)
            # a 500 is also how the engine reports a bad request it found late (a mount): only retried
            # when its words say it is passing
            if code in (429, 502, 503, 504) or (code == 500 and _TRANSIENT.search(words)):
                return f"HTTP {code}: {words}"
            return None

        return throttle.retry_busy(call, busy, what)

    def _info(self) -> dict:
        if not hasattr(self, "_info_cache"):
            self._info_cache = self.client().info()
        return self._info_cache

    def _follow_output(self, cid: str, job: _Container) -> None:
        out, err = LineSplitter(f"[{job.spec.name}] "), LineSplitter(f"[{job.spec.name}] ", True)
        try:
            # attach (with logs=True: from the start) is the call that keeps stdout and stderr apart
            for stdout, stderr in self.client().api.attach(cid, stdout=True, stderr=True, stream=True,
                                                           logs=True, demux=True):
                if stdout:
                    out.feed(stdout)
                if stderr:
                    err.feed(stderr)
                job.output += (stdout or b"") + (stderr or b"")
                del job.output[:-_KEEP_LOG]
        except Exception:
            log.debug("roving: stopped following container %s", cid, exc_info=True)
        finally:
            out.close()
            err.close()
            job.output_done.set()

    def job_status(self, job: Job) -> JobStatus:
        state = self._jobs.get(job.id)
        if state is not None:
            return state.status
        try:
            attrs = self.client().api.inspect_container(job.id)["State"]
        except Exception:
            return JobStatus(JobState.EXITED, -9, "no such container")
        if attrs.get("Running"):
            return JobStatus(JobState.RUNNING)
        if attrs.get("Status") == "created":
            return JobStatus(JobState.PENDING, reason="created")
        return JobStatus(JobState.EXITED, _exitcode(attrs.get("ExitCode", 0)),
                         out_of_memory=bool(attrs.get("OOMKilled")))

    def wait(self, job: Job, timeout: Optional[float] = None) -> Optional[int]:
        state = self._jobs.get(job.id)
        if state is None:
            return super().wait(job, timeout)
        if not state.ended.wait(timeout):
            return None
        return state.status.exitcode

    def terminate_job(self, job: Job, force: bool = False) -> None:
        state = self._jobs.get(job.id)
        if state is not None and state.ended.is_set():
            return
        try:
            self.client().api.kill(job.id, signal="SIGKILL" if force else "SIGTERM")
        except Exception:  # not running any more
            pass

    def logs(self, job: Job) -> str:
        state = self._jobs.get(job.id)
        if state is not None and (state.ended.is_set() or state.spec.output == "prefix"):
            return bytes(state.output).decode(errors="replace")
        try:
            return self.client().api.logs(job.id, stdout=True, stderr=True).decode(errors="replace")
        except _sdk().errors.NotFound:
            raise UnknownJobError(f"no Docker container {job.id}") from None
        except Exception as exc:
            raise DockerError(f"no logs for container {job.id[:12]}: {exc}") from None

    def pid(self, job: Job) -> Optional[int]:
        """The host pid of the child's Python process, when the engine runs on this machine (see the
        module's docstring); None for a remote engine's container or one this process did not start."""
        state = self._jobs.get(job.id)
        if state is None:
            return None
        if state.pid is None and state.init_pid and not state.ended.is_set():
            state.pid = _run_by_init(state.init_pid)  # init had not started it yet when the job was made
        return state.pid

    def cpu_count(self) -> int:
        return int(self._info().get("NCPU") or os.cpu_count() or 1)

    def shares_filesystem(self) -> bool:
        """Containers see this machine's working directory only when the engine is this machine's and
        the directory is mounted (``docker_mount_cwd``)."""
        return _config.current().docker_mount_cwd and not _remote_engine()

    def towards(self) -> Optional[Tuple[str, str]]:
        """A remote engine's host (its containers run there); else, on a network other than ``host``,
        that network's gateway (this machine's address on it, which its containers reach); else None
        (containers share this machine's network)."""
        cfg = _config.current()
        url = cfg.docker_url or os.environ.get("DOCKER_HOST", "")
        parsed = urlparse(url) if "://" in url else None
        if parsed is not None and parsed.scheme in ("tcp", "http", "https", "ssh") and parsed.hostname:
            return parsed.hostname, f"the Docker engine's host {parsed.hostname}"
        if cfg.docker_network in ("host", "none"):
            return None
        try:
            attrs = self.client().networks.get(cfg.docker_network).attrs
        except DockerError:
            raise
        except Exception as exc:
            raise DockerError(f"docker_network={cfg.docker_network!r}: the engine does not know it ({exc})") from None
        found = network_gateway(cfg.docker_network, attrs)
        if found is None:
            raise DockerError(f"Docker network {cfg.docker_network!r} has no IPv4 subnet, so no gateway address: set "
                              "the roving options host= and advertise= to an address of this machine its containers "
                              "reach")
        return found

    # -- images ----------------------------------------------------------------------------------
    def build_image(self, tag: str, context: str = ".", buildargs: Optional[Dict[str, str]] = None) -> None:
        """Build the image ``tag`` from the Dockerfile in the folder ``context``, on the engine; blocks
        until it is built. OSError (DockerError) naming the tag when the build fails."""
        try:
            self.client().images.build(path=context, tag=tag, buildargs=dict(buildargs or {}), rm=True)
        except _sdk().errors.DockerException as exc:
            raise DockerError(f"the build of {tag} from {os.path.join(context, 'Dockerfile')} failed: {exc}") from None

    def push_image(self, tag: str) -> None:
        """Push the image ``tag`` to the registry its name starts with; blocks until pushed. OSError
        (DockerError) naming the tag when the push fails."""
        try:
            for line in self.client().images.push(tag, stream=True, decode=True):
                if "error" in line:
                    raise DockerError(f"push of {tag} failed: {line['error']}")
        except _sdk().errors.DockerException as exc:
            raise DockerError(f"push of {tag} failed: {exc}") from None

    def describe(self) -> Dict[str, str]:
        info = self._info()
        cfg = _config.current()
        image = cfg.image or "(none configured: set the `image` option)"
        if cfg.image:
            try:
                self.client().images.get(cfg.image)
            except Exception:
                image += " (not on the Docker host)"
        return {"engine": f"Docker {info.get('ServerVersion', '?')} on {info.get('Name', '?')}",
                "cpus": str(info.get("NCPU")), "memory": f"{info.get('MemTotal', 0) / 2**30:.1f} GiB",
                "gpu runtimes": ", ".join(sorted(info.get("Runtimes", {}))), "image": image}

    def list_jobs(self, user: Optional[str] = None) -> List[JobInfo]:
        # a user's jobs: those that carry the label only this user's key makes (containers.owner_label)
        labels = ["roving.session"] + ([f"roving.owner={owner_label(user)}"] if user is not None else [])
        jobs = []
        for c in self.client().containers.list(all=True, filters={"label": labels}):
            jobs.append(JobInfo(id=c.id[:12], name=c.labels.get("roving.name", ""),
                                session=c.labels.get("roving.session", ""), state=c.status,
                                user=c.labels.get("roving.user", "")))
        return jobs

    def unknown_ids(self, job_ids: Iterable[str]) -> List[str]:
        """Those of ``job_ids`` that are no roving container; an id may be any prefix of 12 characters or more
        of the full one, or the full one."""
        known = [j.id for j in self.list_jobs()]
        return [i for i in job_ids if not any(i[:12] == k and len(i) >= 12 for k in known)]

    def cancel_ids(self, job_ids: Iterable[str]) -> None:
        for cid in job_ids:
            self._remove(cid)

    def shutdown(self) -> None:
        with self._lock:
            live = [(cid, s) for cid, s in self._jobs.items() if not s.ended.is_set()]
        for cid, _ in live:
            self._remove(cid)
            self._reaper.done(cid)
        # a removed container's output stream ends: its follower prints the last lines it holds and is done.
        # Wait for that (bounded), or the last lines of a child still running at exit (a daemon, one never
        # joined; a joined one was waited for in ``_ended``) are lost with the interpreter.
        deadline = time.monotonic() + _OUTPUT_WAIT_S
        for _, state in live:
            if state.spec.output == "prefix":
                state.output_done.wait(max(0.0, deadline - time.monotonic()))
