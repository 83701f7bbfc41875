"""The docker backend on the real Docker engine that scripts/cluster/docker.sh starts: limits, labels and
mounts of the container, its removal, and bad input failing within seconds with the cause."""
from __future__ import annotations

import time

import pytest

import helpers_backends as hb
import helpers_targets as h
import roving
from helpers_core import wait_until
from roving import backends
from roving.transport import session as _session


@pytest.fixture(autouse=True)
def _docker():
    hb.require("docker")


def test_container_has_limits_labels_and_the_working_directory_and_is_removed_after_exit():
    roving.init(backend="docker", cpu=0.5, memory="200M", **hb.OPTIONS["docker"])
    q = roving.Queue()
    p = roving.Process(target=h.report_identity, args=(q,), name="boxed")
    p.start()
    q.get(timeout=60)
    client = p._backend.client()
    attrs = client.api.inspect_container(p.job.id)
    assert attrs["HostConfig"]["NanoCpus"] == 500_000_000 and attrs["HostConfig"]["Memory"] == 200 * 2**20
    assert attrs["Config"]["Labels"] == {"roving.session": _session.current().tag, "roving.name": "boxed",
                                         "roving.user": backends.base.user_name(),
                                         "roving.owner": backends.containers.owner_label()}
    assert attrs["HostConfig"]["NetworkMode"] == "host" and attrs["Config"]["Image"] == hb.DOCKER_IMAGE
    import os
    assert any(m["Destination"] == os.getcwd() for m in attrs["Mounts"])
    p.join(60)
    assert p.exitcode == 0
    assert wait_until(lambda: not client.containers.list(all=True, filters={"id": p.job.id}), 10)


@pytest.mark.parametrize("options, words", [
    ({"image": "no-such-image:1"}, "image 'no-such-image:1' is not on the Docker host"),
    ({"memory": "100T"}, "asks for 102400.0 GiB of memory"),
    ({"gpu": 1}, "Docker could not start"),
    ({"docker_url": "tcp://127.0.0.1:1"}, "Docker engine at tcp://127.0.0.1:1 is not reachable"),
])
def test_bad_requests_fail_at_start_within_seconds_naming_the_cause(options, words):
    roving.init(backend="docker", **{**hb.OPTIONS["docker"], **options})
    backends._instances.pop("docker", None)
    t0 = time.monotonic()
    with pytest.raises(OSError, match=words):
        roving.Process(target=h.return_normally).start()
    assert time.monotonic() - t0 < 10
    backends._instances.pop("docker", None)


def test_a_container_gets_only_what_roving_needs_and_forward_env_and_the_secret_only_as_a_file(monkeypatch):
    import json
    import os
    import stat

    from roving.transport import session as _session

    monkeypatch.setenv("CLOUD_TOKEN", "do-not-leak-8d1f")
    monkeypatch.setenv("WANTED_SETTING", "wanted-5e2a")
    roving.init(backend="docker", forward_env="WANTED_SETTING", **hb.OPTIONS["docker"])
    secret = _session.current().secret.hex()
    out, go = roving.Queue(), roving.Queue()
    p = roving.Process(target=h.report_environment, args=(out, go))
    p.start()
    seen = out.get(timeout=60)  # the child authenticated: the secret reached it
    client = p._backend.client()
    attrs = client.api.inspect_container(p.job.id)
    image_env = {e.split("=", 1)[0] for e in client.images.get(hb.DOCKER_IMAGE).attrs["Config"].get("Env") or []}
    spec_env = dict(e.split("=", 1) for e in attrs["Config"]["Env"])
    assert secret not in json.dumps(attrs), "the secret is in no part of the container's spec"
    asked = {"ROVING_CHILD", "PYTHONPATH", "PYTHONUNBUFFERED", "WANTED_SETTING", _session.SECRET_FILE_ENV}
    extra = {k for k in spec_env if k not in asked | image_env and not k.startswith("ROVING_")}
    assert extra == set(), f"variables nobody asked for: {extra}"
    assert "CLOUD_TOKEN" not in spec_env and "CLOUD_TOKEN" not in seen
    assert spec_env["WANTED_SETTING"] == "wanted-5e2a" and seen["WANTED_SETTING"] == "wanted-5e2a"
    assert secret not in json.dumps(seen) and _session.SECRET_FILE_ENV not in seen  # read, then dropped
    mount = [m for m in attrs["Mounts"] if m["Destination"] == "/run/roving-session"][0]
    assert mount["RW"] is False
    folder = mount["Source"]
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(folder, "secret")).st_mode) == 0o600
    go.put("done")
    p.join(60)
    assert p.exitcode == 0
    assert wait_until(lambda: not os.path.exists(folder), 10), "the secret's folder goes with the container"


def test_pid_is_the_hosts_number_of_the_childs_python_process_which_os_kill_reaches():
    """As multiprocessing's, ``pid`` is known once ``start()`` returns and names the child's own process
    on this machine (not Docker's init): /proc shows it is the child, whose number in its container is
    what it reports; ``os.kill`` ends it, and the pid stays after the end."""
    import os
    import signal

    roving.init(backend="docker", **hb.OPTIONS["docker"])
    reported, go = roving.Queue(), roving.Queue()
    p = roving.Process(target=h.report_pid_then_wait, args=(reported, go))
    p.start()
    pid = p.pid
    assert isinstance(pid, int) and p.ident == pid
    inside = reported.get(timeout=60)
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert b"roving._child" in f.read().split(b"\0")
    with open(f"/proc/{pid}/status") as f:
        numbers = next(line.split()[1:] for line in f if line.startswith("NSpid:"))
    assert [int(n) for n in numbers] == [pid, inside]  # this machine's number, then the container's
    assert inside != pid
    os.kill(pid, signal.SIGTERM)
    p.join(60)
    assert p.exitcode == -signal.SIGTERM and p.pid == pid


def test_shutdown_waits_for_the_output_followers_so_a_containers_last_lines_are_printed(monkeypatch, capfd):
    """With ``child_output="prefix"`` a thread follows each container's output. At exit the shutdown
    removes the containers still running (a daemon child, one never joined); what they printed last may
    still be in their followers, behind on a loaded machine (here made a second late on every chunk). The
    shutdown waits for the followers of the containers it removes, so the child's last line is printed
    before the program ends."""
    import threading as _threading

    from roving.backends import docker as _docker_backend

    class Late(_docker_backend.LineSplitter):
        def feed(self, chunk):
            _threading.Event().wait(1.0)  # a follower a second behind
            super().feed(chunk)

    monkeypatch.setattr(_docker_backend, "LineSplitter", Late)
    roving.init(backend="docker", child_output="prefix", **hb.OPTIONS["docker"])
    printed, go = roving.Queue(), roving.Queue()
    p = roving.Process(target=h.print_then_wait, args=("the last line of a container", printed, go),
                       daemon=True)
    p.start()
    assert printed.get(timeout=60)
    p._backend.shutdown()
    assert "the last line of a container" in capfd.readouterr().out
    backends._instances.pop("docker", None)
