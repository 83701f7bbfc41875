"""roving.observe (what the runtime publishes for the dashboard) and the /metrics text made of it."""
from __future__ import annotations

import gc
import threading

import roving
from roving import observe
from roving.dashboard import prometheus
from roving.dashboard.state import Views


def test_buffers_are_bounded_and_publishing_from_many_threads_loses_nothing_in_the_bounds():
    before = observe.events_since(0)
    last = before[-1]["seq"] if before else 0

    def publish(k):
        for i in range(500):
            observe.event("test", f"thread {k}", f"event {i}")

    threads = [threading.Thread(target=publish, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    new = observe.events_since(last)
    assert len(new) == observe.MAX_EVENTS  # 4000 published, the latest 2000 kept
    seqs = [e["seq"] for e in new]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    observe.output_lines("someone", [f"line {i}" for i in range(observe.MAX_LINES + 50)])
    observe.process_started("uid-x", "someone", "local", "1", {"cpu": 1})
    observe.process_ended("uid-x", -9)
    rec = next(p for p in observe.snapshot()["processes"] if p["name"] == "someone")
    assert len(rec["output"]) == observe.MAX_LINES and rec["output"][-1] == f"line {observe.MAX_LINES + 49}"
    assert rec["state"] == "failed" and rec["cause"] == "killed by signal 9" and rec["exitcode"] == -9


def test_a_pool_that_is_gone_is_shown_with_its_last_figures_and_no_workers():
    pool = roving.Pool(2)
    try:
        assert pool.map(abs, range(-10, 0)) == list(range(10, 0, -1))
        views = Views()
        mine = [p for p in views.state()["runtime"]["pools"] if p["id"] == pool._disp.pool_id]
        assert mine and mine[0]["done"] == 10 and mine[0]["failed"] == 0 and mine[0]["state"] == "RUN"
        pool_id = pool._disp.pool_id
    finally:
        pool.terminate()
        pool.join(60)
    del pool, mine
    gc.collect()
    gone = [p for p in observe.snapshot()["pools"] if p["id"] == pool_id]
    assert gone and gone[0]["state"] == "gone" and gone[0]["workers"] == [] and gone[0]["done"] == 10


def test_metrics_text_is_prometheus_exposition_format():
    state = {"runtime": {"processes": [{"state": "running"}, {"state": "failed"}, {"state": "running"}],
                         "pools": [{"id": 3, "done": 7, "failed": 1, "retried": 2, "lost": 1, "queued": 4,
                                    "running": 2, "workers": [{"state": "idle"}, {"state": "busy"}]}],
                         "events": [{"kind": "retry"}, {"kind": "retry"}, {"kind": 'we"ird'}]},
             "pipelines": [{"control": "/c", "iterations": [{"iteration": 0, "train_loss": 2.5, "seconds": 0.1}],
                            "nodes": [{"state": "alive"}, {"state": "dead"}]}]}
    text = prometheus.text(state)
    lines = text.splitlines()
    assert 'roving_processes{state="running"} 2.0' in lines
    assert 'roving_pool_items_done_total{pool="3"} 7.0' in lines
    assert 'roving_pool_workers_lost_total{pool="3"} 1.0' in lines
    assert 'roving_pool_workers{pool="3",state="busy"} 1.0' in lines
    assert 'roving_events{kind="we\\"ird"} 1.0' in lines
    assert 'roving_pipeline_train_loss{run="/c"} 2.5' in lines
    assert 'roving_pipeline_nodes{run="/c",state="dead"} 1.0' in lines
    for line in lines:  # every line a comment or NAME{labels} VALUE
        assert line.startswith(("# HELP ", "# TYPE ")) or float(line.rsplit(" ", 1)[1]) >= 0
    types = [ln.split()[2] for ln in lines if ln.startswith("# TYPE ")]
    assert len(types) == len(set(types)), "one TYPE line per metric family"


def test_resize_autoscale_and_worker_starts_are_events_of_their_pool():
    last = (observe.events_since(0) or [{"seq": 0}])[-1]["seq"]
    with roving.Pool((0, 2), idle_timeout=0.5) as pool:
        assert pool.map(abs, [-1, -2, -3, -4]) == [1, 2, 3, 4]
        pool.resize(1)
        source = f"pool {pool._disp.pool_id}"
    kinds = [(e["kind"], e["text"]) for e in observe.events_since(last) if e["source"] == source]
    assert any(k == "autoscale" and "more worker(s)" in t for k, t in kinds), kinds
    assert any(k == "worker-started" for k, _ in kinds), kinds
    assert ("resize", "resized to 1 worker(s)") in kinds
