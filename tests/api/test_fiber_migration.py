"""docs/fiber.md's examples (examples/fiber/*.py, each a Fiber-style program with ``import roving as
fiber``) run and print what the page says they show; every example the page names exists, and every file
there is named on the page."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "fiber"
PAGE = ROOT / "docs" / "fiber.md"


def run(name: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=180, cwd=str(ROOT), env={**os.environ})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_the_page_names_every_example_and_each_one_it_names_exists():
    named = set(re.findall(r"`examples/fiber/([a-z_]+\.py)`", PAGE.read_text()))
    assert named == {p.name for p in EXAMPLES.glob("*.py")}


def test_a_pool_map_runs_with_only_the_import_changed():
    out = run("estimate_pi.py", "100000")
    value = float(re.search(r"pi is about (\d\.\d+)", out).group(1))
    assert abs(value - 3.1416) < 0.05, out


def test_a_process_answers_through_a_queue_and_an_unjoined_child_runs_to_its_end():
    out = run("process_and_queue.py")
    assert "the child says 42" in out
    assert "hello from the child, never joined" in out


def test_meta_takes_memory_with_its_unit_and_refuses_fibers_bare_megabytes_naming_the_unit():
    out = run("resources.py")
    assert "squares: [0, 1, 4, 9, 16]" in out
    assert 'refused: roving.meta(): memory=1000 has no unit' in out and 'memory="1000M"' in out


def test_an_async_managers_proxy_runs_its_calls_in_the_order_made():
    out = run("async_manager.py")
    assert "results: [0, 0, 1, 1, 2, 2]" in out  # reset, then step, then step, on each of two proxies


def test_a_task_that_raises_is_returned_and_one_whose_worker_died_runs_again(tmp_path):
    out = run("errors.py", str(tmp_path))
    assert "the task's own error, returned: no threes" in out
    assert "a worker died and its task ran again: [0, 10, 20]" in out
    assert (tmp_path / "died").exists()
