"""A backend is a plug-in of four methods (create_job, job_status, terminate_job, logs), as a submitit
executor is: a backend that implements only those gets working defaults for the rest (waiting, a
sentinel, cancelling by id, refusing unknown ids). The backend here runs real subprocesses."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from typing import Dict

import pytest

from roving.backends import Backend, Job, JobSession, JobSpec, JobState, JobStatus, UnknownJobError

TIMEOUT = 30


class FourMethods(Backend):
    """The smallest backend: subprocesses, their status and their output, nothing more."""

    name = "four-methods"

    def __init__(self) -> None:
        self.procs: Dict[str, subprocess.Popen] = {}

    def create_job(self, spec: JobSpec) -> Job:
        proc = subprocess.Popen(spec.command, cwd=spec.cwd, env=spec.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        self.procs[str(proc.pid)] = proc
        return Job(self, str(proc.pid))

    def job_status(self, job: Job) -> JobStatus:
        code = self.procs[job.id].poll()
        return JobStatus(JobState.RUNNING) if code is None else JobStatus(JobState.EXITED, code)

    def terminate_job(self, job: Job, force: bool = False) -> None:
        proc = self.procs.get(job.id)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL if force else signal.SIGTERM)

    def logs(self, job: Job) -> str:
        proc = self.procs.get(job.id)
        if proc is None:
            raise UnknownJobError(f"no job {job.id} here")
        assert proc.stdout is not None
        return proc.stdout.read().decode() if proc.poll() is not None else ""


def _spec(tmp_path, code: str) -> JobSpec:
    return JobSpec(name="j", command=[sys.executable, "-c", code], cwd=str(tmp_path), env=dict(os.environ),
                   session=JobSession("tag0", "S", "S_FILE"), output="off")


def test_the_interface_a_backend_must_implement_is_four_methods():
    assert Backend.__abstractmethods__ == {"create_job", "job_status", "terminate_job", "logs"}


def test_a_four_method_backend_waits_for_a_job_and_reads_its_exit_code_and_output(tmp_path):
    backend = FourMethods()
    job = backend.create_job(_spec(tmp_path, "print('hello from the job'); raise SystemExit(3)"))
    assert backend.wait(job, TIMEOUT) == 3
    assert "hello from the job" in backend.logs(job)


def test_a_four_method_backend_gets_a_sentinel_that_becomes_readable_when_the_job_ends(tmp_path):
    backend = FourMethods()
    job = backend.create_job(_spec(tmp_path, "raise SystemExit(0)"))
    fd = backend.sentinel(job)
    try:
        readable, _, _ = select.select([fd], [], [], TIMEOUT)
        assert readable == [fd] and backend.job_status(job).state is JobState.EXITED
    finally:
        os.close(fd)


def test_a_four_method_backend_cancels_jobs_by_id_and_refuses_ids_it_cannot_list(tmp_path):
    backend = FourMethods()
    job = backend.create_job(_spec(tmp_path, "import time; time.sleep(600)"))
    # it lists no jobs (list_jobs is one of the defaults), so `roving cancel` would refuse every id
    assert backend.list_jobs() == [] and backend.unknown_ids([job.id]) == [job.id]
    backend.cancel_ids([job.id, "no-such-job"])  # terminate_job by id; the unknown one is ignored
    assert backend.wait(job, TIMEOUT) == -signal.SIGKILL
    with pytest.raises(UnknownJobError, match="no job nowhere"):
        backend.logs(Job(backend, "nowhere"))
