import json

from roving.cli import main


def test_pipeline_plan_writes_a_plan_with_every_baseline(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["pipeline", "plan", "--network", "aws10", "--nodes", "8", "--stages", "4", "--skip", "0.34",
               "--microbatches", "8", "--budget", "0.4", "--fail", "n01", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert set(doc["iteration_time_s"]) == {"skippipe", "full_pipeline", "full_pipeline_planned", "random_skip"}
    assert all(v > 0 for v in doc["iteration_time_s"].values())
    assert len(doc["paths"]) == 8 and {"origin", "nodes"} <= set(doc["paths"][0])
    assert doc["planner_seconds"] > 0 and len(doc["allocation"]) == 8
    assert all("n01" not in (p["origin"], *p["nodes"]) for p in doc["replan"]["paths"])
    assert "skippipe" in capsys.readouterr().out


def test_pipeline_plan_draws_a_gantt_chart(tmp_path):
    png = tmp_path / "g.png"
    rc = main(["pipeline", "plan", "--network", "gcp12", "--nodes", "4", "--stages", "2", "--skip", "0",
               "--microbatches", "4", "--budget", "0.1", "--json", str(tmp_path / "p.json"), "--gantt", str(png)])
    assert rc == 0 and png.read_bytes()[:4] == b"\x89PNG"


def test_bad_network_file_is_reported_as_error_with_exit_code_2(tmp_path, capsys):
    bad = tmp_path / "net.json"
    bad.write_text(json.dumps({"regions": ["x", "y"],
                               "links": [{"a": "x", "b": "y", "latency_ms": 3, "bandwidth": 0}]}))
    rc = main(["pipeline", "plan", "--network", str(bad), "--nodes", "4", "--stages", "2", "--skip", "0",
               "--json", str(tmp_path / "o.json")])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bandwidth must be positive" in err
    assert not (tmp_path / "o.json").exists()


def test_too_few_nodes_and_too_much_skip_are_errors(tmp_path, capsys):
    base = ["pipeline", "plan", "--network", "gcp12", "--json", str(tmp_path / "o.json")]
    assert main(base + ["--nodes", "3", "--stages", "4", "--skip", "0"]) == 2
    assert "cannot hold 4 stages" in capsys.readouterr().err
    assert main(base + ["--nodes", "6", "--stages", "3", "--skip", "0.9"]) == 2
    assert "leaves no stage besides stage 0" in capsys.readouterr().err
    assert main(base + ["--nodes", "6", "--stages", "3", "--skip", "0", "--memory", "0"]) == 2
    assert "too small for any plan" in capsys.readouterr().err


def test_pipeline_plan_by_evaluation_count_writes_the_same_plan_twice(tmp_path, capsys):
    docs = []
    for i in range(2):
        out = tmp_path / f"plan{i}.json"
        rc = main(["pipeline", "plan", "--network", "gcp12", "--nodes", "10", "--stages", "4", "--skip", "0.34",
                   "--microbatches", "10", "--budget", "4", "--evals", "300", "--json", str(out)])
        assert rc == 0
        docs.append(json.loads(out.read_text()))
    assert docs[0]["paths"] == docs[1]["paths"] and docs[0]["allocation"] == docs[1]["allocation"]
    assert docs[0]["iteration_time_s"]["skippipe"] == docs[1]["iteration_time_s"]["skippipe"]
    rc = main(["pipeline", "plan", "--network", "gcp12", "--nodes", "10", "--stages", "4", "--skip", "0.34",
               "--evals", "0", "--json", str(tmp_path / "x.json")])
    assert rc == 2 and "--evals must be a positive count" in capsys.readouterr().err


def test_gantt_rows_name_each_nodes_stage_and_tasks_their_microbatch(tmp_path, monkeypatch):
    """The drawn chart labels each row with its node's stage and each wide enough task with its
    microbatch (the figure is inspected as it is saved)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from roving.pipeline import Plan, Route, build_network, model_preset, simulate
    from roving.pipeline.run.plan_cli import draw_gantt
    net = build_network("gcp12", 3)
    names = net.names
    p = Plan(3, 0.0, {names[0]: 0, names[1]: 1, names[2]: 2},
             [Route(names[0], (names[1], names[2]), (1, 2)) for _ in range(2)])
    result = simulate(net, model_preset("llama-1.5b-skippipe"), p)
    seen = {}

    def capture(fig, *args, **kwargs):
        ax = fig.axes[0]
        seen["rows"] = [t.get_text() for t in ax.get_yticklabels()]
        seen["texts"] = [t.get_text() for t in ax.texts]

    monkeypatch.setattr(Figure, "savefig", capture)
    draw_gantt(result, str(tmp_path / "g.png"), p.allocation)
    assert seen["rows"] == [f"{names[0]} (stage 0)", f"{names[1]} (stage 1)", f"{names[2]} (stage 2)"]
    # tasks at least 1.2% of the makespan wide carry their microbatch id: here every forward and
    # backward (the short loss tasks are left bare)
    tasks = [e for evs in result.timeline.values() for e in evs if e.kind.startswith("compute")]
    wide = [e for e in tasks if e.end - e.start >= 0.012 * result.makespan]
    assert {e.kind for e in wide} == {"compute-fwd", "compute-bwd"} and len(wide) == 2 * 2 * 3
    assert sorted(seen["texts"]) == sorted(str(e.microbatch) for e in wide)


def test_pipeline_plan_tells_stderr_how_the_search_goes(tmp_path, capsys):
    """A plan takes its whole budget and the baselines half as much again: the search's phases, then
    the baselines, show on stderr as they happen (stdout keeps the results)."""
    rc = main(["pipeline", "plan", "--network", "gcp12", "--nodes", "10", "--stages", "4", "--skip", "0.34",
               "--microbatches", "10", "--budget", "2", "--json", str(tmp_path / "p.json")])
    assert rc == 0
    cap = capsys.readouterr()
    lines = cap.err.splitlines()
    assert lines[0].startswith("planning 10 microbatches on 10 nodes, 4 stages, skip 0.34 (2 s)")
    phases = [ln.split("] ", 1)[1].split(" ")[0] for ln in lines if ln.startswith("skippipe [")]
    assert phases[0] == "allocations" and phases[-1] == "done:" and "race" in phases
    done = next(ln for ln in lines if ln.startswith("skippipe [") and "done:" in ln)
    predicted = json.loads((tmp_path / "p.json").read_text())["iteration_time_s"]["skippipe"]
    assert f"done: {predicted:.2f} s per iteration" in done
    assert lines.index(done) < next(i for i, ln in enumerate(lines) if ln.startswith("baselines: "))
    assert "skippipe [" not in cap.out


def test_pipeline_plan_by_evaluation_count_prints_the_same_baselines_whatever_the_budget(tmp_path, capsys):
    """With --evals, DT-FM's allocation search (full_pipeline) is bounded by its evaluations, not by the
    clock: a budget eight times larger (what a loaded machine amounts to, the other way round) changes
    no baseline figure. The budgets are ceilings far above what 500 evaluations take (well under a second
    on an idle machine), so that a loaded machine does not reach them either: at 2 s, a load of 50 on 2
    cores cut the baselines' search after 193 evaluations."""
    docs, printed = [], []
    for budget in ("20", "160"):
        out = tmp_path / f"plan{budget}.json"
        rc = main(["pipeline", "plan", "--network", "gcp12", "--nodes", "20", "--stages", "6", "--skip", "0.33",
                   "--microbatches", "20", "--budget", budget, "--evals", "500", "--json", str(out)])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        assert "stopped at" not in captured.err  # the clock did not cut a search short
        docs.append(json.loads(out.read_text())["iteration_time_s"])
        printed.append([line for line in captured.out.splitlines() if "planner" not in line])
    assert docs[0] == docs[1]
    assert docs[0]["full_pipeline"] is not None
    assert printed[0] == printed[1] and any("full_pipeline:" in line for line in printed[0])


def _one_error_line(capsys):
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_network_and_nodes_files_of_the_wrong_shape_are_one_line_errors_naming_the_file(tmp_path, capsys):
    base = ["pipeline", "plan", "--stages", "2", "--skip", "0", "--budget", "0.2", "--json", str(tmp_path / "o.json")]
    cases = [("[1, 2]", "network", "a network file is a JSON object with regions and links, got a list"),
             ('{"regions": "eu"}', "network", "regions must be a list of region names, got a string"),
             ('{"links": {"a": 1}}', "network", "links must be a list of objects"),
             ('{"links": [], "regions": ["a"], "intra": 3}', "network", "intra must be an object"),
             ("[1]", "nodes", "a nodes file is a JSON list of objects"),
             ('"eu"', "nodes", "got a string")]
    for text, which, words in cases:
        bad = tmp_path / f"{which}.json"
        bad.write_text(text)
        net, nodes = (str(bad), "4") if which == "network" else ("gcp12", str(bad))
        assert main(base + ["--network", net, "--nodes", nodes]) == 2
        err = _one_error_line(capsys)
        assert str(bad) in err and words in err, err


def test_outputs_are_checked_before_any_search(tmp_path, capsys):
    """A plan whose --json (or --gantt) cannot be written fails at once, naming the option and the path:
    the budget here is long, and the command must not spend it."""
    import time

    (tmp_path / "afile").write_text("x")
    base = ["pipeline", "plan", "--network", "gcp12", "--nodes", "6", "--stages", "3", "--skip", "0",
            "--budget", "600"]
    for extra, words in (
            (["--json", str(tmp_path / "missing" / "dir" / "out.json")], "folder"),
            (["--json", str(tmp_path)], "is a folder, not a file"),
            (["--json", str(tmp_path / "afile" / "out.json")], "is a file, not a folder"),
            (["--json", str(tmp_path / "o.json"), "--gantt", str(tmp_path / "nope" / "g.png")], "--gantt")):
        t0 = time.monotonic()
        assert main(base + extra) == 2
        assert time.monotonic() - t0 < 60  # not the 600 s budget
        err = _one_error_line(capsys)
        assert words in err and extra[-1] in err, err
    assert main(["pipeline", "train", "--metrics", str(tmp_path / "afile" / "m.json")]) == 2
    err = _one_error_line(capsys)
    assert "--metrics" in err and "is a file, not a folder" in err
    assert main(["pipeline", "train", "--control", str(tmp_path / "afile")]) == 2
    assert "--control" in _one_error_line(capsys)
    assert main(["pipeline", "eval", "--checkpoint", str(tmp_path / "c.pt"), "--json", str(tmp_path)]) == 2
    assert "--json" in _one_error_line(capsys)


def test_generate_with_a_folder_as_checkpoint_says_it_is_a_folder(tmp_path, capsys):
    assert main(["pipeline", "generate", "--checkpoint", str(tmp_path), "--prompt", "hi"]) == 2
    err = _one_error_line(capsys)
    assert str(tmp_path) in err and "is a folder" in err and "does not exist" not in err


def test_status_with_a_malformed_status_file_is_one_line_naming_the_file(tmp_path, capsys):
    status = tmp_path / "status.json"
    for text, words in (("{", "Expecting property name"), ("[]", "holds a JSON list"),
                        ("{}", "lacks iterations_done"),
                        (('{"iterations_done": 1, "iterations": 2, "nodes": {"n0": "x"}, "missing_stages": [],'
                          ' "starting": [], "recent_events": []}'), "stage numbers"),
                        (('{"iterations_done": 1, "iterations": 2, "nodes": {}, "missing_stages": [],'
                          ' "starting": [], "recent_events": [3]}'), "recent_events")):
        status.write_text(text)
        assert main(["pipeline", "status", "--control", str(tmp_path)]) == 2
        err = _one_error_line(capsys)
        assert str(status) in err and words in err, err
    status.write_text('{"iterations_done": 1, "iterations": 2, "nodes": {"n0": 0}, "missing_stages": [],'
                      ' "starting": [], "recent_events": [], "train_loss": 2.5, "iteration_seconds": 0.1}')
    assert main(["pipeline", "status", "--control", str(tmp_path)]) == 0
    assert "iteration 1/2, train loss 2.5000" in capsys.readouterr().out


def test_pipeline_plan_runs_skippipes_geo_distributed_setting_by_its_preset(tmp_path):
    from roving.pipeline.planning.plan import route_allowed
    from roving.pipeline.presets import SKIPPIPE_GCP_ORDER
    out = tmp_path / "plan.json"
    rc = main(["pipeline", "plan", "--preset", "skippipe-geo-distributed", "--evals", "40", "--budget", "120",
               "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert (doc["preset"], doc["network"], doc["model"], doc["stages"], doc["skip"], doc["microbatches"]) == \
        ("skippipe-geo-distributed", "gcp12", "llama-1.5b-skippipe", 6, 0.33, 30)
    regions = [n["region"] for n in doc["nodes"]]
    assert len(regions) == 20 and regions == [SKIPPIPE_GCP_ORDER[i % 12] for i in range(20)]
    assert {n["memory_microbatches"] for n in doc["nodes"]} == {3}
    assert doc["route_rule"] == "skippipe" and all(route_allowed(p["stages"]) for p in doc["paths"])
    assert all(v is not None and v > 0 for v in doc["iteration_time_s"].values())


def test_flags_beside_a_preset_win_and_the_looser_route_rule_is_asked_by_name(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["pipeline", "plan", "--preset", "skippipe-5-clusters", "--nodes", "8", "--stages", "4",
               "--skip", "0.34", "--microbatches", "8", "--route-rule", "inversions", "--evals", "30",
               "--budget", "120", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    # the node count is the command line's, so the preset's region list does not apply: the file's order
    assert (doc["stages"], doc["microbatches"], len(doc["nodes"]), doc["route_rule"]) == (4, 8, 8, "inversions")
    assert {n["memory_microbatches"] for n in doc["nodes"]} == {3}
    base = ["pipeline", "plan", "--json", str(out)]
    assert main(base + ["--network", "gcp12", "--nodes", "8"]) == 2
    assert "pipeline plan needs --stages, --skip (or --preset, one of skippipe-5-clusters" in capsys.readouterr().err
