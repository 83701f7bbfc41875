"""benchmarks/stage_throughput.py (issue 8's GPU check) runs end to end on the CPU: a real node process
serves a stage over roving and both throughputs are measured. It waits for a GPU machine, so a change
that breaks it (as a change of the nodes' ready message once did) must show here first."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_script_runs_on_the_cpu():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stage_throughput.py"), "--rounds", "1",
                          "--microbatches", "2", "--dim", "32", "--heads", "2", "--layers", "4"],
                         capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "stage 1 of 2 (2 layers), 2 microbatches of 4x64 tokens" in out.stdout
    m = re.search(r"plain PyTorch: ([\d,]+) tokens/s\s+node over roving: ([\d,]+) tokens/s\s+ratio ([\d.]+)",
                  out.stdout)
    assert m, out.stdout
    plain, node, ratio = (float(g.replace(",", "")) for g in m.groups())
    assert plain > 0 and node > 0
    assert abs(ratio - node / plain) < 2e-3  # the ratio printed is the two figures' (rounded)
