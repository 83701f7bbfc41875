"""roving's configuration: one :class:`Config`, resolved from four layers.

Later layers win: built-in defaults < ``[tool.roving]`` in ``pyproject.toml`` or ``roving.toml`` in the
working directory < ``ROVING_<OPTION>`` environment variables < :func:`roving.init` keyword arguments.
A key no option has, or a value of the wrong kind, is a :class:`ConfigError` naming the key and the
layer it came from. Child processes receive the parent's resolved configuration.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import threading
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

from .errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Config", "ConfigError", "load", "current", "init", "file_options", "parse_memory", "parse_port_range",
           "set_backend_detector", "adopt"]

_CHOICES = {
    # "auto" is resolved at once to the backend detected here (see roving.backends.detect)
    "backend": ("auto", "local", "slurm", "docker", "kubernetes"),
    "child_output": ("prefix", "off", "files"),
    "encrypt": ("auto", "always", "off"),
    "dashboard_tls": ("auto", "on", "off"),
    "env_check": ("auto", "strict", "warn", "off"),
    "ship_code": ("auto", "always", "off"),
    "local_start": ("fork", "fresh"),
}
# Environment variables that roving sets for its own children; not options.
_INTERNAL_ENV = {"ROVING_CHILD", "ROVING_SESSION_SECRET", "ROVING_SESSION_SECRET_FILE"}



def _local() -> str:
    return "local"


#: Names the backend to use when the option is "auto": roving.backends installs its detect() when it is
#: imported (which importing roving does), so that this module, below every other, imports none of them
#: (the detection is the backends' knowledge; that the choice is made once, here, is the configuration's:
#: a child takes the parent's resolved choice and never detects again).
_detector: Callable[[], str] = _local


def set_backend_detector(detector: Callable[[], str]) -> None:
    """Install the function that names the backend ``backend="auto"`` stands for (roving.backends)."""
    global _detector
    _detector = detector


def _detected_backend() -> str:
    return _detector()


_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "ki": 1024, "kib": 1024, "m": 1024 ** 2, "mb": 1024 ** 2,
          "mi": 1024 ** 2, "mib": 1024 ** 2, "g": 1024 ** 3, "gb": 1024 ** 3, "gi": 1024 ** 3,
          "gib": 1024 ** 3, "t": 1024 ** 4, "tb": 1024 ** 4, "ti": 1024 ** 4, "tib": 1024 ** 4}


def parse_memory(value: Union[int, float, str]) -> int:
    """Bytes from an int or a string like ``512M``, ``2G``, ``1.5GiB`` (binary units). ValueError if bad."""
    number: Union[int, float, str]
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = value, ""
    else:
        text = str(value).strip().lower()
        split = len(text.rstrip("abcdefghijklmnopqrstuvwxyz"))
        number, unit = text[:split].strip(), text[split:]
        if unit not in _UNITS:
            raise ValueError(f"unknown memory unit {unit!r} (use K, M, G or T)")
        number = float(number)
    size = int(float(number) * _UNITS[unit])
    if size <= 0:
        raise ValueError("must be positive")
    return size


def parse_port_range(text: Optional[str]) -> Optional[Tuple[int, int]]:
    """``"50000-50100"`` (or one port) as (low, high); None for none. ValueError if malformed."""
    if text is None or not str(text).strip():
        return None
    low, _, high = str(text).strip().partition("-")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"{text!r} is not a port range: use LOW-HIGH, e.g. 50000-50100") from None
    if not 1 <= lo <= hi <= 65535:
        raise ValueError(f"{text!r} is not a port range within 1-65535 with LOW <= HIGH")
    return lo, hi


@dataclasses.dataclass(frozen=True)
class Config:
    #: Which backend starts processes as jobs: local, slurm, docker, kubernetes, or auto (the default):
    #: slurm inside a Slurm allocation, kubernetes inside a Kubernetes pod, local otherwise.
    backend: str = dataclasses.field(default_factory=_detected_backend)
    #: Address this process's endpoints bind to. ``auto``: loopback when every process runs on this
    #: machine, else the interface towards the parent (a child) or the cluster (see
    #: roving.transport.addressing); ``0.0.0.0``/``::``: every interface. Holds for the process that sets
    #: it: a child chooses its own (a wildcard is kept).
    host: str = "auto"
    #: Address other processes use to reach this one (NAT, a wildcard ``host``); ``auto``: the one bound.
    advertise: Optional[str] = "auto"
    #: Ports roving listens on, as ``LOW-HIGH`` (for firewalls); none: any free port.
    port_range: Optional[str] = None
    #: Encryption and integrity of connections between processes (roving.transport.crypto): "auto"
    #: (every stream whose address is not loopback is TLS 1.3; ZeroMQ always runs CURVE, which also keeps
    #: strangers out of its handshake), "always" (loopback streams too) or "off" (plain text; a warning
    #: is logged when traffic leaves loopback).
    encrypt: str = "auto"
    #: How a child's environment (Python, platform, the versions of the distributions the parent imported)
    #: is compared with its parent's when it starts, before it unpickles anything (roving.environment):
    #: "auto" (another Python major.minor or roving is an error, anything else a warning), "strict" (every
    #: difference is an error), "warn" (every difference a warning) or "off".
    env_check: str = "auto"
    #: The Python a child runs (a command on the child's machine: another node image or venv); none: this
    #: process's own (``sys.executable``). With another one, only the program's own ``sys.path`` entries
    #: (not this interpreter's standard library and site-packages) go with the child.
    python: Optional[str] = None
    #: The program's own modules (sys.path folders outside the interpreter's installation: its script's
    #: folder, the working directory) sent to children as an archive, once per machine (roving.codeship):
    #: "auto" where the backend's jobs do not see this machine's files (Kubernetes, a remote Docker
    #: engine, ``docker_mount_cwd=False``), "always", or "off".
    ship_code: str = "auto"
    #: The largest archive of the program's code roving ships (bytes, or "64M"); more is an error naming
    #: the biggest files.
    ship_code_limit: str = "64M"
    #: Where a child's stdout/stderr go: "prefix" (parent's terminal, each line prefixed with the
    #: process name), "off" (discarded) or "files" (one log file per process in ``log_dir``).
    child_output: str = "prefix"
    log_dir: str = "roving-logs"
    #: How the local backend starts a child of this interpreter: "fork" (the default) forks it from a
    #: starter process that has imported roving's child code once (roving.backends.local.starter; what
    #: multiprocessing's forkserver does): it starts in milliseconds and shares that memory with its
    #: siblings until it writes to it; "fresh" runs a new interpreter for each (about 0.4 s of CPU and
    #: 20 MB of memory more per child).
    local_start: str = "fork"
    #: Modules the local backend's starter imports besides roving's child code, before it forks
    #: (multiprocessing's forkserver preload): a child whose target imports them (torch: seconds of CPU)
    #: starts with them imported. A list, or comma-separated in one string. Setting it forks children
    #: even with ``local_start="fresh"``. SkipPipe's trainer preloads its stage processes' module on the
    #: local backend when this is not set.
    local_preload: Tuple[str, ...] = ()
    #: Seconds between a child's liveness checks of its parent.
    heartbeat_interval: float = 1.0
    #: A child whose parent has not answered for this many seconds exits.
    parent_timeout: float = 5.0
    #: Seconds to wait for a new connection to authenticate, and for a child to fetch its work.
    connect_timeout: float = 30.0
    #: A pool worker whose job runs but that has sent no heartbeat for this many seconds is killed and its
    #: work redone by other workers. Generous: a task holding the GIL in C code delays heartbeats.
    pool_heartbeat_timeout: float = 30.0
    #: Seconds a pool worker told it will end (a time limit, a preemption, ``end_signals``) has to finish
    #: the item it runs before it leaves anyway; its other items go back at once, and its items cost no
    #: retry (roving.pool._ending). Keep it under the cluster's kill delay (Slurm's KillWait, a pod's
    #: terminationGracePeriodSeconds).
    worker_grace: float = 20.0
    #: Seconds each pool worker lives before the pool replaces it (its replacement is started first); none:
    #: on Slurm, the job's ``slurm_time`` less 10 s where it is set, else unlimited. A map of hours runs on
    #: workers of minutes.
    worker_lifetime: Optional[float] = None
    #: Signals that tell a pool worker it will end (comma-separated names). Slurm jobs are also submitted
    #: with ``--signal=B:USR1@N`` (N: ``worker_grace`` + 10 s) so that the warning comes before the limit.
    end_signals: str = "TERM,USR1"
    #: A file whose appearance tells a pool worker its machine will be preempted (a spot notice a node
    #: agent writes); none: not watched.
    preemption_file: Optional[str] = None
    #: A URL polled every 5 s whose answer tells a pool worker its machine will be preempted: notice is an
    #: answer 200 whose body is not "FALSE" (AWS: ``http://169.254.169.254/latest/meta-data/spot/instance-action``;
    #: GCE: ``http://metadata.google.internal/computeMetadata/v1/instance/preempted``); none: not polled.
    preemption_url: Optional[str] = None
    #: Serve the live dashboard (roving.dashboard) from the main process: its URL, with a token, is
    #: printed once. Children never serve one.
    dashboard: bool = False
    #: Address the dashboard listens on: loopback by default; another only on request (then over HTTPS,
    #: see ``dashboard_tls``).
    dashboard_host: str = "127.0.0.1"
    #: Its port; 0: a free one.
    dashboard_port: int = 0
    #: HTTPS for the dashboard: "auto" (when ``dashboard_host`` is not loopback, with a self-signed
    #: certificate made at start, its fingerprint printed with the URL), "on" or "off".
    dashboard_tls: str = "auto"
    #: Host names the dashboard answers to besides its own (localhost, this machine's names and
    #: addresses): the name a browser uses to reach it through a NAT, a proxy or a DNS alias; a list, or
    #: comma-separated in one string. Requests under any other name get 421.
    dashboard_hosts: Tuple[str, ...] = ()
    #: A pool whose workers fail to start this many times in a row, none connecting in between, gives
    #: up: its pending and later calls raise the error (a worker that connects resets the count).
    pool_start_failures: int = 5

    # -- what each process asks the backend for (local: memory only, as a limit) ------------
    #: CPUs per process.
    cpu: float = 1.0
    #: Memory per process, e.g. "2G" (binary units); none: the cluster's default. The local backend runs
    #: each process in a memory cgroup of that limit where this machine lets it make one (else it warns).
    memory: Optional[str] = None
    #: GPUs per process.
    gpu: int = 0
    #: A job pending longer than this many seconds is logged with the cluster's reason.
    pending_warning: float = 30.0

    # -- slurm ----------------------------------------------------------------------------------
    slurm_partition: Optional[str] = None
    slurm_account: Optional[str] = None
    #: Time limit of each job, in sbatch's --time format ("1:00:00").
    slurm_time: Optional[str] = None
    #: Further sbatch/srun options, as one shell-quoted string ("--qos=high --constraint=a100").
    slurm_options: str = ""
    #: Start a pool's workers as one Slurm job array (``sbatch --array``) rather than one job each.
    slurm_array: bool = True

    # -- docker and kubernetes ------------------------------------------------------------------
    #: The container image jobs run in (docker and kubernetes). `roving run --build` makes one.
    image: Optional[str] = None
    #: Where `roving run --build` pushes the image it built; none: the image stays local.
    registry: Optional[str] = None
    #: Docker engine address (default: DOCKER_HOST or the local socket).
    docker_url: Optional[str] = None
    #: Extra bind mounts for containers, "host:container[:ro]"; a list, or comma-separated in one string.
    docker_volumes: Tuple[str, ...] = ()
    #: Docker network mode of the containers.
    docker_network: str = "host"
    #: Mount the working directory into each container at the same path (as its working directory). Off:
    #: a container sees only its image and ``docker_volumes`` (the program's code is then shipped, see
    #: ``ship_code``).
    docker_mount_cwd: bool = True
    #: Variables of this environment that containers and pods get too, by name; a list, or
    #: comma-separated in one string. They get nothing else of it but what roving itself needs.
    forward_env: Tuple[str, ...] = ()
    #: Kubernetes namespace of the pods (default: the parent pod's own, else "default").
    kubernetes_namespace: Optional[str] = None

    def replace(self, source: str, **changes: object) -> "Config":
        return dataclasses.replace(self, **_coerce(changes, source))


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _coerce(values: Mapping[str, Any], source: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in values.items():
        if key not in _FIELDS:
            known = ", ".join(sorted(_FIELDS))
            raise ConfigError(f"unknown roving option {key!r} (from {source}); known options: {known}")
        default = _FIELDS[key].default
        try:
            if key == "backend" and value == "auto":
                value = _detected_backend()
            elif key == "ship_code_limit":
                parse_memory(value)
                value = str(value)
            elif key == "end_signals":
                import signal

                for name in (n.strip().upper() for n in str(value).split(",") if n.strip()):
                    if not hasattr(signal, name if name.startswith("SIG") else f"SIG{name}"):
                        raise ValueError(f"no signal named {name!r}")
                value = str(value)
            elif key == "memory" and value is not None:
                parse_memory(value)
                value = str(value)
            elif key == "port_range" and value is not None:
                parse_port_range(value)
                value = str(value).strip()
            elif isinstance(default, tuple):
                items = value.split(",") if isinstance(value, str) else list(value)
                value = tuple(str(item).strip() for item in items if str(item).strip())
                if key == "local_preload":
                    for name in value:
                        if not all(part.isidentifier() for part in name.split(".")):
                            raise ValueError(f"{name!r} is not a module name")
            elif isinstance(default, bool):
                value = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
            elif isinstance(default, float):
                value = float(value)
                if value <= 0:
                    raise ValueError("must be positive")
            elif isinstance(default, int):
                value = int(value)
                if value < 0:
                    raise ValueError("must not be negative")
                if key == "pool_start_failures" and value < 1:
                    raise ValueError("must be at least 1")
            elif value is not None:
                value = str(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"bad value {value!r} for roving option {key!r} (from {source}): {exc}") from None
        if key in _CHOICES and value not in _CHOICES[key]:
            raise ConfigError(f"bad value {value!r} for roving option {key!r} (from {source}); "
                              f"choose one of {', '.join(_CHOICES[key])}")
        out[key] = value
    return out


def file_options(cwd: str) -> Tuple[Dict[str, object], str]:
    """The options of the file layer found in ``cwd`` (``roving.toml``, else ``[tool.roving]`` of
    ``pyproject.toml``) as written there, and where they came from ("" when there is no file).
    ConfigError when ``roving.toml`` is not valid TOML."""
    path = os.path.join(cwd, "roving.toml")
    if os.path.exists(path):
        with open(path, "rb") as f:
            try:
                return tomllib.load(f), path
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    path = os.path.join(cwd, "pyproject.toml")
    if os.path.exists(path):
        with open(path, "rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError:
                return {}, path  # someone else's broken file is not ours to reject
        return data.get("tool", {}).get("roving", {}), f"[tool.roving] in {path}"
    return {}, ""


def load(overrides: Optional[Mapping[str, object]] = None, cwd: Optional[str] = None,
         environ: Optional[Mapping[str, str]] = None) -> Config:
    """Resolve the configuration from defaults, file, environment and ``overrides``, in that order."""
    config = Config()
    values, source = file_options(cwd or os.getcwd())
    if values:
        config = config.replace(source, **values)
    env = os.environ if environ is None else environ
    from_env = {k[len("ROVING_"):].lower(): v for k, v in env.items()
                if k.startswith("ROVING_") and k not in _INTERNAL_ENV}
    for key, value in from_env.items():
        config = config.replace(f"environment variable ROVING_{key.upper()}", **{key: value})
    if overrides:
        config = config.replace("roving.init()", **overrides)
    return config


_current: Optional[Config] = None
#: guards the assignments of ``_current``: a thread that resolves the configuration on first use while
#: another calls ``init()`` must not put its older result over the one ``init()`` set
_lock = threading.Lock()


def current() -> Config:
    """The configuration in force in this process (resolved on first use)."""
    global _current
    config = _current
    if config is None:
        loaded = load()  # outside the lock: it may look at the machine (the backend's detector)
        with _lock:
            if _current is None:
                _current = loaded
            config = _current
    return config


def init(**options: object) -> Config:
    """Set roving options for this process and the processes it starts from now on.

    Options add to those of earlier ``init()`` calls (a later value for the same option wins).
    Raises :class:`ConfigError` for an unknown option or a bad value; the configuration in force is then
    unchanged.
    """
    global _current, _init_options
    merged = {**_init_options, **options}
    config = load(merged)
    with _lock:
        _current, _init_options = config, merged
    return config


_init_options: Dict[str, Any] = {}


_WILDCARD_HOSTS = ("0.0.0.0", "::")


def adopt(config: Config) -> None:
    """Used by a child (and by the Reaper's watcher): take the parent's resolved configuration as this
    process's, but not its address: a child chooses its own (``host``/``advertise`` back to ``auto``; a
    wildcard ``host`` is kept)."""
    global _current
    adopted = dataclasses.replace(
        config, host=config.host if config.host in _WILDCARD_HOSTS else "auto", advertise="auto")
    with _lock:
        _current = adopted
