"""A training run's control folder (``pipeline train --control DIR``), owned by ``ControlFolder``: the
one place that knows its file names and opens its files, for the trainer (which writes it), ``roving
pipeline join``/``status`` (``cli.py``) and the dashboard (``dashboard/pipeline_view.py``), which read it.

What the folder holds:

* ``status.json``: where the run is (written every iteration; read by ``roving pipeline status``);
* ``iterations.jsonl``, ``evaluations.jsonl``, ``events.jsonl``: each iteration, evaluation and event
  as one JSON line, appended (a reader skips a line being written);
* ``plan.json``: the plan's predicted timeline beside the last iteration's measured one (the dashboard);
* ``join-*.json``: join requests (written by ``roving pipeline join``), each answered by a ``.done`` file;
* ``invite-*.json``: requests for invitations through the open door, or their revocation (written by
  ``roving pipeline invite``), each answered by a ``.done`` file (which holds the token: the folder and
  its files are its owner's alone).

Whole files are replaced atomically (written to a temporary name, then renamed), so a reader never
sees half of one. A run without a control folder gets ``NullControlFolder``: the same writer methods,
doing nothing, so the trainer never asks whether there is a folder.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable

from ...system.private import create_private, open_private, private_dir
from ..errors import PlanError

if TYPE_CHECKING:  # (the dashboard reads this module: it imports no planning at run time)
    from ..planning.costs import ModelSpec
    from ..planning.network import Network
    from ..planning.plan import Plan

STATUS = "status.json"
ITERATIONS = "iterations.jsonl"
EVALUATIONS = "evaluations.jsonl"
EVENTS = "events.jsonl"
PLAN = "plan.json"
JOIN_REQUESTS = "join-*.json"
INVITE_REQUESTS = "invite-*.json"

#: what a "recovery" event (``recovery.StageRecovery``) shows in status.json besides its kind.
_RECOVERY = ("stage", "policy", "chosen", "why", "neighbours", "grad_norms", "shares", "snapshot_iteration",
             "snapshot_age", "lr_factor")
#: what a verification event (``verify``: "caught", "dispute", "suspect") shows there besides its kind.
_VERIFY = ("node", "check", "computation", "computed_by", "stage", "mb", "hop", "verifier", "difference",
           "confirmed_difference", "tolerance", "boundary", "z", "agreeing")


class ControlFolder:
    """The control folder at ``path`` (the module doc). Writing: ``create`` it, then ``record`` lines,
    ``write_status``, ``write_plan`` and ``serve_join_requests``; reading: ``read_json``,
    ``read_lines``, ``read_status`` and ``request_join``. Only ``_open`` and ``create`` touch the file
    system's permissions and links: every file of the folder is opened through ``_open``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._plan_written = 0.0
        self._plan: Any = None
        self._predicted: dict = {}

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"ControlFolder({str(self.path)!r})"

    @staticmethod
    def of(path: str | os.PathLike | None) -> ControlFolder | NullControlFolder:
        """The folder at ``path``, or a ``NullControlFolder`` when ``path`` is empty or None."""
        return ControlFolder(path) if path else NullControlFolder()

    # -- the one place the folder and its files are made and opened ---------------------------------
    def create(self) -> None:
        """Make the folder (and its parents) if it is not there: this user's only (0700); one that is a
        link, another user's or writable by others is refused (roving.system.private.NotPrivateError)."""
        private_dir(str(self.path))

    def _open(self, name: str, mode: str) -> IO[str]:
        """Open the folder's file ``name`` (text; ``mode`` "r", "a" or "w"): every read and write of the
        folder's files goes through here. No link is followed; what is written is created 0600, and an
        existing file that is not private is refused (roving.system.private)."""
        path = str(self.path / name)
        if mode == "a":
            return open_private(path, "a")
        if mode == "w":  # a temporary name, renamed into place by _replace
            return create_private(path, "w")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        return os.fdopen(fd, mode, encoding="utf-8")

    def _replace(self, name: str, text: str) -> None:
        """Replace the file ``name`` with ``text`` atomically (a reader sees the old or the new one)."""
        tmp = f"{name}.{os.getpid()}.tmp"
        with self._open(tmp, "w") as f:
            f.write(text)
        os.replace(self.path / tmp, self.path / name)

    # -- reading -----------------------------------------------------------------------------------
    def exists(self, name: str) -> bool:
        return (self.path / name).is_file()

    def read_json(self, name: str) -> Any:
        """The JSON document in ``name``; OSError when it cannot be read, ValueError when it is not JSON."""
        with self._open(name, "r") as f:
            return json.loads(f.read())

    def read_lines(self, name: str) -> list[dict] | None:
        """The JSON lines of ``name`` (a line being written is skipped); None when there is no such file."""
        try:
            with self._open(name, "r") as f:
                data = f.read()
        except (OSError, ValueError):
            return None
        out = []
        for line in data.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line being written
                pass
        return out

    def read_status(self) -> Any:
        """``status.json``: FileNotFoundError when the run has not written one (not a control folder)."""
        return self.read_json(STATUS)

    def request_join(self, name: str | None, region: str | None, count: int, timeout: float) -> dict | None:
        """Ask the run for ``count`` nodes (``serve_join_requests`` answers) and wait up to ``timeout``
        seconds for the answer: {"started": [names]} or {"error": why}; None (the request withdrawn)
        when the run did not take it in time."""
        return self._ask("join", {"name": name, "region": region, "count": count}, timeout)

    def request_invite(self, ttl: float | None, revoke: str | None, timeout: float) -> dict | None:
        """Ask the run for an invitation valid ``ttl`` seconds (or to revoke invitation ``revoke``) and
        wait up to ``timeout`` seconds for the answer: {"id", "token", "door"}, {"revoked": id} or
        {"error": why}; None when the run did not take the request in time."""
        return self._ask("invite", {"ttl": ttl, "revoke": revoke}, timeout)

    def _ask(self, kind: str, doc: dict, timeout: float) -> dict | None:
        request = f"{kind}-{uuid.uuid4().hex}.json"
        self._replace(request, json.dumps(doc))
        answer = _answer_of(request)
        deadline = time.monotonic() + timeout
        while not self.exists(answer):
            if time.monotonic() > deadline:
                (self.path / request).unlink(missing_ok=True)
                return None
            time.sleep(0.2)  # a file in a folder another process writes: there is no event to wait for
        doc = self.read_json(answer)
        (self.path / answer).unlink(missing_ok=True)
        return doc

    # -- writing (the trainer) ---------------------------------------------------------------------
    def record(self, name: str, rec: dict) -> None:
        """Append ``rec`` to the JSON-lines file ``name`` (ITERATIONS, EVALUATIONS or EVENTS) as one line
        (values JSON cannot hold as text)."""
        self.create()  # an event may come before the run's first status
        with self._open(name, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")

    def serve_join_requests(self, request_join: Callable[[str | None, str | None], str]) -> None:
        """Answer every join request: ``request_join(name, region)`` once per node asked for (``count``);
        the answer names the nodes started, or the error (a PlanError, or a malformed request)."""
        for req in sorted(self.path.glob(JOIN_REQUESTS)):
            answer: dict[str, Any]
            try:
                doc = self.read_json(req.name)
                names = [request_join(doc.get("name"), doc.get("region")) for _ in range(int(doc.get("count", 1)))]
                answer = {"started": names}
            except (PlanError, ValueError, TypeError, AttributeError) as exc:
                answer = {"error": str(exc)}
            self._replace(_answer_of(req.name), json.dumps(answer))
            req.unlink(missing_ok=True)

    def serve_invite_requests(self, invite: Callable[[float | None, str | None], dict]) -> None:
        """Answer every invitation request with ``invite(ttl, revoke)`` (or the error)."""
        for req in sorted(self.path.glob(INVITE_REQUESTS)):
            answer: dict[str, Any]
            try:
                doc = self.read_json(req.name)
                ttl = doc.get("ttl")
                answer = invite(None if ttl is None else float(ttl), doc.get("revoke"))
            except (PlanError, ValueError, TypeError, AttributeError) as exc:
                answer = {"error": str(exc)}
            self._replace(_answer_of(req.name), json.dumps(answer))
            req.unlink(missing_ok=True)

    def write_status(self, metrics: dict, iterations: int, alloc: dict[str, int], missing_stages: list[int],
                     starting: list[str], refining: bool) -> None:
        """``status.json``: iterations done (of ``iterations``), the nodes and their stages, stages no
        node holds, nodes starting, the last iteration's loss and seconds, whether a fresh plan is being
        searched, the five latest events (from ``metrics``; a "recovery" event with its choice and
        inputs, ``_RECOVERY``), and every node verification caught (``_VERIFY``), however long ago."""
        last = metrics["iterations"][-1] if metrics["iterations"] else {}
        status = {"iterations_done": len(metrics["iterations"]) and last["iteration"] + 1,
                  "iterations": iterations, "nodes": dict(sorted(alloc.items())),
                  "missing_stages": missing_stages, "starting": starting,
                  "train_loss": last.get("train_loss"), "iteration_seconds": last.get("seconds"),
                  "refining": refining,
                  "recent_events": [{k: e[k] for k in ("event", "iteration", "adopted", "error") + _RECOVERY + _VERIFY
                                     if k in e}
                                    | {"nodes": e.get("nodes")} for e in metrics["events"][-5:]],
                  "caught": [{k: e[k] for k in ("event", "iteration", "why") + _VERIFY if k in e}
                             for e in metrics["events"] if e["event"] == "caught"]}
        self._replace(STATUS, json.dumps(status, indent=1))

    def write_plan(self, iteration: int, plan: Plan, net: Network, spec: ModelSpec, shared_cores: int,
                   trace: dict) -> None:
        """``plan.json``, for the dashboard: for each node, the simulator's timeline of the plan in use on
        the run's cores (``predicted``, computed once per plan) beside the last iteration's measured one
        (``measured``), each entry [kind, microbatch, start s, end s] from the iteration's start; the
        nodes' regions. Written at most once a second."""
        from ..planning.simulate import simulate

        now = time.monotonic()
        if now - self._plan_written < 1.0:
            return
        self._plan_written = now
        if self._plan is not plan:
            timeline = simulate(net, spec, plan, shared_cores=shared_cores).timeline
            self._predicted = {n: [[e.kind, e.microbatch, round(e.start, 5), round(e.end, 5)] for e in events
                                   if e.kind != "idle"] for n, events in timeline.items()}
            self._plan = plan
        doc = {"iteration": iteration, "predicted": self._predicted,
               "measured": {n: [[k, mb, round(a, 5), round(b, 5)] for k, mb, a, b in t] for n, t in trace.items()},
               "regions": {n: net.node(n).region for n in plan.allocation if n in net.names}}
        self._replace(PLAN, json.dumps(doc))


class NullControlFolder:
    """No control folder (a run without ``--control``): every writer method of ``ControlFolder``, doing
    nothing; false in a boolean test."""

    path = None

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "NullControlFolder()"

    def create(self) -> None:
        pass

    def record(self, name: str, rec: dict) -> None:
        pass

    def serve_join_requests(self, request_join: Callable[[str | None, str | None], str]) -> None:
        pass

    def serve_invite_requests(self, invite: Callable[[float | None, str | None], dict]) -> None:
        pass

    def write_status(self, metrics: dict, iterations: int, alloc: dict[str, int], missing_stages: list[int],
                     starting: list[str], refining: bool) -> None:
        pass

    def write_plan(self, iteration: int, plan: Plan, net: Network, spec: ModelSpec, shared_cores: int,
                   trace: dict) -> None:
        pass


def _answer_of(request: str) -> str:
    """The name of the answer to join request ``request`` (``join-X.json`` -> ``join-X.done``)."""
    return request[: -len(".json")] + ".done"
