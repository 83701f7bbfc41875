"""Each process chooses its own address (transport/addressing.py), and one that cannot reach its parent
fails fast, naming the address: the choice's rules, port_range, `roving info`, a child that does not
inherit its parent's address, and Process/Pool giving up on children that never connect.

Across real separate hosts (network namespaces, multi-node Slurm, a Docker network) the same is tested
in test_many_hosts.py; here everything is on this machine.
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys

import pytest

import roving
from helpers_core import TIMEOUT, read_log, run_script, PROGRAMS
from roving.transport import addressing, node as _node, stream as _stream
from roving.transport.session import current as session


def own_address() -> str:
    """This machine's address on its default route (a route lookup: nothing is sent)."""
    addr = addressing.route_to("192.0.2.1")
    assert not addressing.is_loopback(addr), "the test machine needs a non-loopback interface"
    return addr


# -- the choice ------------------------------------------------------------------------------------

def test_auto_is_loopback_when_every_job_runs_on_this_machine():
    choice = addressing.choose("auto", "auto", None, roving.config.load(environ={}))
    assert (choice.bind, choice.advertise) == ("127.0.0.1", "127.0.0.1")
    assert "loopback" in choice.why and "host=auto" in choice.why


def test_a_child_binds_the_interface_towards_its_parent():
    assert addressing.choose("auto", "auto", "tcp://127.0.0.1:5000").bind == "127.0.0.1"
    mine = own_address()
    choice = addressing.choose("auto", "auto", f"tcp://{mine}:5000")
    assert (choice.bind, choice.advertise) == (mine, mine)
    assert f"towards its parent at {mine}" in choice.why


def test_a_parent_binds_the_interface_towards_its_cluster(monkeypatch):
    mine = own_address()
    monkeypatch.setattr(addressing, "_cluster_route", lambda cfg: (mine, "the test's cluster"))
    choice = addressing.choose("auto", "auto", None, object())
    assert (choice.bind, choice.advertise) == (mine, mine) and "the test's cluster" in choice.why


def test_explicit_options_win_and_a_wildcard_advertises_a_reachable_address():
    assert addressing.choose("127.0.0.1", "auto", f"tcp://{own_address()}:1").bind == "127.0.0.1"
    both = addressing.choose("127.0.0.1", "gateway.example", None)
    assert (both.bind, both.advertise) == ("127.0.0.1", "gateway.example")
    wild = addressing.choose("0.0.0.0", "auto", "tcp://127.0.0.1:1")
    assert (wild.bind, wild.advertise) == ("0.0.0.0", "127.0.0.1")
    wild = addressing.choose("0.0.0.0", None, None, roving.config.load(environ={}))
    assert wild.bind == "0.0.0.0" and not addressing.is_loopback(wild.advertise)


def test_a_name_that_does_not_resolve_is_an_error_naming_it_and_the_options():
    with pytest.raises(addressing.AddressError, match=r"no-such-host\.invalid.*host= and advertise="):
        addressing.choose("auto", "auto", "tcp://no-such-host.invalid:5000")


def test_slurm_auto_looks_towards_the_controller():
    roving.init(backend="slurm")
    choice = session().address()
    # the single-node test cluster's controller is on 127.0.0.1 (SlurmctldHost=vm(127.0.0.1))
    assert "the Slurm controller at 127.0.0.1" in choice.why and choice.bind == "127.0.0.1"


def test_docker_auto_looks_towards_a_remote_engines_host_or_a_networks_gateway():
    from roving import backends

    roving.init(backend="docker", docker_url="tcp://10.77.0.11:2376")
    assert backends.get("docker").towards() == ("10.77.0.11", "the Docker engine's host 10.77.0.11")
    roving.init(docker_url="unix:///var/run/docker.sock", docker_network="host")
    assert backends.get("docker").towards() is None  # containers share this machine's network
    roving.init(docker_network="no-such-network")
    with pytest.raises(OSError, match="docker_network='no-such-network': the engine does not know it"):
        backends.get("docker").towards()


# -- port_range ------------------------------------------------------------------------------------

def _free_range(width: int) -> tuple:
    """A range of ``width`` ports nothing listens on now (found by binding them)."""
    for low in range(41000, 60000, 97):
        socks = []
        try:
            for port in range(low, low + width):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                socks.append(s)
            return low, low + width - 1
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free port range found")


