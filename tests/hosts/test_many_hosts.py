"""roving across separate hosts: the parent on one test host, its children on the others.

The hosts are network namespaces with their own addresses and hostnames, joined by a bridge, with a
multi-node Slurm on them (scripts/cluster/hosts.sh; tests/support/helpers_hosts.py). Each test runs a fresh
roving program (tests/support/programs/across_hosts.py) on the login host with nothing set about addresses:
``host``/``advertise`` stay ``auto``, and every process must find its own. Children run as Slurm jobs
on the compute hosts, and what they report names the host they ran on.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

import helpers_hosts as hh
from helpers_core import PROGRAMS, ROOT
from helpers_hosts import hosts  # noqa: F401  (fixture)

PROGRAM = PROGRAMS / "across_hosts.py"
COMPUTE = [h.name for h in hh.COMPUTE]
ADDRESSES = {h.name: h.address for h in hh.COMPUTE}


def program_env(**extra):
    return hh.program_env(ACROSS_PARTITION=hh.PARTITION, ACROSS_COMPUTE=",".join(COMPUTE), **extra)


def start(name, **extra):
    """Scenario ``name`` of across_hosts.py, started on the login host."""
    return hh.Program(hh.LOGIN, [sys.executable, "-u", str(PROGRAM), name], program_env(**extra))


def run_scenario(name, timeout=240, **extra):
    """Run a scenario of across_hosts.py on the login host; its result (a dict) and its whole output."""
    run = start(name, **extra)
    result = run.result(timeout)
    # nothing was set: the parent chose the login host's own address, towards the Slurm controller
    assert result["parent_address"].startswith(f"tcp://{hh.LOGIN.address}:"), result
    assert f"the Slurm controller at {hh.HEAD.address}" in result["parent_why"]
    return result, run.text()


@pytest.fixture(autouse=True)
def _hosts(hosts):
    yield hosts


def test_pool_every_flavour_across_hosts():
    r, _ = run_scenario("pool")
    for key in ("map", "imap", "imap_unordered", "starmap", "map_async_callback", "after_grow",
                "after_shrink", "autoscale"):
        assert r[key] is True, (key, r)
    assert r["remote_error"].startswith("three on rv-h") and r["error_callback"] == ["ValueError"]
    assert set(r["hosts"]) <= set(COMPUTE) and len(r["hosts"]) >= 2, r["hosts"]


def test_processes_on_three_hosts_advertise_their_own_addresses_and_their_output_arrives():
    r, output = run_scenario("process")
    seen = {c["host"]: c["address"] for c in r["children"]}
    assert sorted(seen) == sorted(COMPUTE)
    for host, address in seen.items():
        assert address.startswith(f"tcp://{ADDRESSES[host]}:"), (host, address)
    assert r["exitcodes"] == [0, 1, 2] and r["terminated"] == -15
    for i, host in enumerate(COMPUTE, 1):  # each child's line, on the parent's terminal, with its name
        assert f"[Process-{i}] line from {host}" in output, output


@pytest.mark.parametrize("kind", ["queue", "joinable"])
def test_a_queue_owned_by_a_child_on_one_host_is_used_by_children_on_two_others(kind):
    r, _ = run_scenario(kind)
    assert r["owner"] == COMPUTE[0] and r["address"].startswith(f"tcp://{ADDRESSES[COMPUTE[0]]}:")
    assert r["got"] == [[1, COMPUTE[1]], [2, COMPUTE[2]]] and r["exitcodes"] == [0, 0, 0]


def test_a_pipe_between_children_on_two_hosts():
    r, output = run_scenario("pipe")
    (tag, ((hello, sender), total, echoer)) = r["got"]
    assert (tag, hello, sender, echoer) == ("first got", "hello from", COMPUTE[1], COMPUTE[2])
    assert total == float(sum(range(1 << 20)))
    assert r["exitcodes"] == [0, 0]
    assert "using ZeroMQ" not in output, "the pipe's ends should have talked over a direct stream"


def test_manager_proxies_used_from_two_other_hosts():
    r, _ = run_scenario("manager")
    assert r["address"].startswith(f"tcp://{ADDRESSES[COMPUTE[0]]}:")
    assert r["dict"] == {COMPUTE[1]: 1, COMPUTE[2]: 2} and r["list"] == sorted(COMPUTE[1:3])


def test_lock_event_barrier_and_value_across_three_hosts():
    r, _ = run_scenario("sync")
    assert r["value"] == 150 and r["hosts"] == sorted(COMPUTE) and r["exitcodes"] == [0, 0, 0]


# -- faults across hosts ------------------------------------------------------------------------------

def run_chaos(hosts, disturb, **extra):
    """The chaos scenario: once under way, ``disturb(host)`` one host that holds a worker; its result."""
    run = start("chaos", **extra)
    try:
        before = run.wait_for("STARTED ", 120)
        victim = sorted(before)[0]
        disturb(victim)
        result = run.result(240)
    finally:
        run.kill()
    return victim, result, run.text()


_CHAOS = dict(ROVING_POOL_HEARTBEAT_TIMEOUT="4", ROVING_CONNECT_TIMEOUT="8")


def test_a_host_cut_off_for_good_mid_map_loses_its_workers_and_no_result(hosts):
    victim, r, output = run_chaos(hosts, hosts.cut, **_CHAOS)
    assert r["ok"] is True and r["count"] == 400, output[-3000:]
    assert "sent no heartbeat" in output or "cannot be reached" in output, output[-3000:]
    assert victim not in r["late_hosts"] and r["late_hosts"], (victim, r)


def test_a_host_cut_off_briefly_reconnects_and_nothing_is_lost_or_doubled(hosts):
    import time

    def blip(host):
        hosts.cut(host)
        time.sleep(2.0)
        hosts.restore(host)

    victim, r, output = run_chaos(hosts, blip, ROVING_POOL_HEARTBEAT_TIMEOUT="30")
    assert r["ok"] is True and r["count"] == 400, output[-3000:]
    assert "sent no heartbeat" not in output and "is killed" not in output, output[-3000:]
    assert victim in r["late_hosts"], (victim, r)  # its worker lived on and went on working


def test_a_host_killed_whole_is_marked_down_by_slurm_and_the_pool_carries_on(hosts):
    victim, r, output = run_chaos(hosts, hosts.kill_host, **_CHAOS)
    assert r["ok"] is True and r["count"] == 400, output[-3000:]
    assert victim not in r["late_hosts"], (victim, r)
    assert hosts.wait_node_state(victim, ("down", "down*", "idle*", "down~"), 60).startswith(("down", "idle*"))


def test_children_exit_when_their_parents_host_is_cut_off_and_leave_no_slurm_job(hosts):
    import time

    run = start("orphans", ROVING_PARENT_TIMEOUT="3")
    try:
        ready = run.wait_for("READY ", 120)
        assert len(ready["jobs"]) == 3
        hosts.cut(hh.LOGIN)
        deadline = time.monotonic() + 30
        left = ready["jobs"]
        while left and time.monotonic() < deadline:
            out = hosts.slurm(["squeue", "-h", "-o", "%i", "-j", ",".join(ready["jobs"])]).stdout.split()
            left = [j for j in ready["jobs"] if j in out]
            time.sleep(0.5)
        assert not left, f"Slurm jobs {left} still there 30 s after their parent's host was cut off"
    finally:
        run.kill()


def test_shared_data_is_written_once_per_host_and_read_there_by_every_worker():
    r, _ = run_scenario("shared")
    hosts = r["hosts"]
    assert sorted(hosts) == sorted(COMPUTE), hosts
    for host, seen in hosts.items():
        assert seen["sums_ok"], host
        # one copy on each host (one file, one inode), mapped by every worker that read it there
        assert len(seen["maps"]) == 1 and seen["maps"][0][0].endswith("-copy"), (host, seen)
    # each host's /dev/shm is its own (hosts.sh mounts one per host): three copies, one per machine
    assert len({d for seen in hosts.values() for d in seen["devs"]}) == 3, hosts
    assert max(seen["workers"] for seen in hosts.values()) >= 2, hosts


def test_pipeline_training_plans_around_a_host_cut_off_mid_iteration(hosts):
    run = hh.Program(hh.LOGIN, [sys.executable, "-u", str(PROGRAMS / "train_across_hosts.py")],
                     program_env(), stdin=True)
    try:
        placed = run.wait_for("PLACED ", 240)
        assert set(placed["hosts"].values()) == set(COMPUTE), placed  # the nodes are spread over the hosts
        victim = run.wait_for("CUT ", 240)
        hosts.cut(victim)
        run.say("go")
        r = run.result(300)
    finally:
        run.kill()
    on_victim = sorted(n for n, h in placed["hosts"].items() if h == victim)
    assert r["cut_mid_iteration"] and r["losses_finite"], r
    assert r["dead"] == on_victim, (r, run.text()[-3000:])
    assert not set(on_victim) & set(r["alloc"]), r  # planned around


def test_a_hostile_node_started_as_a_slurm_job_on_a_compute_host_takes_nothing_and_is_caught(hosts, tmp_path):
    """The trust boundary across hosts: the coordinator on the login host starts every node as a job of the
    multi-node Slurm; one node runs code of its own from its start (tests/support/hostile_node.py): while
    the others start it asks the coordinator's node for every mailbox there is, asks for credentials, and
    sends a pickle that would write a marker file and a negative norm. It takes nothing but what was made
    for it, gets no credentials, is caught alone, and the training finishes without it."""
    result = tmp_path / "hostile.json"
    done = hh.call_on(hh.LOGIN, [sys.executable, str(PROGRAMS / "hosts_hostile_started.py"), str(result)],
                      timeout=600, env=program_env())
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    hostile, said = seen["hostile"], seen["hostile_said"]
    assert all(job.isdigit() for job in seen["jobs"].values()), seen["jobs"]  # every node a Slurm job
    assert said["host"] in COMPUTE, said  # the attacker ran on a compute host
    assert all(first == "{" for first in said["stolen"]), said  # its own environment report, never a payload
    assert said["issued"].startswith("refused"), said
    assert not seen["marker"], "the pickle was unpickled somewhere"
    assert seen["caught"] == [[hostile]], seen["blamed"]  # it alone: no honest node blamed
    assert hostile in seen["excluded"]
    assert set(seen["nodes"]) - {hostile} <= set(seen["trains"]), seen  # every other node started and trains
    assert seen["iterations"] == 6 and all(math.isfinite(x) for x in seen["losses"]), seen


# -- what a sniffer on the path sees ------------------------------------------------------------------

# the start of a pickle of protocol 5: PROTO 5, FRAME and its 8-byte length (under 64 KiB: six zero bytes)
_PICKLE_FRAME = re.compile(rb"\x80\x05\x95..\x00{6}", re.S)


def _sniffed(hosts, encrypt, marker, tmp_path):
    """tests/support/programs/wire_marker.py with its parent on the login host and its children on the first
    compute host, under ``encrypt``; what tcpdump inside that compute host (its eth0) saw of roving's
    connections: the TCP payloads to and from their ports."""
    from helpers_net import tcp_payloads

    target = hh.COMPUTE[0]
    pcap = tmp_path / f"{encrypt}.pcap"
    dump = hh.run_on(target, ["tcpdump", "-i", "eth0", "-U", "--immediate-mode", "-s", "0", "-w", str(pcap), "tcp"],
                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        line = dump.stderr.readline().decode()
        assert "listening on" in line, f"tcpdump did not start in {target.name}: {line}"
        env = program_env(ROVING_BACKEND="slurm", ROVING_SLURM_PARTITION=hh.PARTITION,
                          ROVING_SLURM_OPTIONS=f"--nodelist={target.name}", ROVING_CHILD_OUTPUT="off")
        done = hh.call_on(hh.LOGIN, [sys.executable, str(PROGRAMS / "wire_marker.py"), encrypt, marker],
                          timeout=180, env=env, cwd=str(ROOT))
    finally:
        dump.terminate()
        dump.wait(10)
    assert "OK" in done.stdout, done.stdout + done.stderr
    ports = {int(p) for p in done.stdout.split("PORTS", 1)[1].split("\n", 1)[0].split()}
    return tcp_payloads(pcap.read_bytes(), ports)


def test_a_sniffer_on_another_host_sees_neither_pickles_nor_the_data_of_roving_traffic(hosts, tmp_path):
    marker = "roving-marker-" + os.urandom(8).hex()
    plain = _sniffed(hosts, "off", marker, tmp_path)
    # the control: with encryption off the capture does hold the data (so the capture itself works)
    assert marker.encode() in plain and _PICKLE_FRAME.search(plain), "the capture saw no plain traffic"
    wire = _sniffed(hosts, "auto", marker, tmp_path)  # the default
    assert len(wire) > 10_000, "the capture saw too little traffic to mean anything"
    assert marker.encode() not in wire
    assert not _PICKLE_FRAME.search(wire)


def test_roving_ps_logs_and_cancel_see_the_jobs_on_the_hosts(hosts):
    import time

    run = start("orphans")
    try:
        ready = run.wait_for("READY ", 120)
        env = program_env()

        def roving_cmd(*args):
            return subprocess.run([sys.executable, "-m", "roving", *args, "--backend", "slurm"], env=env,
                                  capture_output=True, text=True, timeout=60)

        ps = roving_cmd("ps")
        assert ps.returncode == 0, ps.stderr
        for job in ready["jobs"]:
            assert any(line.split()[:1] == [job] and "PoolWorker" in line for line in ps.stdout.splitlines()), ps.stdout
        victim = ready["jobs"][0]
        logs = roving_cmd("logs", victim)
        assert logs.returncode == 0, logs.stderr
        assert f"worker of job {victim} on rv-h" in logs.stdout, logs.stdout
        cancel = roving_cmd("cancel", victim)
        assert cancel.returncode == 0 and f"cancelled {victim}" in cancel.stdout, cancel.stderr
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            out = hosts.slurm(["squeue", "-h", "-o", "%i", "-j", victim]).stdout.split()
            if victim not in out:
                break
            time.sleep(0.5)
        assert victim not in out, f"job {victim} still there 30 s after roving cancel"
    finally:
        run.kill()


def test_a_worker_on_a_compute_host_sent_sigterm_mid_item_hands_it_back_without_a_retry(hosts, tmp_path):
    # roving.pool._ending across hosts: the parent on the root host, its worker a job of the multi-node
    # Slurm; scancel --signal=TERM of that job mid-item: the item is run again by the replacement, and
    # with max_task_retries=1 it still finishes (a preemption is no death)
    marker_dir = tmp_path / "markers"
    marker_dir.mkdir()
    done = hosts.call_on(hosts.ROOT, [sys.executable, str(PROGRAMS / "hosts_ending.py"), str(marker_dir)],
                         timeout=300, env=hosts.program_env())
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    compute = {h.name for h in hosts.COMPUTE}
    started_on = {n[len("started-"):].rsplit("-", 1)[0] for n in seen["started"]}
    assert len(seen["started"]) == 2 and started_on <= compute
    assert seen["finished_on"] in compute
    assert seen["retried"] == 0 and seen["ended_early"] == 1 and seen["handed_back"] == 1
