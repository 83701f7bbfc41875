"""The project's test hosts, for cross-host tests: names, addresses, commands run on a host, faults.

scripts/cluster/hosts.sh (run by scripts/test.sh, as root) makes them: network namespaces joined by veth
pairs to a bridge, each with its own address and hostname, and a multi-node Slurm on them (slurmctld on
the head host, one slurmd per compute host). The root namespace, where pytest runs, is a host too, at
the bridge's address (:data:`ROOT`). Names and addresses come from scripts/cluster/hosts.env, the file
hosts.sh reads. scripts/cluster/docker.sh makes the Docker network :data:`DOCKER_NETWORK`.

What to know when writing a test:

* Loopback is per host: nothing inside a host reaches 127.0.0.1 of another (nor of the root namespace).
  A process that other hosts must reach listens on its host's address (or 0.0.0.0).
* The filesystem is one for all hosts: /tmp, the working tree, the munge socket. A file written "on" one
  host is seen on every other one (as with a shared filesystem). /dev/shm is not: the Slurm jobs of each
  compute host have a tmpfs of their own there, as separate machines would (processes started with
  :func:`run_on` see the root's).
* There is no link delay or loss to emulate (tc netem does not work here); a fault is a link set down
  (:func:`cut`: partitioned, its processes live on) or a host killed whole (:func:`kill_host`).
* A process's roving endpoint binds once, with the options of its first use (the pytest process's
  usually to loopback, by an earlier test): a cross-host parent runs as a program of its own
  (:func:`run_on` / :func:`call_on`, e.g. tests/support/programs/hosts_pool.py), on the root host or another.
* Every call here has a timeout; use :func:`slurm` for Slurm's commands (srun can hang after a node
  failure) and the :func:`hosts` fixture in any test that cuts or kills a host: it mends them afterwards,
  even when the test fails.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set, Union

import pytest

from helpers_core import SUPPORT_DIR, TIMEOUT, ROOT as REPO  # ROOT below is the root host

SCRIPTS = REPO / "scripts" / "cluster"
HOSTS_SH = SCRIPTS / "hosts.sh"
ENV_FILE = SCRIPTS / "hosts.env"
FIX = "run `bash scripts/cluster/hosts.sh` as root (scripts/test.sh does)"


def read_env(path: Path = ENV_FILE) -> Dict[str, str]:
    """hosts.env's KEY=VALUE lines (comments and blank lines skipped)."""
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            if not sep:
                raise ValueError(f"{path}: not KEY=VALUE: {line!r}")
            values[key.strip()] = value.strip()
    return values


@dataclass(frozen=True)
class Host:
    """A test host: its name (the network namespace, hostname and Slurm node name) and address.

    ``netns`` is None for the root namespace, where the tests run.
    """

    name: str
    address: str
    netns: Optional[str]

    @property
    def link(self) -> str:
        """The root end of its veth pair, on the bridge (what :func:`cut` sets down)."""
        return f"ve-{self.name}"


def _host(spec: str) -> Host:
    name, _, address = spec.partition(":")
    return Host(name, address, name)


ENV = read_env()
SUBNET = ENV["HOSTS_SUBNET"]
BRIDGE = ENV["HOSTS_BRIDGE"]
ROOT = Host(socket.gethostname(), ENV["HOSTS_ROOT_ADDR"], None)
HEAD = _host(ENV["HOSTS_HEAD"])
COMPUTE = tuple(_host(s) for s in ENV["HOSTS_COMPUTE"].split(","))
#: A host with no Slurm daemon, for a parent process that a test cuts off alone (the root host cannot be).
LOGIN = _host(ENV["HOSTS_LOGIN"])
#: Every namespace host by name (the head, the compute hosts, the login host; not the root).
HOSTS = {h.name: h for h in (HEAD, *COMPUTE, LOGIN)}
NODE_CPUS = int(ENV["HOSTS_NODE_CPUS"])
SLURM_CONF = ENV["HOSTS_SLURM_CONF"]
SLURM_STATE = ENV["HOSTS_SLURM_STATE"]
PARTITION = ENV["HOSTS_SLURM_PARTITION"]
DOCKER_NETWORK = ENV["DOCKER_TEST_NETWORK"]
DOCKER_SUBNET = ENV["DOCKER_TEST_SUBNET"]
DOCKER_GATEWAY = ENV["DOCKER_TEST_GATEWAY"]

#: sinfo's compact states (%t) of a node that takes jobs.
READY = ("idle", "mix", "alloc")

HostLike = Union[Host, str]


