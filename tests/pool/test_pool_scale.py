"""A few hundred real workers from one parent on this machine's two cores: started in one storm, every
one connects, none is replaced, nothing is printed on the terminal, and a map runs over all of them."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers_core import PROGRAMS

WORKERS = 300


def test_a_pool_of_300_workers_started_at_once_connects_every_one_and_prints_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROVING_")}
    run = subprocess.run([sys.executable, str(PROGRAMS / "pool_many.py"), str(WORKERS)], env=env,
                         cwd=str(tmp_path), capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr == "", f"the pool printed on the terminal:\n{run.stderr[-3000:]}"
    out = json.loads(run.stdout.strip().splitlines()[-1])
    # every worker the pool started connected, and no other: none left and was replaced meanwhile
    names = [f"PoolWorker-{name.split('-')[1]}-{i}" for name in out["connected"][:1] for i in range(1, WORKERS + 1)]
    assert sorted(out["connected"]) == sorted(names)
    results = out["results"]
    assert [i for i, _ in results] == list(range(5 * WORKERS))
    assert {name for _, name in results} <= set(names)
