"""Checkpoints are read with torch's weights-only loader: a file that holds anything but tensors and
plain data is refused, naming the file and the type, and none of its code runs (issue 18, finding 2)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from roving.pipeline.runtime import checkpoint_file
from roving.pipeline.errors import PlanError
from roving.pipeline.errors import InferenceError
from roving.pipeline.run.inference import load_checkpoint
from roving.pipeline.run.trainer import Trainer, TrainConfig, prepare

CFG = dict(model="tiny", nodes=4, stages=2, skip=0.0, microbatches=4, samples=4, seq_len=32,
           iterations=4, eval_every=100, planner_budget=0.2, speed=1e-3, timeout=120)


class Payload:
    """Unpickling this creates ``marker``: a stand-in for code a planted checkpoint would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def malicious(tmp_path):
    marker = tmp_path / "payload-ran"
    path = tmp_path / "run.pt"
    torch.save({"format": 2, "stages": {0: Payload(marker)}, "iteration": 1}, path)
    return path, marker


def test_the_malicious_checkpoint_would_run_code_if_loaded_with_pickle(tmp_path):
    # The control: the file below is a real attack, so what stops it in the other tests is the loader.
    path, marker = malicious(tmp_path)
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_resume_refuses_a_checkpoint_holding_code_and_runs_none_of_it(tmp_path):
    path, marker = malicious(tmp_path)
    with pytest.raises(PlanError, match=rf"cannot resume: {path} holds a io\.open.*refused without running it"):
        Trainer(prepare(TrainConfig(**CFG, checkpoint=str(path), resume=True)))
    assert not marker.exists()


def test_pipeline_train_resume_command_refuses_it_with_a_clear_error(tmp_path):
    path, marker = malicious(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROVING_")}
    run = subprocess.run([sys.executable, "-m", "roving.cli", "pipeline", "train", "--model", "tiny", "--network",
                          "gcp12", "--nodes", "4", "--stages", "2", "--iterations", "4", "--checkpoint", str(path),
                          "--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert f"{path} holds a io.open" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert not marker.exists()


def test_eval_refuses_it_too_through_the_same_loader(tmp_path):
    path, marker = malicious(tmp_path)
    with pytest.raises(InferenceError, match=rf"{path} holds a io\.open"):
        load_checkpoint(path)
    assert not marker.exists()


def test_what_is_saved_is_plain_so_the_weights_only_loader_reads_it(tmp_path):
    state = {"model": {"w": torch.ones(2)}, "metrics": {"loss": np.float64(1.5), "n": np.int64(3),
                                                        "ok": np.bool_(True), "curve": np.arange(3)},
             "betas": (0.9, np.float32(0.95))}
    path = tmp_path / "ck.pt"
    with pytest.raises(checkpoint_file.CheckpointFileError, match="numpy"):  # as torch.save writes it
        torch.save(state, path)
        checkpoint_file.read(path)
    checkpoint_file.save(state, path)
    got = checkpoint_file.read(path)
    assert got["metrics"] == {"loss": 1.5, "n": 3, "ok": True, "curve": [0, 1, 2]}
    assert type(got["metrics"]["loss"]) is float and type(got["metrics"]["n"]) is int
    assert got["betas"] == (0.9, pytest.approx(0.95)) and torch.equal(got["model"]["w"], torch.ones(2))
    with pytest.raises(TypeError, match="cannot hold a .*Payload"):
        checkpoint_file.save({"x": Payload(tmp_path / "m")}, path)


def _written(tmp_path, **over):
    """A checkpoint with what `pipeline train` writes (format 2), and ``over`` changed."""
    state = {"format": 2, "model": {"w": torch.ones(1)}, "model_config": {"dim": 64},
             "config": {"stages": 2, "seq_len": 32, "samples": 4, "corpus": [], "val_fraction": 0.1,
                        "eval_batches": 2},
             "iteration": 3, "stages": {0: {}, 1: {}}, **over}
    path = tmp_path / "ck.pt"
    checkpoint_file.save(state, path)
    return path


def test_one_loader_checks_a_checkpoint_for_use_and_for_resuming(tmp_path):
    """checkpoint_file.load_checkpoint is what evaluation, generation and --resume read with: the same
    file-level checks, and with ``into`` those a resumed run needs, every refusal naming the file."""
    into = checkpoint_file.ResumeInto({"dim": 64}, stages=2, iterations=8)
    path = _written(tmp_path)
    assert checkpoint_file.load_checkpoint(path)["iteration"] == 3
    assert checkpoint_file.load_checkpoint(path, into=into)["stages"].keys() == {0, 1}
    for over, error in (({"model_config": {"dim": 32}}, "another model"),
                        ({"config": {**checkpoint_file.read(path)["config"], "stages": 3}}, "into 3 stages"),
                        ({"iteration": 8}, "nothing to resume: .* iteration 8 of 8"),
                        ({"format": 1}, "cannot resume: .* no per-stage optimizer state")):
        bad = _written(tmp_path, **over)
        checkpoint_file.load_checkpoint(bad)  # usable for evaluation all the same
        with pytest.raises(PlanError, match=error):
            checkpoint_file.load_checkpoint(bad, into=into)
    with pytest.raises(checkpoint_file.CheckpointFileError,
                       match=r"cannot resume: checkpoint .*nope\.pt does not exist"):
        checkpoint_file.load_checkpoint(tmp_path / "nope.pt", into=into)
    with pytest.raises(checkpoint_file.CheckpointFileError, match=r"checkpoint .* is a folder"):
        checkpoint_file.load_checkpoint(tmp_path)
    planted, marker = malicious(tmp_path)
    with pytest.raises(PlanError, match=rf"cannot resume: {planted} holds a io\.open.*refused without running it"):
        checkpoint_file.load_checkpoint(planted, into=into)
    assert not marker.exists()
