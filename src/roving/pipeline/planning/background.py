"""A plan searched in a process of its own while the caller goes on (``pipeline train --refine-budget``).

The planner is pure Python: in a thread of the training coordinator it would hold the interpreter lock
in turns with the coordinator, whose every message would then wait for it. So ``BackgroundPlan`` runs
``planner.plan`` in a child interpreter (``python -m roving.pipeline.planning.background IN OUT``), at a lower
scheduling priority (nice 10) so that on a machine shared with nodes the nodes come first. The
arguments go in, and the plan or the error comes back, through files in a private temporary folder (a
plan can be larger than a pipe holds, and nobody reads the pipe while the child plans). Only the child
this process started writes there; nothing is read from any other peer.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import PlanError
from .plan import Plan
from .planner import plan


class BackgroundPlan:
    """``planner.plan(*args, **kwargs)`` in a child process. ``done()`` never blocks; ``result()`` (once
    done) returns the plan or raises what the planner raised (PlanError keeps its message; anything
    else, a child that died, or a result that cannot be read, is a RuntimeError naming the cause);
    ``cancel()`` kills the child.
    The temporary folder is removed by ``result()`` and ``cancel()``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="roving-plan-"))
        with open(self._dir / "in.pkl", "wb") as f:
            pickle.dump((args, kwargs), f)
        src = str(Path(__file__).resolve().parents[3])  # the roving this process runs, for the child too
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
        with open(self._dir / "stderr.txt", "wb") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(self._dir / "in.pkl"), str(self._dir / "out.pkl")],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)

    def done(self) -> bool:
        return self._proc.poll() is not None

    def result(self) -> Plan:
        self._proc.wait()
        try:
            out = self._dir / "out.pkl"
            if not out.is_file():
                err = (self._dir / "stderr.txt").read_text(errors="replace").strip().splitlines()
                raise RuntimeError(f"the planning process ended without a plan (exit code {self._proc.returncode})"
                                   + (f": {err[-1]}" if err else ""))
            try:
                with open(out, "rb") as f:
                    kind, value = pickle.load(f)  # noqa: S301  (our own planning process's answer, in a folder of our own (mkdtemp: 0700))
            except (OSError, EOFError, pickle.UnpicklingError, ValueError) as exc:
                raise RuntimeError(f"the planning process's result could not be read: {exc}") from None
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
        if kind == "plan":
            return value
        if kind == "plan-error":
            raise PlanError(value)
        raise RuntimeError(value)

    def cancel(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


class Refinement:
    """The training's refinement of its latest re-plan: at most one ``BackgroundPlan`` at a time, a
    fresh search replacing the one before. ``planner.plan`` gets ``budget_s``, ``seed``, ``sync_bytes``
    and ``max_evals`` as given here.

    The policy (``trainer.Trainer``): a re-plan has ``replan_budget`` seconds (training waits for it),
    so it keeps the current allocation or repairs it and searches paths briefly. With ``refine_budget``
    > 0, the planner then searches a fresh plan for the same nodes (allocation included, as before the
    run) for that long, niced and outside the coordinator's interpreter, while training goes on; at
    the first iteration boundary after it is done, it replaces the plan in use if it predicts a whole
    iteration (replica averaging included) at least ``trainer.REFINE_GAIN`` shorter, and nodes whose
    stage changes get its weights and optimizer state as after a re-plan. A refinement that a newer
    re-plan overtook is dropped. Recorded as a "refine" event either way."""

    def __init__(self, budget_s: float, seed: int, sync_bytes: Any = None, max_evals: int | None = None) -> None:
        self.budget_s, self.seed, self.sync_bytes, self.max_evals = budget_s, seed, sync_bytes, max_evals
        self._job: BackgroundPlan | None = None

    @property
    def searching(self) -> bool:
        """Whether a search was started and its plan not taken or cancelled yet."""
        return self._job is not None

    def start(self, *args: Any) -> None:
        """Cancel the search under way, if any, and search ``planner.plan(*args)`` in the background.
        Raises what ``BackgroundPlan`` raises when it cannot start a process or a temporary file."""
        self.cancel()
        self._job = BackgroundPlan(*args, budget_s=self.budget_s, seed=self.seed, sync_bytes=self.sync_bytes,
                                   max_evals=self.max_evals)

    def take(self) -> Plan | None:
        """The plan when the search is done (once; None while it searches, or when none was started);
        raises what ``BackgroundPlan.result`` raises."""
        job = self._job
        if job is None or not job.done():
            return None
        self._job = None
        return job.result()

    def cancel(self) -> None:
        if self._job is not None:
            self._job.cancel()
            self._job = None


def main(argv: list[str]) -> int:
    """The child: plan from the arguments in ``argv[0]``, write ("plan", Plan), ("plan-error", message)
    or ("error", message) to ``argv[1]`` (atomically: a half-written file is never read)."""
    try:
        os.nice(10)
    except OSError:
        pass
    src, dst = argv
    with open(src, "rb") as f:
        args, kwargs = pickle.load(f)  # noqa: S301  (what the parent wrote, in a folder of its own (mkdtemp: 0700))
    try:
        result: tuple[str, Any] = ("plan", plan(*args, **kwargs))
    except PlanError as exc:
        result = ("plan-error", str(exc))
    except Exception as exc:  # reported to the caller, which keeps what it has
        result = ("error", f"{type(exc).__name__}: {exc}")
    tmp = dst + ".part"
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, dst)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
