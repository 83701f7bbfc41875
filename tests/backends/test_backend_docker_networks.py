"""The docker backend on Docker networks made the way Docker's own documentation makes them, on the real
engine of scripts/cluster/docker.sh: one with ``--subnet`` only (Docker 20.10 then reports no gateway in the
network's IPAM config, though its bridge holds the subnet's first address) and one with no options at all.
This module makes both networks and removes them (names and subnet in scripts/cluster/hosts.env); traffic
goes only to them."""
from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
from pathlib import Path

import pytest

import helpers_backends as hb
import helpers_hosts as hh
import roving
from roving import backends
from roving.backends.docker import interface_address, network_gateway

SUBNET_ONLY = hh.ENV["DOCKER_SUBNET_ONLY_NETWORK"]
SUBNET = hh.ENV["DOCKER_SUBNET_ONLY_SUBNET"]
PLAIN = hh.ENV["DOCKER_PLAIN_NETWORK"]
PROGRAM = Path(__file__).resolve().parents[1] / "support" / "programs" / "docker_network_program.py"


def _docker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=60)


def _inspect(name: str) -> dict:
    done = _docker("network", "inspect", name)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)[0]


@pytest.fixture(scope="module")
def networks():
    hb.require("docker")
    for name in (SUBNET_ONLY, PLAIN):
        _docker("network", "rm", name)  # one left by an interrupted run
    made = [_docker("network", "create", "--driver", "bridge", "--subnet", SUBNET, SUBNET_ONLY),
            _docker("network", "create", PLAIN)]
    try:
        for done in made:
            assert done.returncode == 0, f"docker network create failed: {done.stderr.strip()}"
        yield {SUBNET_ONLY: _inspect(SUBNET_ONLY), PLAIN: _inspect(PLAIN)}
    finally:
        for name in (SUBNET_ONLY, PLAIN):
            _docker("network", "rm", name)


def test_a_network_made_with_subnet_only_reports_no_gateway_and_roving_finds_its_bridge_address(networks):
    attrs = networks[SUBNET_ONLY]
    # what made the old code refuse it: no Gateway in the IPAM config
    assert [entry.get("Gateway") for entry in attrs["IPAM"]["Config"]] == [None]
    bridge = f"br-{attrs['Id'][:12]}"
    first = str(next(ipaddress.ip_network(SUBNET).hosts()))
    assert interface_address(bridge) == first  # the bridge holds the subnet's first address
    roving.init(backend="docker", docker_network=SUBNET_ONLY)
    address, why = backends.get("docker").towards()
    assert address == first and bridge in why


def test_a_network_made_with_no_options_uses_the_gateway_docker_reports(networks):
    attrs = networks[PLAIN]
    (gateway,) = [entry["Gateway"] for entry in attrs["IPAM"]["Config"]]
    roving.init(backend="docker", docker_network=PLAIN)
    assert backends.get("docker").towards() == (gateway, f"the gateway of Docker network {PLAIN} ({gateway})")


def test_with_no_gateway_and_no_bridge_found_the_subnets_first_host_is_taken():
    attrs = {"Id": "0" * 64, "Options": {"com.docker.network.bridge.name": "rv-no-such-if"},
             "IPAM": {"Config": [{"Subnet": "fd00::/64"}, {"Subnet": "10.79.9.0/24"}]}}
    address, why = network_gateway("far", attrs)
    assert address == "10.79.9.1" and "no gateway reported" in why
    assert network_gateway("v6-only", {"Id": "0" * 64, "IPAM": {"Config": [{"Subnet": "fd00::/64"}]}}) is None


def test_a_network_with_no_ipv4_subnet_is_refused_naming_the_options_to_set(networks, monkeypatch):
    roving.init(backend="docker", docker_network=PLAIN)
    backend = backends.get("docker")
    real = backend.client().networks.get(PLAIN)
    real.attrs["IPAM"]["Config"] = [{"Subnet": "fd00::/64"}]
    monkeypatch.setattr(type(backend.client().networks), "get", lambda self, name: real)
    with pytest.raises(OSError, match=rf"{PLAIN}.*no IPv4 subnet.*host= and advertise="):
        backend.towards()


def test_a_program_on_a_subnet_only_network_runs_its_pool_and_a_child_owned_queue(networks):
    options = {"backend": "docker", **hb.docker_options(), "docker_network": SUBNET_ONLY}
    done = subprocess.run([sys.executable, str(PROGRAM), json.dumps(options)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"the program failed:\n{done.stdout}\n{done.stderr}"
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    subnet = ipaddress.ip_network(SUBNET)
    first = str(next(subnet.hosts()))
    assert seen["advertised"] == first  # the parent listens where the containers reach it
    assert [sq for _, _, sq in seen["results"]] == [x * x for x in range(6)]
    worker_addresses = {address for _, address, _ in seen["results"]}
    assert worker_addresses and all(ipaddress.ip_address(a) in subnet and a != first for a in worker_addresses)
    said, _, child_address = seen["child"]
    assert said == "from the child's own queue"
    assert ipaddress.ip_address(child_address) in subnet and child_address != first
    assert seen["child_exitcode"] == 0
