"""The test hosts of scripts/cluster/hosts.sh and the Docker network of docker.sh: each host is a machine
of its own on one subnet (address, hostname, loopback), the multi-node Slurm places tasks on them and
notices a host cut off, and a first roving Pool spans them."""
from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys

import pytest

import helpers_backends as hb
import helpers_hosts as hh
from helpers_core import PROGRAMS
from helpers_hosts import hosts  # noqa: F401  (fixture)

ADDRESSES = """
import json, socket, subprocess
out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
print(json.dumps({"hostname": socket.gethostname(),
                  "addresses": sorted((f.split()[1], f.split()[3]) for f in out.splitlines())}))
"""

# A listener on the given address that answers every connection with its hostname, until stdin closes.
NAME_SERVER = """
import socket, sys, threading
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
def answer():
    while True:
        conn, _ = server.accept()
        with conn:
            conn.sendall(socket.gethostname().encode())
threading.Thread(target=answer, daemon=True).start()
sys.stdin.read()
"""

# Connect to every "address:port" given and say which hostname answered (or the error).
ASK_NAMES = """
import json, socket, sys
seen = {}
for target in sys.argv[1:]:
    address, port = target.rsplit(":", 1)
    try:
        with socket.create_connection((address, int(port)), timeout=5) as c:
            c.settimeout(5)
            seen[target] = c.recv(100).decode()
    except OSError as exc:
        seen[target] = type(exc).__name__
print(json.dumps(seen))
"""


def test_each_host_has_its_own_address_and_hostname_and_nothing_else(hosts):
    for h in hh.HOSTS.values():
        seen = json.loads(hh.python_on(h, ADDRESSES).stdout)
        assert seen == {"hostname": h.name, "addresses": [["eth0", f"{h.address}/24"], ["lo", "127.0.0.1/8"]]}, h
        # no default route: a host reaches the test subnet and nothing beyond it
        routes = hh.call_on(h, ["ip", "-4", "route"]).stdout.strip()
        assert routes.startswith(f"{hh.SUBNET} dev eth0") and len(routes.splitlines()) == 1, routes