def test_port_range_confines_the_node_and_its_stream_listener():
    low, high = _free_range(6)
    node = _node.Node(b"k" * 32, "127.0.0.1", None, (low, high))
    try:
        port = int(node.address.partition("#")[0].rsplit(":", 1)[1])
        listener_port = int(node.streams().address.rsplit(":", 1)[1])
        assert low <= port <= high and low <= listener_port <= high and port != listener_port
    finally:
        node.close()


def test_a_full_port_range_is_an_error_naming_it():
    low, high = _free_range(1)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", low))
    blocker.listen()
    try:
        with pytest.raises(addressing.AddressError, match=f"port_range={low}-{high}"):
            _node.Node(b"k" * 32, "127.0.0.1", None, (low, high))
        with pytest.raises(addressing.AddressError, match=f"port_range={low}-{high}"):
            _stream.Listener(b"k" * 32, "127.0.0.1", None, lambda r, s: False, (low, high))
    finally:
        blocker.close()


@pytest.mark.parametrize("bad", ["80-70", "x-y", "0-10", "70000"])
def test_a_bad_port_range_is_a_config_error(bad):
    with pytest.raises(roving.ConfigError, match=f"bad value '{bad}' for roving option 'port_range'"):
        roving.init(port_range=bad)


def test_an_address_that_is_not_this_machines_is_an_error_naming_it():
    with pytest.raises(addressing.AddressError, match=r"cannot listen on 192\.0\.2\.77"):
        _node.Node(b"k" * 32, "192.0.2.77")


def test_roving_info_says_what_auto_chose_and_why():
    r = subprocess.run([sys.executable, "-m", "roving.cli", "info"], capture_output=True, text=True,
                       timeout=60, env={"PATH": "/usr/bin:/bin", "ROVING_PORT_RANGE": "50000-50100",
                                        "PYTHONPATH": ":".join(sys.path)})
    assert r.returncode == 0, r.stderr
    assert ("address: binds 127.0.0.1, advertises 127.0.0.1 (host=auto: loopback: every process of this "
            "backend runs on this machine); ports: 50000-50100") in r.stdout


# -- children choose their own; fail fast (each case a fresh parent: tests/support/programs/addressing_prog.py) --

def run_parent(mode, log_dir=""):
    r = run_script(PROGRAMS / "addressing_prog.py", mode, log_dir, timeout=180)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def test_a_child_does_not_inherit_its_parents_address():
    seen = run_parent("inherit")  # the parent: host=127.0.0.1, advertise=localhost, both its own
    assert seen["parent_queue"].startswith("tcp://localhost:")
    assert (seen["host"], seen["advertise"]) == ("auto", "auto")
    # the child routed towards its parent (loopback here) and advertises what it bound, not "localhost"
    assert seen["child_queue"].startswith("tcp://127.0.0.1:")


def test_a_wildcard_host_is_kept_by_children():
    seen = run_parent("wildcard")
    assert (seen["host"], seen["advertise"]) == ("0.0.0.0", "auto")


def test_a_child_that_cannot_reach_its_parent_says_where_and_join_raises(tmp_path):
    seen = run_parent("stranded", tmp_path)
    assert seen["exitcode"] == 1 and seen["seconds"] < TIMEOUT
    assert re.match(r"stranded exited with code 1 before it fetched its work from this process at "
                    r"tcp://127\.0\.0\.2:\d+(#\S+)? \(chosen by .*advertise=127\.0\.0\.2 \(set\)\)", seen["error"])
    said = read_log(tmp_path, "stranded")
    assert "could not reach its parent at tcp://127.0.0.2:" in said and "connect_timeout=2 s" in said
    assert "advertise=127.0.0.2 (set)" in said and "set the roving options host= and advertise=" in said


def test_a_pool_whose_workers_never_connect_gives_up_and_the_map_in_progress_raises(tmp_path):
    seen = run_parent("pool", tmp_path)
    assert re.match(r"roving pool: 3 workers in a row failed to start and none connected.*"
                    r"tcp://127\.0\.0\.2:", seen["error"])
    assert seen["failures"] >= 3 and seen["later"] == "PoolStartError"


def test_pool_start_failures_must_be_at_least_one():
    with pytest.raises(roving.ConfigError, match="pool_start_failures"):
        roving.init(pool_start_failures=0)
