"""`roving cancel --all` on Docker and Kubernetes stops only the jobs this user's key labelled (issue 31):
a container or pod labelled ``roving.user=<this user>`` by anyone else, or by the same user name with
another key (another machine's "alice"), is left alone. Docker is the real engine
(scripts/cluster/docker.sh); Kubernetes the fake API server (tests/support/fake_k8s).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import helpers_backends as hb
import helpers_targets as h
import roving
from fake_k8s.server import FakeKubernetes
from helpers_core import wait_until
from roving import backends
from roving.backends import base, containers

T = 60


def _label_with_another_key(monkeypatch, home) -> str:
    """The owner label the same user name gets with a key of its own (another HOME)."""
    with monkeypatch.context() as m:
        m.setenv("HOME", str(home))
        return containers.owner_label()


def _cancel_all(backend: str, home=None, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    if home is not None:
        env["HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "roving.cli", "cancel", "--all", "--backend", backend],
                          capture_output=True, text=True, timeout=T, env=env)


def test_owner_labels_are_a_keyed_hash_the_same_for_one_key_and_another_for_another(monkeypatch, tmp_path):
    mine = containers.owner_label()
    assert mine == containers.owner_label() and len(mine) == 32
    assert base.user_name() not in mine
    other = _label_with_another_key(monkeypatch, tmp_path / "elsewhere")
    assert other != mine
    key_file = tmp_path / "elsewhere" / ".roving" / "owner.key"
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    assert containers.owner_label("someone-else") != mine


def test_cancel_all_on_docker_stops_this_users_containers_and_not_ones_labelled_with_its_name(monkeypatch,
                                                                                            tmp_path):
    hb.require("docker")
    roving.init(backend="docker", **hb.OPTIONS["docker"])
    p = roving.Process(target=h.sleep_for, args=(120,), name="mine")
    p.start()
    client = p._backend.client()
    labels = client.api.inspect_container(p.job.id)["Config"]["Labels"]
    assert labels["roving.owner"] == containers.owner_label()
    volumes = hb.OPTIONS["docker"]["docker_volumes"]
    forged = [client.containers.run(hb.DOCKER_IMAGE, [sys.executable, "-c", "import time; time.sleep(120)"],
                                    detach=True, volumes=volumes, network_mode="host", labels=extra)
              for extra in (
                  # the user's name alone, as every job used to be matched
                  {"roving.session": "forged1", "roving.name": "x", "roving.user": base.user_name()},
                  # the same user name, with another key's label (another machine's user of that name)
                  {"roving.session": "forged2", "roving.name": "y", "roving.user": base.user_name(),
                   "roving.owner": _label_with_another_key(monkeypatch, tmp_path / "other")})]
    try:
        r = _cancel_all("docker", home=tmp_path / "other")  # the other key's --all: none of ours
        assert r.returncode == 0, r.stderr
        assert p.job.id not in r.stdout and p.is_alive()
        assert forged[1].id[:12] in r.stdout  # its own, which it did label
        r = _cancel_all("docker")
        assert r.returncode == 0, r.stderr
        assert f"cancelled {p.job.id[:12]}" in r.stdout
        assert forged[0].id[:12] not in r.stdout
        p.join(T)
        assert p.exitcode is not None
        forged[0].reload()
        assert forged[0].status == "running"
    finally:
        for c in forged:
            try:
                c.remove(force=True)
            except Exception:
                pass


def test_cancel_all_on_kubernetes_deletes_this_users_pods_and_not_ones_labelled_with_its_name(monkeypatch,
                                                                                            tmp_path):
    with FakeKubernetes(cpu=8, memory=8 * 2**30, gpu=1) as fake:
        monkeypatch.setenv("KUBECONFIG", fake.kubeconfig(str(tmp_path / "kubeconfig")))
        monkeypatch.delenv("POD_NAME", raising=False)
        backends._instances.pop("kubernetes", None)
        roving.init(backend="kubernetes", image="fake/roving:test")
        try:
            p = roving.Process(target=h.sleep_for, args=(120,), name="mine")
            p.start()
            assert wait_until(lambda: ("default", p.job.id) in fake.pods, T)
            labels = fake.pods[("default", p.job.id)].body["metadata"]["labels"]
            assert labels["roving.owner"] == containers.owner_label()
            api = p._backend.api()
            sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
            for name, extra in (("forged-1", {}),
                                ("forged-2", {"roving.owner": _label_with_another_key(monkeypatch, tmp_path / "o")})):
                api.create_namespaced_pod("default", {
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "roving",
                                                          "roving.session": "forged", "roving.user": base.user_name(),
                                                          **extra}},
                    "spec": {"containers": [{"name": "c", "image": "x", "command": sleeper}]}})
            r = _cancel_all("kubernetes")
            assert r.returncode == 0, r.stderr
            assert f"cancelled {p.job.id}" in r.stdout
            assert "forged" not in r.stdout
            p.join(T)
            assert p.exitcode is not None
            assert ("default", "forged-1") in fake.pods and ("default", "forged-2") in fake.pods
        finally:
            for child in roving.active_children():
                child.kill()
                child.join(T)
            backends._instances.pop("kubernetes", None)


@pytest.fixture(autouse=True)
def _fresh_key_cache():
    yield
    containers._owner_key.cache_clear()