def host(h: HostLike) -> Host:
    """The Host named ``h`` (a Host is returned as it is); ValueError naming the known ones otherwise."""
    if isinstance(h, Host):
        return h
    if h == ROOT.name:
        return ROOT
    try:
        return HOSTS[h]
    except KeyError:
        raise ValueError(f"no test host named {h!r}; there are {sorted(HOSTS)} and the root {ROOT.name!r}") from None


def _run(argv: Sequence[str], timeout: float = TIMEOUT, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kw)


# --- is it there ----------------------------------------------------------------------------------

def problems() -> List[str]:
    """What is missing of the hosts and the multi-node Slurm (empty when all is there and ready)."""
    found = []
    try:
        addrs = _run(["ip", "-4", "-o", "addr", "show", "dev", BRIDGE], timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"`ip` does not work here ({exc})"]
    if f" {ROOT.address}/" not in addrs:
        found.append(f"the bridge {BRIDGE} with {ROOT.address} is not there")
    for h in HOSTS.values():
        if not os.path.exists(f"/run/netns/{h.netns}"):
            found.append(f"the network namespace {h.netns} is not there")
            continue
        inside = _run(["ip", "-n", h.netns, "-4", "-o", "addr", "show", "dev", "eth0"], timeout=10).stdout
        if f" {h.address}/" not in inside:
            found.append(f"{h.name} does not have its address {h.address}")
        if "state UP" not in _run(["ip", "-o", "link", "show", "dev", h.link], timeout=10).stdout:
            found.append(f"{h.name}'s link {h.link} is not up")
    if found:
        return found
    try:
        states = node_states()
    except (OSError, subprocess.TimeoutExpired, AssertionError) as exc:
        return [f"the multi-node Slurm (SLURM_CONF={SLURM_CONF}) does not answer: {exc}"]
    for h in COMPUTE:
        if states.get(h.name) not in READY:
            found.append(f"Slurm node {h.name} is {states.get(h.name, 'missing')!r}, not idle")
    return found


def require(grace: float = 30) -> None:
    """Fail the test (never skip) naming the fix when the hosts or the multi-node Slurm are not there.

    A node on its way back (a host an earlier test revived) is given ``grace`` seconds to be idle.
    """
    deadline = time.monotonic() + grace
    found = problems()
    while found and all(f.startswith("Slurm node ") for f in found) and time.monotonic() < deadline:
        time.sleep(0.5)
        found = problems()
    if found:
        pytest.fail(f"the test hosts are not ready: {'; '.join(found)}: {FIX}", pytrace=False)


def require_docker_network() -> None:
    """Fail the test, naming the fix, when the Docker network of the tests is not there."""
    try:
        out = _run(["docker", "network", "inspect", "-f", "{{range .IPAM.Config}}{{.Subnet}}{{end}}",
                    DOCKER_NETWORK], timeout=20)
        ok = out.returncode == 0 and out.stdout.strip() == DOCKER_SUBNET
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        pytest.fail(f"the Docker network {DOCKER_NETWORK} ({DOCKER_SUBNET}) is not there: run "
                    "`bash scripts/cluster/docker.sh` (scripts/test.sh does)", pytrace=False)


# --- Slurm ------------------------------------------------------------------------------------------

