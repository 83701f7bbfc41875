"""Backends sit below the transport: what they need of a job's session comes in its spec.

The secret reaches a child in the session's own variable (never inside the child's bootstrap, which
backends no longer edit), a container never gets the secret's variables, and the output helpers copy a
child's lines with their prefix. That backends import only roving.config: tests/test_layering.py.
"""
from __future__ import annotations

import json
import os
import threading
import subprocess
import sys

import helpers_targets as h
import roving
from roving import backends
from roving.backends.containers import container_env
from roving.backends.output import LineSplitter, OutputPump
from roving.transport import session as _session

T = 60


def test_auto_is_resolved_by_the_backends_detection():
    cfg = roving.config.load(overrides={"backend": "auto"}, environ={})
    assert cfg.backend == backends.detect()[0]
    in_slurm = subprocess.run(
        [sys.executable, "-c", "import roving; print(roving.config.load({'backend': 'auto'}).backend)"],
        env={**os.environ, "SLURM_JOB_ID": "4242"}, capture_output=True, text=True, timeout=T)
    assert in_slurm.stdout.strip() == "slurm", in_slurm.stderr


def test_a_child_gets_the_secret_in_the_sessions_variable_and_its_bootstrap_holds_none(specs):
    session = _session.current()
    q = roving.Queue()
    p = roving.Process(target=h.put_value, args=(q, "reached"), name="carrier")
    p.start()
    assert q.get(timeout=T) == "reached"  # the child found the secret where the spec said
    p.join(T)
    assert p.exitcode == 0
    (spec,) = [s for s in specs if s.name == "carrier"]
    assert spec.session == backends.JobSession(session.tag, _session.SECRET_ENV, _session.SECRET_FILE_ENV)
    # the member secret, then the child's own credentials' seed (roving.transport.identity)
    member, _, seed = spec.env[spec.session.secret_env].partition(".")
    assert member == session.secret.hex() and len(seed) >= 32
    assert "secret" not in json.loads(spec.env[_session.CHILD_ENV])
    assert session.secret.hex() not in spec.env[_session.CHILD_ENV]


def test_a_container_never_gets_the_secrets_variables_even_when_forward_env_names_them():
    session = backends.JobSession("tag0", "ROVING_SESSION_SECRET", "ROVING_SESSION_SECRET_FILE")
    spec = backends.JobSpec(
        name="c", command=["true"], cwd="/", session=session,
        env={"ROVING_SESSION_SECRET": "ab12", "ROVING_SESSION_SECRET_FILE": "/x", "ROVING_CHILD": "{}",
             "ROVING_CPU": "2", "PYTHONPATH": "/p", "HOME": "/root", "WANTED": "1"})
    env, secret = container_env(spec, ["WANTED", "ROVING_SESSION_SECRET", "ROVING_SESSION_SECRET_FILE"])
    assert secret == "ab12"
    assert env == {"ROVING_CHILD": "{}", "ROVING_CPU": "2", "PYTHONPATH": "/p", "WANTED": "1",
                   "PYTHONUNBUFFERED": "1"}
    spec.env.pop("ROVING_SESSION_SECRET")
    assert container_env(spec, ())[1] == ""


def test_line_splitter_prefixes_whole_lines_and_writes_the_last_partial_one_at_close(capfd):
    splitter = LineSplitter("[w] ", keep=lambda line: line != b"drop")
    splitter.feed(b"one\ntw")
    splitter.feed(b"o\ndrop\nthr")
    assert capfd.readouterr().out == "[w] one\n[w] two\n"
    splitter.close()
    assert capfd.readouterr().out == "[w] thr\n"


def test_output_pump_copies_each_stream_with_its_prefix_until_its_end(capfd):
    pump = OutputPump()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    ended = {"out": threading.Event(), "err": threading.Event()}
    pump.add(os.fdopen(out_r, "rb"), "[a] ", False, on_end=ended["out"].set)
    pump.add(os.fdopen(err_r, "rb"), "[b] ", True, on_end=ended["err"].set)
    os.write(out_w, b"first\nsecond, no newline")
    os.write(err_w, b"to stderr\n")
    os.close(out_w)
    os.close(err_w)
    # read the capture once, after the pump has written everything (a read while it writes could lose
    # a line between pytest's read and its truncate of the capture file)
    assert ended["out"].wait(60) and ended["err"].wait(60), "the pump did not reach the ends of both streams"
    captured = capfd.readouterr()
    seen_out, seen_err = captured.out, captured.err
    assert seen_out == "[a] first\n[a] second, no newline\n"
    assert seen_err == "[b] to stderr\n"