def test_every_host_reaches_every_other_and_the_root_host_but_never_another_hosts_loopback(hosts):
    everyone = [hh.ROOT, *hh.HOSTS.values()]
    servers, targets = [], {}
    try:
        for h in everyone:
            p = hh.run_on(h, [sys.executable, "-c", NAME_SERVER, h.address], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
            servers.append(p)
            targets[f"{h.address}:{p.stdout.readline().strip()}"] = h.name
        # one more listener, on the root host's loopback: no other host may reach it
        lo = hh.run_on(hh.ROOT, [sys.executable, "-c", NAME_SERVER, "127.0.0.1"], stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, text=True)
        servers.append(lo)
        loopback = f"127.0.0.1:{lo.stdout.readline().strip()}"
        for h in everyone:
            seen = json.loads(hh.python_on(h, ASK_NAMES, *targets, loopback).stdout)
            assert {t: seen[t] for t in targets} == targets, (h.name, seen)
            if h is hh.ROOT:
                assert seen[loopback] == hh.ROOT.name
            else:
                assert seen[loopback] == "ConnectionRefusedError", (h.name, seen)  # its own loopback
    finally:
        for p in servers:
            p.kill()
            p.wait(10)
            p.stdout.close()
            p.stdin.close()


def test_the_hosts_share_one_filesystem(hosts, tmp_path):
    # what hosts.sh cannot separate: a file one host writes, every host (and the root) reads
    path = tmp_path / "written-on-h1"
    hh.python_on(hh.COMPUTE[0], "import socket, sys; open(sys.argv[1], 'w').write(socket.gethostname())", str(path))
    assert path.read_text() == hh.COMPUTE[0].name
    assert hh.python_on(hh.COMPUTE[1], "import sys; print(open(sys.argv[1]).read())", str(path)).stdout.strip() \
        == hh.COMPUTE[0].name


def test_the_jobs_of_each_compute_host_have_a_dev_shm_of_their_own(hosts, tmp_path):
    name = f"rv-probe-{os.getpid()}"
    write = f"open('/dev/shm/{name}', 'w').write('x')"
    hh.slurm(["srun", "-w", hh.COMPUTE[0].name, sys.executable, "-c", write], timeout=60, check=True)
    try:
        look = f"import os; print(os.path.exists('/dev/shm/{name}'))"
        seen = {h.name: hh.slurm(["srun", "-w", h.name, sys.executable, "-c", look], timeout=60,
                                 check=True).stdout.strip() for h in hh.COMPUTE}
        assert seen == {h.name: str(h is hh.COMPUTE[0]) for h in hh.COMPUTE}
        assert not os.path.exists(f"/dev/shm/{name}")  # nor does the root host see it
    finally:
        hh.slurm(["srun", "-w", hh.COMPUTE[0].name, "rm", "-f", f"/dev/shm/{name}"], timeout=60)


def test_srun_on_three_nodes_runs_one_task_per_compute_host_with_its_own_name_and_address(hosts):
    done = hh.slurm(["srun", "-N3", "--ntasks-per-node=1", sys.executable, "-c", ADDRESSES], timeout=60, check=True)
    seen = sorted((json.loads(line) for line in done.stdout.splitlines()), key=lambda s: s["hostname"])
    assert seen == [{"hostname": h.name, "addresses": [["eth0", f"{h.address}/24"], ["lo", "127.0.0.1/8"]]}
                    for h in sorted(hh.COMPUTE, key=lambda h: h.name)]


def test_a_cut_host_goes_not_responding_then_down_and_back_to_idle_when_restored_its_processes_alive(hosts):
    h = hh.COMPUTE[-1]
    sleeper = hh.run_on(h, ["sleep", "600"])
    try:
        hh.cut(h)
        # SlurmdTimeout=10: "not responding" (the *) after some seconds, DOWN a few seconds later
        hh.wait_node_state(h, ["idle*", "down*"], timeout=60)
        hh.wait_node_state(h, ["down*"], timeout=60)
        assert sleeper.poll() is None, "a cut host's processes live on"
        hh.restore(h)
        # ReturnToService=2: the node takes jobs again once its slurmd answers, with no one resuming it
        hh.wait_node_state(h, hh.READY, timeout=120)
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait(10)


def test_a_killed_host_loses_every_process_and_is_marked_down_then_revive_brings_it_back(hosts):
    h = hh.COMPUTE[0]
    sleeper = hh.run_on(h, ["sleep", "600"])
    assert hh.daemon_pids(h, "slurmd") and sleeper.pid in hh.pids(h)
    hh.kill_host(h)
    assert sleeper.wait(10) == -9 and hh.pids(h) == []
    hh.wait_node_state(h, ["down*"], timeout=60)
    hh.revive(h)
    assert hh.node_state(h) in hh.READY and len(hh.daemon_pids(h, "slurmd")) == 1
    done = hh.slurm(["srun", "-N1", f"--nodelist={h.name}", "hostname"], timeout=60, check=True)
    assert done.stdout.strip() == h.name


def test_a_container_on_the_docker_network_has_its_own_address_and_reaches_the_host_at_the_gateway():
    hb.require("docker")
    hh.require_docker_network()
    probe = ("import socket, sys; c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10); "
             "c.sendall(socket.gethostbyname(socket.gethostname()).encode()); c.close()")
    mounts = [a for v in hb.docker_options()["docker_volumes"] for a in ("-v", v)]
    with socket.create_server((hh.DOCKER_GATEWAY, 0)) as server:
        server.settimeout(60)
        port = server.getsockname()[1]
        run = subprocess.Popen(["docker", "run", "--rm", "--network", hh.DOCKER_NETWORK, *mounts, hb.DOCKER_IMAGE,
                                sys.executable, "-c", probe, hh.DOCKER_GATEWAY, str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            conn, (peer, _) = server.accept()
            with conn:
                conn.settimeout(10)
                said = conn.recv(100).decode()
            out, _ = run.communicate(timeout=60)
        finally:
            if run.poll() is None:
                run.kill()
                run.communicate()
    assert run.returncode == 0, out
    subnet = ipaddress.ip_network(hh.DOCKER_SUBNET)
    assert said == peer and ipaddress.ip_address(peer) in subnet and peer != hh.DOCKER_GATEWAY


def run_pool(parent: hh.Host, options: dict, n: int, env=None) -> dict:
    """tests/support/programs/hosts_pool.py as the parent, on host ``parent``: what ran where."""
    program = str(PROGRAMS / "hosts_pool.py")
    done = hh.call_on(parent, [sys.executable, program, json.dumps(options), str(n)], timeout=240, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("parent", [hh.ROOT, hh.LOGIN], ids=["parent-on-root-host", "parent-on-login-host"])
def test_a_pool_on_the_multi_node_slurm_runs_one_worker_on_each_compute_host(hosts, parent):
    # Nothing set about addresses: the parent finds its host's address itself (host=auto: the interface
    # towards the Slurm controller); the workers are Slurm jobs, one per compute host (--exclusive: a worker
    # has a node to itself). The parent is a program of its own: this test process's roving endpoint may
    # already be bound to loopback by an earlier test.
    seen = run_pool(parent, {"backend": "slurm", "slurm_options": "--exclusive"}, 3, env=hh.slurm_env())
    assert seen["parent"] == parent.name
    assert sorted((name, address) for name, address, _ in seen["met"]) == sorted((h.name, h.address)
                                                                                 for h in hh.COMPUTE)
    assert [sq for _, _, sq in seen["met"]] == [0, 1, 4]
    assert [sq for _, _, sq in seen["results"]] == [x * x for x in range(12)]
    assert {(name, address) for name, address, _ in seen["results"]} <= {(h.name, h.address) for h in hh.COMPUTE}


def test_a_pool_on_the_docker_network_runs_its_workers_in_containers_with_their_own_addresses():
    hb.require("docker")
    hh.require_docker_network()
    # nothing set about addresses: the parent listens on the network's gateway (host=auto), the address of
    # this machine that the containers reach, and each container on its own address
    seen = run_pool(hh.ROOT, {"backend": "docker", **hh.docker_network_options()}, 2)
    subnet = ipaddress.ip_network(hh.DOCKER_SUBNET)
    met = {address for _, address, _ in seen["met"]}
    assert len(met) == 2 and all(ipaddress.ip_address(a) in subnet and a != hh.DOCKER_GATEWAY for a in met)
    assert [sq for _, _, sq in seen["met"]] == [0, 1]
    assert [sq for _, _, sq in seen["results"]] == [x * x for x in range(8)]
    assert {address for _, address, _ in seen["results"]} <= met


def test_missing_hosts_fail_the_test_naming_the_script_never_skip(monkeypatch):
    monkeypatch.setattr(hh, "BRIDGE", "rv-missing")
    monkeypatch.setattr(hh, "HOSTS", {"rv-gone": hh.Host("rv-gone", "10.77.0.99", "rv-gone")})
    with pytest.raises(pytest.fail.Exception, match=r"rv-missing .*rv-gone.*bash scripts/cluster/hosts.sh"):
        hh.require()


def test_a_large_array_crosses_hosts_whole_through_a_pool_a_queue_and_shared_with_the_parents_peak_about_twice(
        hosts):
    # the parent on the root host, its workers Slurm jobs on the compute hosts: every transfer leaves the
    # machine (TLS between hosts) and shared data is fetched by the worker's host from the parent
    program = str(PROGRAMS / "large_objects.py")
    done = hh.call_on(hh.ROOT, [sys.executable, program, json.dumps({"backend": "slurm"}), "192.5", "pool", "queue",
                                "shared"], timeout=600, env=hh.slurm_env())
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    compute = {h.name for h in hh.COMPUTE}
    for path, got in seen["paths"].items():
        assert got["same"] and got["host"] in compute, (path, got)
        assert got["peak_over"] <= 2.5 * got["bytes"], (path, got["peak_over"] / got["bytes"])