def slurm_env(base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """An environment (``base``, else this process's) whose Slurm commands use the multi-node cluster."""
    env = dict(os.environ if base is None else base)
    env["SLURM_CONF"] = SLURM_CONF
    return env


def program_env(**extra: str) -> Dict[str, str]:
    """The environment of a roving program started on a test host: this process's without roving's and
    Slurm's own variables, the multi-node cluster's SLURM_CONF, tests/ and src/ on PYTHONPATH, ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROVING_", "SLURM_"))}
    env["SLURM_CONF"] = SLURM_CONF
    env["PYTHONPATH"] = os.pathsep.join([str(SUPPORT_DIR), str(REPO / "src"), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


class Program:
    """A program started on a test host whose output (stdout and stderr, one text pipe) is read as it
    comes: :meth:`wait_for` a line it prints, :meth:`result` its ``RESULT <json>`` line at the end."""

    def __init__(self, h: HostLike, argv: Sequence[str], env: Dict[str, str], stdin: bool = False) -> None:
        self.proc = run_on(h, argv, env=env, cwd=str(REPO), text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)
        self.name = " ".join(Path(a).name for a in argv[1:3])
        self.output: List[str] = []

    def wait_for(self, prefix: str, timeout: float) -> object:
        """The JSON after ``prefix`` on the first line that starts with it; AssertionError with the output
        so far (and the program killed) when none comes within ``timeout`` seconds."""
        import select

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = self.proc.stdout.readline() if ready else ""
            if not line:
                break
            self.output.append(line)
            if line.startswith(prefix):
                return json.loads(line[len(prefix):])
        self.kill()
        raise AssertionError(f"{self.name}: no {prefix!r} line within {timeout} s:\n{self.text()[-4000:]}")

    def say(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def result(self, timeout: float) -> dict:
        """Its ``RESULT`` JSON, once it has ended; AssertionError with its output when it failed."""
        try:
            rest, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} did not end within {timeout} s:\n{self.text()[-4000:]}") from None
        self.output.append(rest)
        lines = [line for line in self.text().splitlines() if line.startswith("RESULT ")]
        if self.proc.returncode != 0 or not lines:
            raise AssertionError(f"{self.name} failed ({self.proc.returncode}):\n{self.text()[-4000:]}")
        return json.loads(lines[-1][len("RESULT "):])

    def text(self) -> str:
        return "".join(self.output)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.output.append(self.proc.communicate(timeout=30)[0] or "")
        except (ValueError, subprocess.TimeoutExpired):
            pass


def slurm(argv: Sequence[str], timeout: float = 60, check: bool = False, **kw) -> subprocess.CompletedProcess:
    """Run a Slurm command (srun, sbatch, scontrol, sinfo...) on the multi-node cluster, from the root host.

    Killed after ``timeout`` seconds (srun can hang after a node failure): then AssertionError with what
    it printed. ``check``: AssertionError with its output when it exits non-zero.
    """
    try:
        done = _run(argv, timeout=timeout, env=slurm_env(kw.pop("env", None)), **kw)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{' '.join(argv)} did not end within {timeout} s; it printed: "
                             f"{exc.stdout!r} {exc.stderr!r}") from None
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited with {done.returncode}: {done.stdout}{done.stderr}")
    return done


def node_states() -> Dict[str, str]:
    """Every node of the multi-node cluster and its state as sinfo's %t says it (``idle``, ``idle*`` for
    idle but not responding, ``down*``, ``mix``...)."""
    out = slurm(["sinfo", "-h", "-N", "-p", PARTITION, "-o", "%N %t"], timeout=10, check=True).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


def node_state(h: HostLike) -> str:
    """The Slurm state of host ``h``'s node, as :func:`node_states` gives it."""
    name = host(h).name
    return node_states().get(name, "missing")


def wait_node_state(h: HostLike, states: Iterable[str], timeout: float) -> str:
    """Wait until ``h``'s node is in one of ``states`` (sinfo's %t words); returns the state it is in.

    AssertionError after ``timeout`` seconds, with the last state seen and Slurm's view of the node.
    """
    name, wanted = host(h).name, set(states)
    deadline, state = time.monotonic() + timeout, None
    while True:
        try:
            state = node_state(name)
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            state = f"unknown ({exc})"
        if state in wanted:
            return state
        if time.monotonic() > deadline:
            shown = slurm(["scontrol", "show", "node", name], timeout=10).stdout
            raise AssertionError(f"Slurm node {name} is {state!r}, not one of {sorted(wanted)}, after {timeout} s:\n"
                                 f"{shown}")
        time.sleep(0.5)


# --- running things on a host ----------------------------------------------------------------------

def command_on(h: HostLike, argv: Sequence[str]) -> List[str]:
    """``argv`` as a command line that runs it inside host ``h``: its network namespace, its hostname."""
    h = host(h)
    if h.netns is None:
        return list(argv)
    # nsenter and unshare exec (no fork): the process started is the one running argv
    return ["nsenter", f"--net=/run/netns/{h.netns}", "unshare", "--uts", "sh", "-c",
            'hostname "$0" && exec "$@"', h.name, *argv]


def run_on(h: HostLike, argv: Sequence[str], **popen_kw) -> subprocess.Popen:
    """Start ``argv`` on host ``h`` (the root host: as it is); an ordinary Popen, pid that of argv."""
    return subprocess.Popen(command_on(h, argv), **popen_kw)


def call_on(h: HostLike, argv: Sequence[str], timeout: float = TIMEOUT, check: bool = True,
            **kw) -> subprocess.CompletedProcess:
    """Run ``argv`` on host ``h`` to its end (text output captured); AssertionError with its output when
    it exits non-zero (``check``) or is still running after ``timeout`` seconds (it is killed then)."""
    argv = command_on(h, argv)
    try:
        done = _run(argv, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{argv[-1]!r} on {host(h).name} did not end within {timeout} s: "
                             f"{exc.stdout!r} {exc.stderr!r}") from None
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited with {done.returncode}: {done.stdout}{done.stderr}")
    return done


