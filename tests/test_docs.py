"""The documentation site builds strictly, has a reference entry for every public name, a CLI page that
is the command's own parsers, and guides whose runnable examples run.

The build is ``mkdocs build --strict`` (mkdocs.yml): a broken link, a missing page, an anchor that does not
exist or a docstring that does not render is a warning, and a warning fails it. A guide's Python example
preceded by ``<!-- runnable -->`` is run here as a program of its own (on the local backend); an example
that needs a cluster is shown unmarked.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import roving
import roving.futures
import roving.pipeline

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RUNNABLE = re.compile(r"<!-- runnable -->\n```python\n(.*?)```", re.S)


def _env() -> dict:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, env=_env(), cwd=config.parent, timeout=600)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = _build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


def test_the_site_builds_strictly_with_every_page_of_the_navigation(site):
    assert (site / "index.html").is_file()
    for page in ["getting-started", "guides/pool", "guides/untrusted-nodes", "reference/roving", "reference/cli",
                 "reference/errors", "ARCHITECTURE", "benchmarks", "contributing"]:
        assert (site / page / "index.html").is_file(), f"{page} was not built"


def test_a_broken_link_fails_the_strict_build(tmp_path):
    """The strictness is the configuration's, not luck: the same site with one broken link does not build."""
    copy = tmp_path / "repo"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copytree(ROOT / "scripts", copy / "scripts")
    shutil.copytree(ROOT / "benchmarks", copy / "benchmarks", ignore=shutil.ignore_patterns("*.png", "results"))
    (copy / "src").symlink_to(ROOT / "src")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    guide = copy / "docs" / "guides" / "pool.md"
    guide.write_text(guide.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    done = _build(copy / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stdout + done.stderr


#: the training names roving.pipeline imports on first use, each documented where it is defined
TRAINING = {"Llama": "roving.pipeline.model.Llama", "LlamaConfig": "roving.pipeline.presets.LlamaConfig",
            "Stage": "roving.pipeline.stages.Stage", "TrainConfig": "roving.pipeline.run.runspec.TrainConfig",
            "prepare": "roving.pipeline.run.runspec.prepare", "Trainer": "roving.pipeline.run.trainer.Trainer",
            "train": "roving.pipeline.run.trainer.run"}


def _public_names() -> list[str]:
    names = [f"roving.{n}" for n in roving.__all__] + [f"roving.futures.{n}" for n in roving.futures.__all__]
    return names + [f"roving.pipeline.{n}" for n in roving.pipeline.__all__] + list(TRAINING.values())


def test_the_training_names_are_the_ones_roving_pipeline_imports_on_first_use():
    import importlib

    for name, path in TRAINING.items():
        module, _, attr = path.rpartition(".")
        assert getattr(roving.pipeline, name) is getattr(importlib.import_module(module), attr), name


def test_every_public_name_has_a_rendered_reference_entry(site):
    html = "".join((site / "reference" / page / "index.html").read_text()
                   for page in ("roving", "futures", "pipeline"))
    missing = [n for n in _public_names() if f'id="{n}"' not in html]
    assert not missing, f"no reference entry for {missing}"
    assert len(_public_names()) > 70  # the three surfaces, not an empty list


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


def test_the_cli_page_has_every_command_and_option_of_the_roving_command(site):
    from roving.cli import build_parser

    page = (site / "reference" / "cli" / "index.html").read_text()
    parsers = _parsers(build_parser())
    assert len(parsers) > 10
    for p in parsers:
        assert f"<code>{p.prog}</code>" in page, f"no section for {p.prog}"
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue  # every command's -h/--help, said once on the page's head
            for option in action.option_strings:
                assert f"<code>{option}</code>" in page, f"{p.prog} {option} is not on the CLI page"


def _examples() -> list[tuple[str, str]]:
    found = []
    for md in sorted(DOCS.rglob("*.md")):
        for i, code in enumerate(RUNNABLE.findall(md.read_text())):
            found.append((f"{md.relative_to(DOCS)}#{i}", code))
    return found


def test_the_guides_have_runnable_examples():
    pages = {name.split("#")[0] for name, _ in _examples()}
    assert {"getting-started.md", "guides/pool.md", "guides/planning.md", "guides/training.md"} <= pages


@pytest.mark.parametrize("name,code", _examples(), ids=[name for name, _ in _examples()])
def test_each_runnable_example_of_the_guides_runs(name, code, tmp_path):
    program = tmp_path / "example.py"
    program.write_text(code)
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # an example reads the run files as a user's clone has them
    env = _env()
    env["ROVING_BACKEND"] = "local"
    done = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
