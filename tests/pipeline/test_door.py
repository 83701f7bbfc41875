"""The open door (``roving pipeline train --open-join``, ``invite``, ``node``): invitations, the exchange
at the door, and real nodes started by hand joining a running training — from another test host, and
one that attacks."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import helpers_hosts as hh
from helpers_core import wait_until
from helpers_hosts import hosts  # noqa: F401  (fixture)
from roving.pipeline.runtime import door
from roving.pipeline.runtime.control import ControlFolder
from roving.transport import session

SUPPORT = Path(__file__).resolve().parents[1] / "support"
TRAIN = ["--model", "tiny", "--network", "gcp12", "--nodes", "4", "--stages", "2", "--skip", "0",
         "--microbatches", "4", "--samples", "2", "--seq-len", "32", "--eval-every", "1000", "--seed", "3"]


# -- invitations --------------------------------------------------------------------------------------
def test_an_invitation_is_used_once_and_never_after_it_expires_or_is_revoked():
    inv = door.Invitations(session.current().credentials.ca_pem)
    first, token = inv.create(60)
    assert inv.redeem(token) == first
    with pytest.raises(door.JoinError, match="was used"):
        inv.redeem(token)
    second, token2 = inv.create(60)
    assert inv.revoke(second) and not inv.revoke(second)
    with pytest.raises(door.JoinError, match="revoked"):
        inv.redeem(token2)
    _, short = inv.create(1e-6)
    time.sleep(0.01)  # past its lifetime: a clock, not an event
    with pytest.raises(door.JoinError, match="expired"):
        inv.redeem(short)
    wrong = token.rsplit(".", 3)
    with pytest.raises(door.JoinError, match="not one of this run's"):
        inv.redeem(".".join([wrong[0], wrong[1], "0" * 32, wrong[3]]))
    with pytest.raises(door.JoinError, match="not an invitation token"):
        inv.redeem("rvj1.x")
    with pytest.raises(ValueError):
        inv.create(0)


class _Door:
    """A door on 127.0.0.1 whose run places nobody (it answers why), served from a thread."""

    def __init__(self) -> None:
        creds = session.current().credentials
        self.invitations = door.Invitations(creds.ca_pem)
        self.door = door.Door("127.0.0.1", 0, creds, self.invitations)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        def refuse(region, public, key):
            raise ValueError(f"placed nowhere (region {region})")
        while not self.done.wait(0.05):
            self.door.serve(refuse)

    def close(self) -> None:
        self.done.set()
        self.door.close()


def test_a_node_checks_the_coordinator_against_its_invitation_before_it_says_anything():
    d = _Door()
    try:
        _, token = d.invitations.create(60)
        inv_id, secret, _ = door.parse_token(token)
        with pytest.raises(door.JoinError, match="not the training the invitation is for"):
            door.join(d.door.address, f"rvj1.{inv_id}.{secret}.{'0' * 32}", os.urandom(32), timeout=10)
        # the invitation was not even shown: it is still good
        with pytest.raises(door.JoinError, match="placed nowhere"):
            door.join(d.door.address, token, os.urandom(32), region="r1", timeout=10)
        with pytest.raises(door.JoinError, match="was used"):
            door.join(d.door.address, token, os.urandom(32), timeout=10)
    finally:
        d.close()


def test_the_door_cuts_off_a_stranger_that_sends_no_line_or_one_too_long():
    import socket
    import ssl

    d = _Door()
    try:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        host, port = d.door.address.split(":")
        with socket.create_connection((host, int(port)), timeout=30) as raw, ctx.wrap_socket(raw) as tls:
            tls.recv(65536)  # the CA
            tls.sendall(b"x" * (door.MAX_LINE + 10))
            tls.settimeout(30)
            got = b""
            try:
                while chunk := tls.recv(4096):
                    got += chunk
            except (ConnectionError, ssl.SSLError):
                pass
        assert b"placement" not in got
        assert wait_until(lambda: d.door._refusals.count >= 1, 10)
    finally:
        d.close()


# -- real nodes -----------------------------------------------------------------------------------
class Run:
    """``roving pipeline train --open-join`` in a subprocess of this host, its output kept."""

    def __init__(self, tmp: Path, door_host: str, iterations: int, env: dict | None = None) -> None:
        self.control = tmp / "ctl"
        self.metrics = tmp / "metrics.json"
        argv = [sys.executable, "-m", "roving.cli", "pipeline", "train", *TRAIN, "--iterations", str(iterations),
                "--control", str(self.control), "--open-join", f"{door_host}:0", "--metrics", str(self.metrics)]
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def status(self) -> dict:
        try:
            return ControlFolder(self.control).read_status()
        except (FileNotFoundError, ValueError):
            return {}

    def invite(self) -> tuple[str, str]:
        assert wait_until(lambda: self.status().get("iterations_done", 0) >= 1, 120), "".join(self.lines)[-3000:]
        out = subprocess.run([sys.executable, "-m", "roving.cli", "pipeline", "invite", "--control", str(self.control)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        words = out.stdout.split()
        return words[words.index("--join") + 1], words[words.index("--invite") + 1]

    def events(self) -> list[dict]:
        return [json.loads(x) for x in (self.control / "events.jsonl").read_text().splitlines() if x.strip()]

    def finish(self, timeout: float = 300) -> int:
        rc = self.proc.wait(timeout)
        time.sleep(0)  # the reader thread ends with the pipe
        return rc


def test_a_node_started_by_hand_on_another_host_joins_a_running_training_through_the_open_door(hosts, tmp_path):
    run = Run(tmp_path, hh.ROOT.address, 100_000, env=dict(os.environ, ROVING_HOST=hh.ROOT.address))
    node = None
    try:
        address, token = run.invite()
        t0 = time.monotonic()
        node = hh.run_on("rv-h1", [sys.executable, "-m", "roving.cli", "pipeline", "node", "--join", address,
                                   "--invite", token], env=hh.program_env(), cwd=str(tmp_path), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        first = node.stdout.readline()
        assert first.startswith("joined the training at"), first + node.stdout.read()
        name = first.split("as node ")[1].split(";")[0]
        # placed (a re-plan gave it a stage) and computing: the run's status lists it among the nodes
        assert wait_until(lambda: name in run.status().get("nodes", {}), 120), run.status()
        joined_s = time.monotonic() - t0
        done = run.status()["iterations_done"]
        assert wait_until(lambda: run.status().get("iterations_done", 0) >= done + 5, 120)
        # the same invitation again, from another host: refused
        again = hh.call_on("rv-h2", [sys.executable, "-m", "roving.cli", "pipeline", "node", "--join", address,
                                     "--invite", token], env=hh.program_env(), check=False, timeout=120)
        assert again.returncode == 1 and "was used" in again.stderr, again.stderr
        run.proc.send_signal(signal.SIGINT)  # the run stops its nodes, the joined one too
        rest = node.communicate(timeout=120)[0]
        assert node.returncode == 0 and f"node {name}: the training released it" in rest, rest
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
        if node is not None and node.poll() is None:
            node.kill()
    run.finish()
    kinds = [(e["event"], e.get("why")) for e in run.events()]
    assert ("join-requested", "the open door") in kinds and ("replan", "joined") in kinds, kinds
    print(f"open join: command to placed in {joined_s:.1f} s")


def test_a_node_that_joined_through_the_door_says_which_address_went_silent_and_leaves_when_its_coordinator_dies(
        hosts, tmp_path):
    """A node someone else started has no parent to outlive: when the training's coordinator is killed
    (SIGKILL: it tells no one), the node names the address that stopped answering and exits with an
    error, instead of waiting for ever."""
    run = Run(tmp_path, hh.ROOT.address, 100_000, env=dict(os.environ, ROVING_HOST=hh.ROOT.address))
    node = None
    try:
        address, token = run.invite()
        node = hh.run_on("rv-h1", [sys.executable, "-m", "roving.cli", "pipeline", "node", "--join", address,
                                   "--invite", token, "--coordinator-timeout", "10"],
                         env=hh.program_env(), cwd=str(tmp_path), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        first = node.stdout.readline()
        assert first.startswith("joined the training at"), first + node.stdout.read()
        name = first.split("as node ")[1].split(";")[0]
        assert wait_until(lambda: name in run.status().get("nodes", {}), 120), run.status()
        run.proc.kill()
        run.proc.wait(60)
        rest = node.communicate(timeout=120)[0]
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
        if node is not None and node.poll() is None:
            node.kill()
    assert node.returncode == 1, rest
    assert "has not answered for 10 s" in rest and hh.ROOT.address in rest, rest


def test_a_hostile_node_through_the_open_door_gets_nothing_and_is_caught_and_the_training_finishes(hosts, tmp_path):
    """The attacker runs on test host rv-h1 and comes through the door of a training on this host."""
    marker = tmp_path / "marker"
    env = dict(os.environ, ROVING_HOST=hh.ROOT.address)
    clean = Run(tmp_path / "clean", hh.ROOT.address, 150, env=env)
    assert clean.finish() == 0, "".join(clean.lines)[-3000:]
    run = Run(tmp_path / "attacked", hh.ROOT.address, 150, env=env)
    hostile = None
    try:
        address, token = run.invite()
        hostile = hh.call_on("rv-h1", [sys.executable, str(SUPPORT / "hostile_node.py"), address, token, str(marker)],
                             env=hh.program_env(), check=False, timeout=300)
    finally:
        rc = run.finish()
    out = "".join(run.lines)
    assert rc == 0, out[-3000:]
    lines = [x for x in hostile.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, hostile.stdout[-2000:] + hostile.stderr[-3000:]
    said = json.loads(lines[-1][len("RESULT "):])
    assert said["admitted"] and said["stolen"] == []
    assert said["issued"].startswith("refused") and said["asked"].startswith("refused")
    assert not marker.exists()
    caught = [e for e in run.events() if e["event"] == "caught"]
    assert [e["nodes"] for e in caught] == [[said["name"]]], caught  # it, and no honest node
    final = json.loads(run.metrics.read_text())
    base = json.loads(clean.metrics.read_text())
    ours, theirs = final["evaluations"][-1]["val_loss"], base["evaluations"][-1]["val_loss"]
    assert abs(ours - theirs) / theirs < 0.03, (ours, theirs)


def test_a_hostile_started_node_takes_no_other_nodes_start_payload_and_is_caught(monkeypatch, tmp_path):
    """The coordinator starts the nodes; one of them runs code of its own from its start (its machine is
    not the coordinator's to trust): while the others start, it asks the coordinator's node for every
    mailbox id there is, and sends a pickle and a negative norm. Every other node starts (no payload
    taken), it is caught while starting, and the training runs on without it."""
    import hostile_node
    from roving.pipeline.runtime import roster as roster_module
    from roving.pipeline.run.trainer import Trainer, TrainConfig, prepare

    result = tmp_path / "hostile.json"
    monkeypatch.setenv("HOSTILE_NODE_RESULT", str(result))
    monkeypatch.setattr(roster_module, "stage_main", hostile_node.started_main)
    launch = roster_module.Roster.launch

    def hostile_first(self, name, *args, **kwargs):  # the others start while it already attacks
        if name != hostile_node.HOSTILE and hostile_node.HOSTILE not in self.procs:
            launch(self, hostile_node.HOSTILE, prep.plan.allocation[hostile_node.HOSTILE],
                   sorted(prep.plan.allocation).index(hostile_node.HOSTILE))
            assert wait_until(lambda: Path(str(result) + ".attacking").exists(), 120)
        if name == hostile_node.HOSTILE and name in self.procs:
            return
        launch(self, name, *args, **kwargs)

    monkeypatch.setattr(roster_module.Roster, "launch", hostile_first)
    cfg = TrainConfig(model="tiny", network="gcp12", nodes=5, stages=2, skip=0.0, microbatches=4, samples=2,
                      seq_len=16, iterations=6, eval_every=100, eval_batches=2, planner_budget=0.3, timeout=120,
                      start_wait=30, seed=2)
    prep = prepare(cfg)
    assert hostile_node.HOSTILE in prep.plan.allocation
    with Trainer(prep) as t:
        metrics = t.train()
        caught = [e for e in metrics["events"] if e["event"] == "caught"]
        assert [e["nodes"] for e in caught] == [[hostile_node.HOSTILE]], caught
        assert hostile_node.HOSTILE in t.roster.excluded
        others = set(prep.plan.allocation) - {hostile_node.HOSTILE}
        assert others <= set(t.alloc), (others, t.alloc)  # every other node started and trains
    said = json.loads(result.read_text())
    # what it could take was its own (the mailboxes made for it: its environment report, JSON), never a
    # pickled start payload, and every other node started (above)
    assert all(first == "{" for first in said["stolen"]), said
    assert said["issued"].startswith("refused")
    assert not (tmp_path / "hostile.json.marker").exists()
    assert len(metrics["iterations"]) == 6
