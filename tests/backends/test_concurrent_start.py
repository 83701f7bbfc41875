"""A pool's containers and pods are created concurrently, at most roving.backends.throttle.CONCURRENCY at a
time (issue 22), and creation is retried with back-off while the cluster says it is busy.

Docker: the real engine (scripts/cluster/docker.sh); each creation call to it is timed on its way through
the Docker SDK, and the intervals must overlap. Kubernetes: the fake API server (tests/support/fake_k8s),
which takes ``create_delay`` seconds per pod creation outside its lock and records the intervals.
Nothing here measures speed: only whether creations were in flight at the same time.
"""
from __future__ import annotations

import logging
import threading
import time

import pytest

import helpers_backends as hb
import helpers_pool as hp
import roving
from fake_k8s.server import FakeKubernetes
from roving import backends
from roving.backends import throttle

T = 90


def _most_at_once(intervals):
    """The largest number of the (start, end) intervals that overlap at one moment."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    now = best = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def test_docker_pool_containers_are_created_concurrently_within_the_bound(monkeypatch):
    hb.require("docker")
    import docker.models.containers as models

    intervals, lock = [], threading.Lock()
    real_create = models.ContainerCollection.create

    def timed_create(self, *args, **kwargs):  # the real call to the real engine, timed
        t0 = time.monotonic()
        try:
            return real_create(self, *args, **kwargs)
        finally:
            with lock:
                intervals.append((t0, time.monotonic()))

    monkeypatch.setattr(models.ContainerCollection, "create", timed_create)
    monkeypatch.setattr(throttle, "CONCURRENCY", 4)
    roving.init(backend="docker", cpu=0.25, memory="150M", **hb.OPTIONS["docker"])
    with roving.Pool(12) as p:
        assert len(intervals) == 12
        most = _most_at_once(intervals)
        assert 2 <= most <= 4, (most, intervals)  # in parallel, and never more than the bound
        assert len({proc.job.id for proc in p._pool}) == 12
        assert p.map(hp.square, range(24)) == [x * x for x in range(24)]


def test_docker_answers_that_say_busy_are_retried_and_others_raised_at_once(caplog):
    import docker.errors
    from roving.backends.docker import DockerBackend

    class Response:
        def __init__(self, code):
            self.status_code, self.reason, self.url = code, "", "http://docker/containers/create"

    def failing(*answers):
        left = list(answers)

        def call():
            if left:
                code, words = left.pop(0)
                raise docker.errors.APIError("refused", Response(code), explanation=words)
            return "created"
        return call

    caplog.set_level(logging.WARNING, logger="roving.backends.throttle")
    assert DockerBackend._when_not_busy("creating x", failing((429, "too many requests"),
                                                              (503, "engine overloaded"))) == "created"
    busy = [r.getMessage() for r in caplog.records]
    assert len(busy) == 2 and "HTTP 429: too many requests" in busy[0] and "HTTP 503" in busy[1], busy
    for code, words in ((400, "invalid reference format"), (500, "invalid mount config for type bind")):
        t0 = time.monotonic()
        with pytest.raises(docker.errors.APIError, match=words):
            DockerBackend._when_not_busy("creating x", failing((code, words)))
        assert time.monotonic() - t0 < 0.4  # not retried


@pytest.fixture
def fake(monkeypatch, tmp_path):
    with FakeKubernetes(cpu=8, memory=8 * 2**30) as server:
        monkeypatch.setenv("KUBECONFIG", server.kubeconfig(str(tmp_path / "kubeconfig")))
        monkeypatch.delenv("POD_NAME", raising=False)
        backends._instances.pop("kubernetes", None)
        roving.init(backend="kubernetes", image="fake/roving:test", cpu=0.25, memory="100M")
        yield server
        for child in roving.active_children():
            child.kill()
            child.join(T)
    backends._instances.pop("kubernetes", None)


def test_kubernetes_pods_are_created_concurrently_within_the_bound(fake, monkeypatch):
    monkeypatch.setattr(throttle, "CONCURRENCY", 8)
    fake.create_delay = 0.3
    with roving.Pool(16) as p:
        assert len(fake.creations) == 16
        most = _most_at_once(fake.creations)
        assert 2 <= most <= 8, (most, fake.creations)
        assert p.map(hp.square, range(32)) == [x * x for x in range(32)]


def test_kubernetes_rate_limit_is_retried_with_backoff_and_the_servers_words_logged(fake, caplog):
    fake.refuse_pods = 2
    caplog.set_level(logging.WARNING, logger="roving.backends.throttle")
    with roving.Pool(3) as p:
        assert p.map(hp.square, range(6)) == [0, 1, 4, 9, 16, 25]
        assert len(fake.creations) == 5  # 3 pods, 2 refused first
    busy = [r.getMessage() for r in caplog.records if "busy" in r.getMessage()]
    assert len(busy) == 2 and all("HTTP 429" in m and "too many requests" in m for m in busy), busy


def test_start_many_reports_each_refusal_and_a_refused_process_can_be_started_again(monkeypatch):
    from roving.process import start_many
    import helpers_targets as ht

    roving.init(backend="local")
    backend = backends.get("local")
    real, seen = backend.create_job, []

    def create_job(spec):  # the default submit_many asks for each job in turn
        seen.append(spec.name)
        if spec.name == "second" and seen.count("second") == 1:
            raise OSError("the cluster said no to second")
        return real(spec)

    monkeypatch.setattr(backend, "create_job", create_job)
    procs = [roving.Process(target=ht.exit_with, args=(i,), name=n) for i, n in enumerate(["first", "second", "third"])]
    errors = start_many(procs)
    assert [str(e) if e else None for e in errors] == [None, "the cluster said no to second", None]
    assert seen == ["first", "second", "third"]
    assert procs[1].job is None
    procs[1].start()  # refused once, started now
    for p in procs:
        p.join(T)
    assert [p.exitcode for p in procs] == [0, 1, 2]
    with pytest.raises(ValueError, match="several backends"):
        start_many([_with_backend("local"), _with_backend("slurm")])


def _with_backend(name):
    import helpers_targets as ht

    roving.init(backend=name)
    return roving.Process(target=ht.return_normally)
