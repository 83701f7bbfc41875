"""Memory on the real Docker engine: a worker container started with ``--memory`` (the ``memory``
option) that a task takes past it is killed by the kernel, Docker says ``OOMKilled``, and the pool says
"out of memory" with the limit; two such kills in a row fail the task and no third container is given it."""
from __future__ import annotations

import os

import pytest

import helpers_backends as hb
import helpers_memory as hm
import roving

T = 120


@pytest.fixture(autouse=True)
def _docker():
    hb.require("docker")


def test_a_task_past_its_containers_memory_is_oomkilled_twice_then_fails_saying_out_of_memory(tmp_path):
    attempts = tmp_path / "attempts"
    attempts.mkdir()
    options = hb.OPTIONS["docker"]
    roving.init(backend="docker", memory="128M", heartbeat_interval=0.2,
                **{**options, "docker_volumes": [*options["docker_volumes"], f"{tmp_path}:{tmp_path}"]})
    with roving.Pool(2, max_task_retries=5) as pool:
        assert pool.apply(hm.use_for_a_while, (16, 0.5)) > 0  # a task within the limit runs
        with pytest.raises(roving.OutOfMemoryError) as caught:
            pool.apply(hm.hog, (400, str(attempts)))
        err = caught.value
        assert "out of memory" in str(err) and "limit 128 MiB" in str(err), str(err)
        assert err.limit == 128 * hm.MiB
        assert len(os.listdir(attempts)) == 2, "a third container was given the task"
        figures = pool._disp.figures()
        assert figures["oom_kills"] == 2
        workers = [w for w in figures["workers"] if w["memory_limit"] is not None]
        assert all(w["memory_limit"] == 128 * hm.MiB for w in workers)
        assert len(pool.map(hm.pid, range(4))) == 4  # the pool goes on, with new containers
    assert len(os.listdir(attempts)) == 2