def python_on(h: HostLike, code: str, *args: str, timeout: float = TIMEOUT, **kw) -> subprocess.CompletedProcess:
    """Run this Python (``sys.executable -c code args...``) on host ``h``; as :func:`call_on`."""
    return call_on(h, [sys.executable, "-c", code, *args], timeout=timeout, **kw)


def pids(h: HostLike) -> List[int]:
    """The processes living in host ``h``'s network namespace."""
    out = _run(["ip", "netns", "pids", host(h).netns], timeout=10).stdout
    return [int(p) for p in out.split()]


def daemon_pids(h: HostLike, name: str) -> List[int]:
    """The processes called ``name`` (``slurmd``, ``slurmctld``) in host ``h``."""
    found = []
    for pid in pids(h):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == name:
                    found.append(pid)
        except OSError:
            pass
    return found


# --- faults -------------------------------------------------------------------------------------------

_disturbed: Set[str] = set()


def _link(h: Host, state: str) -> None:
    if h.netns is None:
        raise ValueError("the root host has no link of its own to cut (cut the other hosts instead)")
    done = _run(["ip", "link", "set", "dev", h.link, state], timeout=10)
    if done.returncode != 0:
        raise AssertionError(f"ip link set {h.link} {state} failed: {done.stderr.strip()}")


def cut(h: HostLike) -> None:
    """Partition host ``h``: its link to the bridge goes down. Its processes live on and see no error at
    once; what they send is lost (a silent network partition) until :func:`restore`."""
    h = host(h)
    _disturbed.add(h.name)
    _link(h, "down")


def restore(h: HostLike, timeout: float = 10) -> None:
    """Bring host ``h``'s link up again, and wait (``timeout``) until the host sees it up."""
    h = host(h)
    _link(h, "up")
    deadline = time.monotonic() + timeout
    while "LOWER_UP" not in _run(["ip", "-n", h.netns, "-o", "link", "show", "dev", "eth0"], timeout=10).stdout:
        if time.monotonic() > deadline:
            raise AssertionError(f"{h.name}'s eth0 is not up {timeout} s after its link {h.link} was")
        time.sleep(0.05)


def kill_host(h: HostLike, timeout: float = 10) -> None:
    """Kill every process in host ``h`` (its slurmd or slurmctld, Slurm jobs, whatever runs there) with
    SIGKILL, as if the machine had stopped; returns when none is left (AssertionError after ``timeout``)."""
    h = host(h)
    if h.netns is None:
        raise ValueError("the root host runs the tests: it cannot be killed")
    _disturbed.add(h.name)
    deadline = time.monotonic() + timeout
    while True:
        left = pids(h)
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"processes {left} in {h.name} still live {timeout} s after SIGKILL")
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def revive(h: HostLike, timeout: float = 120) -> None:
    """Bring host ``h`` back to service: its link up, its daemon started again, its node resumed and
    idle (hosts.sh does it for that host alone). AssertionError with hosts.sh's output on failure."""
    h = host(h)
    try:
        done = _run(["bash", str(HOSTS_SH), h.name], timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"hosts.sh {h.name} did not end within {timeout} s: "
                             f"{exc.stdout!r} {exc.stderr!r}") from exc
    if done.returncode != 0:
        raise AssertionError(f"hosts.sh {h.name} failed ({done.returncode}): {done.stdout}{done.stderr}")
    _disturbed.discard(h.name)


def mend(timeout: float = 180) -> None:
    """Every host a test cut or killed starts afresh: what still runs in it is killed, then hosts.sh
    brings it back (link up, daemon restarted, node resumed and idle)."""
    names = sorted(_disturbed)
    if not names:
        return
    for name in names:
        kill_host(name)
    try:
        done = _run(["bash", str(HOSTS_SH), *names], timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"hosts.sh {' '.join(names)} did not end within {timeout} s: {exc.stdout!r}") from exc
    if done.returncode != 0:
        raise AssertionError(f"hosts.sh could not mend {names} ({done.returncode}): {done.stdout}{done.stderr}")
    _disturbed.clear()


@pytest.fixture
def hosts():
    """Requires the test hosts (fails, naming hosts.sh, when they are not there); afterwards, even when
    the test failed, every host the test cut or killed is mended (:func:`mend`). Gives this module."""
    require()
    _disturbed.clear()
    try:
        yield sys.modules[__name__]
    finally:
        mend()


def docker_network_options() -> Dict[str, object]:
    """roving options for the docker backend with containers on :data:`DOCKER_NETWORK` (own addresses)."""
    import helpers_backends

    return {**helpers_backends.docker_options(), "docker_network": DOCKER_NETWORK}
