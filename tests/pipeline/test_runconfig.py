"""The run configuration: TrainConfig's sections, the TOML run file that mirrors them, the shipped
example run files, and the errors for bad run files (each naming the file and the key)."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from roving.cli import main
from roving.pipeline.errors import PlanError
from roving.pipeline.planning.network import build_network
from roving.pipeline.run.runconfig import SECTION_OF, SECTIONS, TrainConfig, flatten
from roving.pipeline.stages import layer_ranges

EXAMPLES = sorted((Path(__file__).parents[2] / "examples" / "configs").glob("*.toml"))


def test_every_field_is_in_exactly_one_section_and_the_defaults_are_the_sections():
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    in_sections = [f.name for kind in SECTIONS.values() for f in dataclasses.fields(kind)]
    assert sorted(fields) == sorted(in_sections) and len(set(in_sections)) == len(in_sections)
    assert set(SECTIONS) == {"model", "data", "plan", "optim", "faults", "checkpoint", "run", "verify"}
    cfg = TrainConfig()
    for name, kind in SECTIONS.items():
        assert cfg.section(name) == kind()
    assert SECTION_OF["lr"] == "optim" and SECTION_OF["dead_after"] == "faults"
    with pytest.raises(KeyError, match="no section 'optimizer'"):
        cfg.section("optimizer")


def test_flat_keyword_arguments_and_attributes_still_work():
    cfg = TrainConfig(lr=1e-3, stages=4, restart=True)
    assert (cfg.lr, cfg.stages, cfg.restart) == (1e-3, 4, True)
    assert cfg.section("optim").lr == 1e-3 and cfg.section("faults").restart is True
    assert dataclasses.asdict(cfg)["lr"] == 1e-3, "a checkpoint's config stays flat"


def test_a_run_file_in_sections_equals_the_same_keys_at_the_top_level(tmp_path):
    sectioned = tmp_path / "s.toml"
    sectioned.write_text('[model]\nmodel = "tiny"\n[plan]\nnodes = 4\nstages = 2\nskip = 0.0\n'
                         '[optim]\nlr = 1e-3\n[checkpoint]\ncheckpoint = "c.pt"\nresume = true\n')
    flat = tmp_path / "f.toml"
    flat.write_text('model = "tiny"\nnodes = 4\nstages = 2\nskip = 0.0\nlr = 1e-3\n'
                    'checkpoint = "c.pt"\nresume = true\n')
    a, b = TrainConfig.from_toml(str(sectioned)), TrainConfig.from_toml(str(flat))
    assert a == b and a.lr == 1e-3 and a.nodes == 4 and a.checkpoint == "c.pt" and a.resume
    assert a != TrainConfig()


def test_as_sections_round_trips():
    cfg = TrainConfig(lr=2e-3, nodes="nodes.json", corpus=["a.txt"], emulate_network=True)
    doc = cfg.as_sections()
    assert set(doc) == set(SECTIONS) and doc["optim"]["lr"] == 2e-3 and doc["plan"]["nodes"] == "nodes.json"
    assert TrainConfig.from_dict(doc) == cfg


def test_flags_override_the_run_file(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[optim]\nlr = 1e-3\niterations = 7\n")
    cfg = TrainConfig.from_toml(str(f), lr=5e-3, iterations=None)
    assert cfg.lr == 5e-3 and cfg.iterations == 7


@pytest.mark.parametrize("text, words", [
    ("[optimizer]\nlr = 1e-3\n", "unknown section [optimizer]; the sections are [model], [data]"),
    ("[optim]\nlearning_rate = 1e-3\n", "unknown key(s) [optim] learning_rate; [optim] has iterations, lr"),
    ("learning_rate = 1e-3\n", "unknown key(s) learning_rate"),
    ("[plan]\nlr = 1e-3\n", "lr belongs in [optim], not in [plan]"),
    ("lr = 1e-3\n[optim]\nlr = 2e-3\n", "lr is given twice (lr and [optim] lr)"),
    ('[optim]\nlr = "fast"\n', "[optim] lr must be a number, got 'fast' (str)"),
    ("[plan]\nstages = 2.5\n", "[plan] stages must be an integer, got 2.5 (float)"),
    ("[plan]\nstages = true\n", "[plan] stages must be an integer, got True (bool)"),
    ('[faults]\nrestart = "yes"\n', "[faults] restart must be true or false, got 'yes' (str)"),
    ("[data]\ncorpus = [1, 2]\n", "[data] corpus must be a list of strings, got [1, 2] (list)"),
    ("[plan]\nnodes = 1.5\n", "[plan] nodes must be an integer, a string (a file) or a list of node tables"),
    ("optim = 3\n", "[optim] is a section: give it as a table of keys, got 3"),
    ("[plan\n", "not valid TOML"),
])
def test_bad_run_files_are_clear_errors_naming_the_file_and_the_key(tmp_path, text, words):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(PlanError) as err:
        TrainConfig.from_toml(str(f))
    assert str(err.value).startswith(f"{f}: ") and words in str(err.value), str(err.value)


def test_a_missing_run_file_is_a_clear_error(tmp_path):
    with pytest.raises(PlanError, match="config file .*nope.toml does not exist"):
        TrainConfig.from_toml(str(tmp_path / "nope.toml"))
    with pytest.raises(PlanError, match="a run file is a table of sections"):
        flatten([1, 2], "x.toml")


def test_the_train_command_reports_a_bad_run_file_and_starts_nothing(tmp_path, capsys):
    f = tmp_path / "bad.toml"
    f.write_text("[plan]\nlr = 1e-3\n")
    assert main(["pipeline", "train", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"{f}: lr belongs in [optim], not in [plan]" in err


def test_examples_are_shipped():
    assert {p.name for p in EXAMPLES} >= {"skippipe.toml", "dtfm.toml", "faults.toml", "benchmark.toml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_shipped_run_file_loads_and_validates(path):
    cfg = TrainConfig.from_toml(str(path))
    doc = __import__("tomllib").loads(path.read_text())
    assert set(doc) <= set(SECTIONS) and all(isinstance(v, dict) for v in doc.values()), "written in sections"
    for name, table in doc.items():
        for key, value in table.items():
            assert getattr(cfg, key) == value, (name, key)
    layer_ranges(cfg.model_config(), cfg.stages)  # the model fits the stages
    net = build_network(cfg.network, cfg.nodes, memory=cfg.in_flight)
    assert len(net.nodes) >= cfg.stages


def test_the_default_run_file_is_the_default_run():
    """skippipe.toml writes out the run `roving pipeline train` makes with no arguments (its outputs
    aside)."""
    cfg = TrainConfig.from_toml(str(next(p for p in EXAMPLES if p.name == "skippipe.toml")))
    assert dataclasses.replace(cfg, metrics="", plot="") == TrainConfig()


def test_the_verify_section_defaults_to_training_as_before_and_reads_its_keys(tmp_path):
    cfg = TrainConfig()
    assert (cfg.mode, cfg.aggregation, cfg.adversaries, cfg.verifiers) == ("off", "mean", "", 2)
    f = tmp_path / "v.toml"
    f.write_text('[verify]\nmode = "spot"\nverify_rate = 0.1\nverifiers = 1\nconfirm_rate = 0.5\n'
                 'tolerance = 1e-2\naggregation = "median"\n'
                 'adversaries = "n01:scale:3:0.5"\n')
    v = TrainConfig.from_toml(str(f)).section("verify")
    assert (v.mode, v.verify_rate, v.verifiers, v.confirm_rate, v.tolerance, v.aggregation, v.adversaries) == \
        ("spot", 0.1, 1, 0.5, 1e-2, "median", "n01:scale:3:0.5")
    assert SECTION_OF["aggregation"] == "verify"


@pytest.mark.parametrize("key, words", [
    ('mode = "paranoid"', "mode ([verify]) must be one of off, screen, spot, full, got 'paranoid'"),
    ('aggregation = "krum"', "aggregation must be one of mean, trimmed, median, clip, got 'krum'"),
    ("verify_rate = 1.5", "verify_rate must be a chance from 0 to 1, got 1.5"),
    ("tolerance = -1", "tolerance must be a relative difference >= 0, got -1"),
    ("confirm_rate = 2", "confirm_rate must be a chance from 0 to 1, got 2"),
    ("verifiers = 0", "verifiers must be a whole number of replicas >= 1, got 0"),
    ("verifiers = 1.5", "[verify] verifiers must be an integer, got 1.5 (float)"),
    ('adversaries = "n01:evil"', "adversaries: 'evil' in 'n01:evil' is not a kind"),
])
def test_bad_verify_keys_are_clear_errors(tmp_path, key, words):
    f = tmp_path / "bad.toml"
    f.write_text(f"[verify]\n{key}\n")
    with pytest.raises(PlanError) as err:
        TrainConfig.from_toml(str(f))
    assert words in str(err.value), str(err.value)


@pytest.mark.parametrize("flags, words", [
    (["--verify-rate", "2"], "verify_rate must be a chance from 0 to 1, got 2.0"),
    (["--adversaries", "n01:evil"], "'evil' in 'n01:evil' is not a kind"),
    (["--verify", "spot", "--tolerance", "-1"], "tolerance must be a relative difference >= 0"),
    (["--confirm-rate", "-0.5"], "confirm_rate must be a chance from 0 to 1, got -0.5"),
    (["--verify", "spot", "--verifiers", "0"], "verifiers must be a whole number of replicas >= 1, got 0"),
])
def test_the_verify_flags_reach_the_run_config_and_bad_values_start_nothing(capsys, flags, words):
    assert main(["pipeline", "train", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err, err


def test_the_run_configuration_is_read_without_pytorch_or_the_runtime():
    """A run's configuration is checked (a run file parsed, every field validated) by a process that has
    imported neither PyTorch nor any module of the runtime."""
    code = ("import sys\n"
            "from roving.pipeline.run.runconfig import TrainConfig\n"
            "TrainConfig(model='tiny', stages=2, nodes=4, adversaries='n01:nan', fail_at='3:1').check()\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('roving.pipeline.runtime')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"imported by the configuration: {out.stdout.strip()}"


def test_the_route_rule_is_skippipes_unless_the_run_file_names_the_looser_one(tmp_path):
    assert TrainConfig().route_rule == "skippipe"
    f = tmp_path / "run.toml"
    f.write_text('[plan]\nroute_rule = "inversions"\n')
    assert TrainConfig.from_toml(str(f)).route_rule == "inversions"
    f.write_text('[plan]\nroute_rule = "any"\n')
    with pytest.raises(PlanError, match="route rule must be one of skippipe, inversions, got 'any'"):
        TrainConfig.from_toml(str(f))
