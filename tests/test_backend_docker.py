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
from roving.backends.docker import DockerBackend


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
    assert attrs["Config"]["Labels"] == {"roving.session": backends.base.session_tag(), "roving.name": "boxed"}
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
