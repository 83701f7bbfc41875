"""The dashboard's pipeline view in a real headless Chromium, watching a `roving pipeline train --control`
run started elsewhere: a node killed with -9 is shown dead, the re-plan appears, the loss curve moves on."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import helpers_browser as hb
from helpers_core import roving_children
from roving.dashboard import Server, Views

TIMEOUT = 120


def _points(driver, chart: str) -> int:
    return int(driver.execute_script(
        f"const e = document.querySelector('#{chart}'); return e ? +e.dataset.points : 0") or 0)


def test_pipeline_view_shows_a_killed_node_dead_the_replan_and_the_loss_curve_moving(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROVING_")}
    control = tmp_path / "control"
    train = subprocess.Popen(
        [sys.executable, "-m", "roving.cli", "pipeline", "train", "--model", "tiny", "--network", "gcp12",
         "--nodes", "4", "--stages", "2", "--skip", "0", "--microbatches", "4", "--samples", "2", "--seq-len", "16",
         "--iterations", "3000", "--eval-every", "100000", "--control", str(control), "--no-restart"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    views = Views(runtime=False)
    views.watch_pipeline(str(control))
    server = Server(views).start()
    driver = hb.chromium()
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (control / "status.json").exists():
            assert train.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        driver.get(server.url + "#pipeline")
        hb.wait_for(driver, "four live nodes", lambda: driver.execute_script(
            "return [...document.querySelectorAll('tr.node')].filter(r => r.dataset.state === 'alive').length") == 4,
            TIMEOUT, tmp_path / "no-nodes.png")
        hb.wait_for(driver, "a loss curve", lambda: _points(driver, "loss-0") >= 3, TIMEOUT, tmp_path / "no-loss.png")
        nodes = roving_children(train.pid)
        assert len(nodes) == 4, nodes
        os.kill(nodes[-1], signal.SIGKILL)
        dead = hb.wait_for(driver, "a dead node", lambda: driver.execute_script(
            "return [...document.querySelectorAll('tr.node')].filter(r => r.dataset.state === 'dead')"
            ".map(r => r.dataset.node)"), TIMEOUT, tmp_path / "no-dead.png")
        assert len(dead) == 1
        hb.wait_for(driver, "the dead and replan events", lambda: driver.execute_script(
            "const k = [...document.querySelectorAll('.pipeline-events li')].map(e => e.dataset.kind);"
            "return k.includes('dead') && k.includes('replan')"), TIMEOUT, tmp_path / "no-replan.png")
        after = _points(driver, "loss-0")
        hb.wait_for(driver, "the loss curve moving on after the death",
                    lambda: _points(driver, "loss-0") >= after + 3, TIMEOUT, tmp_path / "stuck.png")
        assert driver.execute_script(
            "return [...document.querySelectorAll('tr.node')].filter(r => r.dataset.state === 'alive').length") == 3
        assert train.poll() is None, "the training goes on"
        driver.save_screenshot(str(tmp_path / "pipeline.png"))
    finally:
        driver.quit()
        server.stop()
        if train.poll() is None:
            train.kill()
        train.communicate(timeout=60)


def test_a_finished_run_is_shown_from_its_files_with_the_plan_as_a_gantt(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROVING_")}
    control, metrics = tmp_path / "control", tmp_path / "m.json"
    train = subprocess.run(
        [sys.executable, "-m", "roving.cli", "pipeline", "train", "--model", "tiny", "--network", "gcp12",
         "--nodes", "4", "--stages", "2", "--skip", "0", "--microbatches", "4", "--samples", "2", "--seq-len", "16",
         "--iterations", "6", "--eval-every", "3", "--control", str(control), "--metrics", str(metrics),
         "--checkpoint", str(tmp_path / "ck.pt"), "--checkpoint-every", "3", "--dashboard"],
        env=env, capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr[-3000:]
    assert train.stderr.count("roving: dashboard at http://127.0.0.1:") == 1, train.stderr[-3000:]
    for name in ("iterations.jsonl", "evaluations.jsonl", "events.jsonl", "plan.json"):
        assert (control / name).is_file(), name
    assert len((control / "iterations.jsonl").read_text().splitlines()) == 6
    board = subprocess.Popen([sys.executable, "-m", "roving.cli", "pipeline", "dashboard", "--control", str(control),
                              "--metrics", str(metrics)], env=env, stderr=subprocess.PIPE, text=True)
    driver = hb.chromium()
    try:
        line = board.stderr.readline()
        assert line.startswith("roving: dashboard at http://127.0.0.1:"), line
        driver.get(line.split(" at ", 1)[1].strip() + "#pipeline")
        hb.wait_for(driver, "the six iterations", lambda: _points(driver, "loss-0") >= 6, TIMEOUT,
                    tmp_path / "no-loss.png")
        # training loss at 6 iterations + validation loss at 0, 3 and 6
        assert _points(driver, "loss-0") == 6 + 3
        assert driver.execute_script("return document.querySelector('.pipeline').dataset.finished") == "true"
        rows = int(driver.execute_script("return +document.querySelector('#gantt-0').dataset.rows"))
        assert rows == 8, "each of the 4 nodes: its predicted and its measured row"
        regions = driver.execute_script("return [...document.querySelectorAll('tr.node td:nth-child(3)')]"
                                        ".map(e => e.textContent)")
        assert len(regions) == 4 and all(regions), regions
        kinds = driver.execute_script("return [...document.querySelectorAll('.pipeline-events li')]"
                                      ".map(e => e.dataset.kind + ' ' + e.textContent)")
        assert sum(k.startswith("checkpoint ") for k in kinds) == 2, kinds  # after iterations 3 and 6
        driver.save_screenshot(str(tmp_path / "finished.png"))
    finally:
        driver.quit()
        board.send_signal(signal.SIGINT)
        try:
            board.wait(30)
        finally:
            if board.poll() is None:
                board.kill()
    assert board.returncode == 0
    missing = subprocess.run([sys.executable, "-m", "roving.cli", "pipeline", "dashboard", "--control",
                              str(tmp_path / "none")], env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no control folder" in missing.stderr
