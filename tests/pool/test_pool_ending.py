"""A pool worker told it will end (a signal, a preemption notice, its lifetime; roving.pool._ending)
leaves well, on the local backend: it takes no more work, hands back what it has not started, finishes or
gives back what it runs within ``worker_grace``, a replacement starts at once, and none of it counts
against ``max_task_retries`` (the tests run with 1: one counted death would fail the item)."""
from __future__ import annotations

import os
import signal

import pytest

import helpers_pool as hp
import roving
from helpers_core import wait_until


def _started(marker_dir, x):
    return [n for n in os.listdir(marker_dir) if n.startswith(f"started-{x}-")]


def _pid_of(name: str) -> int:
    return int(name.rsplit("-", 1)[1])


def test_a_worker_sent_sigterm_mid_item_hands_it_back_at_its_deadline_and_no_retry_is_spent(tmp_path):
    roving.init(worker_grace=1.0, child_output="off")
    with roving.Pool(1, max_task_retries=1) as pool:
        long = pool.apply_async(hp.started_then_sleep, (0, 30, str(tmp_path)))
        assert wait_until(lambda: _started(tmp_path, 0), 60)
        first = _pid_of(_started(tmp_path, 0)[0])
        os.kill(first, signal.SIGTERM)  # as scancel or a pod's deletion would: the item cannot finish in 1 s
        assert wait_until(lambda: len(_started(tmp_path, 0)) == 2, 60), "the item was not run again"
        again = [_pid_of(n) for n in _started(tmp_path, 0) if _pid_of(n) != first]
        assert again and again[0] != first
        figures = pool._disp.figures()
        assert figures["ended_early"] == 1 and figures["retried"] == 0 and figures["handed_back"] == 1
        long.wait(0)  # still running on the replacement; not failed
        assert not long.ready()


def test_a_worker_finishes_its_item_within_the_grace_and_gives_back_what_it_had_not_started(tmp_path):
    roving.init(worker_grace=30.0, child_output="off")
    with roving.Pool(1, max_task_retries=1) as pool:
        running = pool.apply_async(hp.started_then_sleep, (0, 2, str(tmp_path)))
        assert wait_until(lambda: _started(tmp_path, 0), 60)
        queued = [pool.apply_async(hp.sleep_then_pid, (i, 0)) for i in range(1, 4)]
        first = _pid_of(_started(tmp_path, 0)[0])
        os.kill(first, signal.SIGUSR1)
        assert running.get(60) == (0, first)  # finished where it ran, within its grace
        later = [r.get(60) for r in queued]
        assert [x for x, _ in later] == [1, 2, 3]
        assert all(pid != first for _, pid in later)  # it took no more work once told
        assert pool._disp.figures()["retried"] == 0


def test_a_preemption_notice_file_ends_the_worker_well(tmp_path):
    notice = tmp_path / "preempted"
    roving.init(worker_grace=30.0, preemption_file=str(notice), child_output="off")
    with roving.Pool(1, max_task_retries=1) as pool:
        first = pool.apply(hp.getpid)
        notice.touch()  # every worker of this machine sees it: each leaves, and is replaced, until it goes
        assert wait_until(lambda: pool._disp.figures()["ended_early"] >= 1, 60)
        notice.unlink()
        assert wait_until(lambda: pool.apply(hp.getpid) != first, 60)
        assert pool._disp.figures()["retried"] == 0


def test_workers_of_a_short_lifetime_run_a_longer_map_with_every_result_once(tmp_path):
    roving.init(worker_lifetime=4.0, worker_grace=2.0, child_output="off")
    with roving.Pool(2, max_task_retries=1) as pool:
        done = pool.starmap(hp.sleep_then_pid, [(x, 0.2) for x in range(60)], chunksize=1)
        figures = pool._disp.figures()
    assert [x for x, _ in done] == list(range(60))
    assert len({pid for _, pid in done}) >= 3  # 6 s of work on 2 workers of 4 s: some were replaced
    assert figures["ended_early"] >= 1 and figures["retried"] == 0


def test_a_bad_signal_name_is_refused_naming_it():
    with pytest.raises(roving.ConfigError, match="end_signals.*no signal named 'BOGUS'"):
        roving.init(end_signals="TERM,BOGUS")


def test_a_preemption_notice_from_a_metadata_url_ends_the_worker_well():
    # a metadata service of our own on 127.0.0.1, answering as GCE's does: FALSE, then TRUE
    import http.server
    import threading

    said = {"body": b"FALSE"}

    class Metadata(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(said["body"])

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/computeMetadata/v1/instance/preempted"
        roving.init(worker_grace=30.0, preemption_url=url, child_output="off")
        with roving.Pool(1, max_task_retries=1) as pool:
            first = pool.apply(hp.getpid)
            assert pool._disp.figures()["ended_early"] == 0
            said["body"] = b"TRUE"
            assert wait_until(lambda: pool._disp.figures()["ended_early"] >= 1, 60)
            said["body"] = b"FALSE"
            assert wait_until(lambda: pool.apply(hp.getpid) != first, 60)
            assert pool._disp.figures()["retried"] == 0
    finally:
        server.shutdown()
        server.server_close()


def test_a_worker_that_says_it_will_end_once_its_pool_terminates_is_not_counted_as_ended_early():
    """Slurm's cancel, even ``scancel --signal=KILL``, sends SIGTERM before SIGKILL (and Kubernetes deletes
    a pod the same way), so a worker its own pool kills says it will end: once the pool terminates, that
    end is the pool's, not one that ended early (a time limit, a preemption). Here the pool is told it
    terminates as ``terminate`` tells it first, and its worker gets the SIGTERM such a kill sends."""
    roving.init(worker_grace=1.0, child_output="off")
    pool = roving.Pool(1, max_task_retries=1)
    try:
        pid = pool.apply(os.getpid)
        (worker,) = pool._disp.workers_now()
        pool._disp.terminating()
        os.kill(pid, signal.SIGTERM)
        assert wait_until(lambda: worker.ending, 60), "the worker did not say it would end"
        assert pool._disp.figures()["ended_early"] == 0
    finally:
        pool.terminate()
