"""The backends have one error base, an OSError, and each backend's kind is still where it was."""
from __future__ import annotations

import errno

import pytest

from roving import backends
from roving.backends import docker, errors, kubernetes, local, slurm
from roving.backends.slurm import step as slurm_step
from roving.backends.base import JobSpec, UnknownJobError


def test_each_backends_error_is_a_backend_error_and_an_os_error_importable_from_its_module():
    kinds = {docker: "DockerError", kubernetes: "KubernetesError", slurm: "SlurmError",
             slurm_step: "StepError", local: "LocalError"}
    for module, name in kinds.items():
        cls = getattr(module, name)
        assert cls is getattr(errors, name) is getattr(backends, name)
        assert issubclass(cls, errors.BackendError) and issubclass(cls, OSError), name
    assert issubclass(UnknownJobError, errors.BackendError) and issubclass(UnknownJobError, LookupError)


def test_a_local_job_whose_command_is_not_there_raises_a_local_error_naming_it_with_its_errno(tmp_path):
    spec = JobSpec(name="nowhere", command=[str(tmp_path / "no-such-program")], cwd=str(tmp_path), env={},
                   session=backends.JobSession("tag0", "S", "S_FILE"), output="off")
    with pytest.raises(errors.LocalError, match="cannot start nowhere .*no-such-program") as caught:
        local.LocalBackend().create_job(spec)
    assert caught.value.errno == errno.ENOENT
    assert isinstance(caught.value.__cause__, FileNotFoundError)
