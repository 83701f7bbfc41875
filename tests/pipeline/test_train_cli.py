"""`roving pipeline train`: a short run writes metrics, a plot and a checkpoint; bad input exits early."""

import json

import torch

from roving.cli import main


def test_train_command_writes_metrics_plot_and_checkpoint(tmp_path, capsys):
    conf = tmp_path / "run.toml"
    conf.write_text('model = "tiny"\nnodes = 4\nstages = 3\nmicrobatches = 4\nseq_len = 32\n'
                    'eval_batches = 2\nplanner_budget = 0.2\nspeed = 0.001\n')
    out = tmp_path / "m.json"
    rc = main(["pipeline", "train", "--config", str(conf), "--iterations", "2", "--eval-every", "1",
               "--skip", "0.5", "--metrics", str(out), "--plot", str(tmp_path / "loss.png"),
               "--checkpoint", str(tmp_path / "ck.pt")])
    assert rc == 0
    shown = capsys.readouterr().out
    assert "iteration    2/2" in shown and "validation loss" in shown
    m = json.loads(out.read_text())
    assert [r["iteration"] for r in m["iterations"]] == [0, 1]
    for r in m["iterations"]:
        assert r["train_loss"] > 0 and r["seconds"] > 0 and r["predicted_seconds"] > 0
    assert [e["iteration"] for e in m["evaluations"]] == [0, 1, 2]
    assert all(e["perplexity"] > 1 for e in m["evaluations"])
    assert m["config"]["skip"] == 0.5 and m["config"]["stages"] == 3  # flag and file both applied
    assert (tmp_path / "loss.png").stat().st_size > 1000
    ck = torch.load(tmp_path / "ck.pt")
    assert ck["iteration"] == 2 and "tok_embeddings.weight" in ck["model"]


def test_bad_input_exits_with_a_clear_error_before_nodes_start(tmp_path, capsys):
    conf = tmp_path / "run.toml"
    conf.write_text('model = "tiny"\nlearning_rate = 0.1\n')
    assert main(["pipeline", "train", "--config", str(conf)]) == 2
    assert "unknown key(s) learning_rate" in capsys.readouterr().err
    assert main(["pipeline", "train", "--nodes", "2", "--stages", "3"]) == 2
    assert "2 node(s) but the model is split into 3 stages" in capsys.readouterr().err
    assert main(["pipeline", "train", "--refine-budget", "-1"]) == 2
    assert "refine_budget must be a number of seconds >= 0, got -1.0" in capsys.readouterr().err


def test_train_with_no_arguments_says_what_it_resolved_before_it_starts(monkeypatch, capsys):
    """The defaults filled in (model, network, nodes, stages, skip, iterations, backend) are on stderr
    before the run starts: the run itself is replaced here, so nothing trains."""
    import roving.pipeline.run.trainer as trainer

    seen = []

    def fake_run(cfg, progress=None):
        seen.append(capsys.readouterr().err)
        return {"iterations": [], "predicted_s": 0.0}

    monkeypatch.setattr(trainer, "run", fake_run)
    assert main(["pipeline", "train"]) == 0
    assert len(seen) == 1
    err = seen[0]
    assert "training tiny on network gcp12: 6 nodes, 3 stages, skippipe, skip 0.33, 50 iterations" in err
    assert "backend local" in err and "flags and defaults" in err
    assert main(["pipeline", "train", "--backend", "slurm", "--stages", "2", "--iterations", "7",
                 "--schedule", "dtfm", "--skip", "0"]) == 0
    assert "2 stages, dtfm (full pipelines), 7 iterations, backend slurm" in seen[1]
