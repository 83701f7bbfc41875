"""The stages' weights and optimizer state as the coordinator handles them: gathered from the stage
processes (``stage_states``, the whole model), snapshots in memory, checkpoints on disk and the run
resumed from one, and weights moved to processes whose stage changed.

Snapshots: the weights and optimizer state of one replica per stage are copied to the coordinator at
the start and every ``snapshot_every`` iterations (and, with ``checkpoint``, written to disk every
``checkpoint_every``, atomically, with the metrics and the position in the data, so that ``resume``
continues a run whose coordinator died). A stage that no process holds any more is taken over from its
latest snapshot.

``Weights`` talks to the stage processes through a ``roster.Roster``; a process that dies while it is
asked is left out (the trainer plans around it at the next iteration boundary).

Checked exports (with ``[verify]`` on; ``verify.Verifier.exported`` says what is checked and what cannot
be): the weights of every export (``Export`` for a snapshot, a checkpoint or a stage moved; ``State`` for
an evaluation, a neighbour's weights for the recovery, ``stage_states``) must be those its node holds,
by the digest it reported after its latest step (or was loaded with, or started with). A node whose
export does not check out is caught and excluded at once (the trainer plans around it at the next
boundary, as a node lost), and another replica is asked. Where no replica of a stage exports weights that
check out, a snapshot, checkpoint or evaluation raises ``ExportRejected`` (nothing is saved or
evaluated); a stage to move is left to the recovery policy (``Takeover.orphans``) and a neighbour for the
recovery left out, as stages that no live process holds, which they then are. Every load tells the
verifier what its target holds from then on (``Verifier.holds``). The optimizer state is not checked.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, TypeVar, cast

from . import checkpoint_file
from .. import protocol as m
from ..errors import ExportRejected, NodesLost, PlanError
from ..model import Llama
from .roster import Roster
from ..stages import merge_state_dicts

if TYPE_CHECKING:
    from ..verify.verifier import Verifier


#: The answers ``Weights.ask`` collects (each names its ``sender``).
_Answer = TypeVar("_Answer", m.State, m.Exported)


@dataclass
class StageWeights:
    """One stage's weights, its optimizer state (None: a fresh optimizer), and where they came from."""

    params: dict
    optimizer: dict | None
    source: str


@dataclass
class Takeover:
    """Processes taking stages over (``moved``: name -> stage), as ``Weights.gather`` found them:
    ``found``, the stages a live process exported; ``orphans``, the stages no live process holds, each
    with the nodes that take it over (the recovery policy's input)."""

    moved: dict[str, int]
    found: dict[int, StageWeights] = field(default_factory=dict)
    orphans: dict[int, list[str]] = field(default_factory=dict)


class Weights:
    """The weights of a run's stages (``prep``: a ``runspec.Prepared``). ``snapshot`` is the latest
    snapshot: {"iteration": i, "stages": {stage: {"params", "optimizer", "iteration"}}} (None before
    the first). ``event(kind, **fields)`` records a stage taken over from a snapshot ("takeover").
    ``verifier``: what checks every export and hears of every load (the module doc; None: nothing is
    checked)."""

    def __init__(self, prep: Any, roster: Roster, event: Callable[..., None],
                 verifier: Verifier | None = None) -> None:
        self.prepared, self.config, self.roster, self._event = prep, prep.config, roster, event
        self.verifier = verifier
        self.snapshot: dict | None = None

    def _passes(self, name: str, msg: m.State | m.Exported) -> bool:
        """Whether the weights ``name`` exported in ``msg`` check out (``Verifier.exported``); a node caught
        is excluded now."""
        if self.verifier is None:
            return True
        tensors = msg.params if isinstance(msg, m.Exported) else msg.tensors
        caught = self.verifier.exported(name, self.roster.holding.get(name), msg.stage, tensors)
        if caught:
            self.roster.exclude(caught)
        return not caught

    # -- asking the stage processes ---------------------------------------------------------------
    def ask(self, request: m.Message, kind: type[_Answer], names: list[str]) -> dict[str, _Answer]:
        """Send ``request`` to ``names`` and collect their ``kind`` answers by sender; processes that
        die meanwhile are left out."""
        roster = self.roster
        waiting = {n for n in names if n in roster.inboxes}
        for n in sorted(waiting):
            roster.put(n, request)
        out: dict[str, _Answer] = {}
        while waiting:
            try:
                msg = cast(_Answer, roster.recv(kind, names=waiting))  # a message of type `kind`
            except NodesLost as exc:
                waiting -= set(exc.names)
                continue
            out[msg.sender] = msg
            waiting.discard(msg.sender)
        return out

    def ask_each_stage(self, request: m.Message, kind: type[_Answer]) -> dict[str, _Answer]:
        """``request`` (``Export`` or ``StateRequest``) to one live process holding each stage; another
        replica when one dies, or when the weights it sent do not check out (``_passes``; gradients,
        ``StateRequest(grads=True)``, are not checked). ExportRejected when every replica of a stage that
        answered was caught."""
        out: dict[str, _Answer] = {}
        covered: set[int] = set()
        rejected: dict[int, list[str]] = {}
        checked = not (isinstance(request, m.StateRequest) and request.grads)
        while True:
            holders: dict[int, str] = {}
            for n in sorted(self.roster.inboxes):
                st = self.roster.holding.get(n)
                if st is not None and st not in covered and st not in holders \
                        and n not in rejected.get(st, ()):
                    holders[st] = n
            if not holders:
                break
            got = self.ask(request, kind, list(holders.values()))
            for st, n in holders.items():
                if n not in got:
                    continue  # died meanwhile: another replica, if any
                if checked and not self._passes(n, got[n]):
                    rejected.setdefault(st, []).append(n)
                    continue
                out[n] = got[n]
                covered.add(st)
        _refuse({st: names for st, names in rejected.items() if st not in covered})
        return out

    def stage_states(self, alloc: dict[str, int], all_replicas: bool = False,
                     grads: bool = False) -> dict[str, tuple[int, dict]]:
        """Weights (or, with ``grads``, gradients) of one replica per held stage, or of every process
        of ``alloc``: name -> (stage, {parameter name: tensor}). Weights are checked (``_passes``): a
        process caught is left out; ExportRejected where that leaves a stage with none."""
        request = m.StateRequest(grads=grads)
        if all_replicas:
            got = self.ask(request, m.State, sorted(alloc))
            if not grads:
                caught = [n for n in sorted(got) if not self._passes(n, got[n])]
                got = {n: msg for n, msg in got.items() if n not in caught}
                kept = {alloc[n] for n in got}
                rejected: dict[int, list[str]] = {}
                for n in caught:
                    if alloc[n] not in kept:
                        rejected.setdefault(alloc[n], []).append(n)
                _refuse(rejected)
        else:
            got = self.ask_each_stage(request, m.State)
        return {name: (msg.stage, msg.tensors) for name, msg in got.items()}

    def held_states(self, stages: list[int]) -> dict[int, dict]:
        """The current weights of ``stages`` from one live process holding each, checked (``_passes``: a
        process caught is excluded, and the next one asked); a stage that no live process holds, or none of
        whose holders exports weights that check out, is left out: stage -> {parameter name: tensor}."""
        out: dict[int, dict] = {}
        for stage in stages:
            holders = sorted(n for n, s in self.roster.holding.items() if s == stage and n in self.roster.inboxes)
            for name in holders:  # the next one if it dies before it answers, or its weights do not check out
                got = self.ask(m.StateRequest(), m.State, [name])
                if name in got and self._passes(name, got[name]):
                    out[stage] = got[name].tensors
                    break
        return out

    def full_model(self, alloc: dict[str, int]) -> Llama:
        """The whole model: one replica of each held stage, its weights checked (``ask_each_stage``; where
        none checks out, ExportRejected); a stage no process holds from its snapshot."""
        states = self.stage_states(alloc)
        parts = [sd for _, sd in states.values()]
        held = {stage for stage, _ in states.values()}
        for s in range(self.config.stages):
            if s not in held:
                assert self.snapshot is not None, "a snapshot is taken at the start of the run"
                parts.append(self.snapshot["stages"][s]["params"])
        model = Llama(self.prepared.model)
        model.load_state_dict(merge_state_dicts(parts))
        return model

    # -- snapshots and checkpoints -------------------------------------------------------------------
    def take_snapshot(self, it: int) -> dict:
        """Weights and optimizer state of one replica of each held stage, its weights checked
        (``ask_each_stage``; where none checks out, ExportRejected and the snapshot is unchanged); stages
        no process holds keep their last snapshot. Becomes ``snapshot`` and is returned."""
        got = self.ask_each_stage(m.Export(), m.Exported)
        stages = dict(self.snapshot["stages"]) if self.snapshot else {}
        for msg in got.values():
            stages[msg.stage] = {"params": msg.params, "optimizer": msg.optimizer, "iteration": it}
        self.snapshot = {"iteration": it, "stages": stages}
        return self.snapshot

    def checkpoint(self, it: int, metrics: dict) -> None:
        """A snapshot, written to ``checkpoint`` atomically: the whole model, each stage's weights and
        optimizer state, ``metrics`` (enough for ``resume``). Nothing is written when a stage's weights
        do not check out (``take_snapshot`` raises ExportRejected)."""
        snapshot = self.take_snapshot(it)
        parts = [st["params"] for st in snapshot["stages"].values()]
        checkpoint_file.save({"format": 2, "model": merge_state_dicts(parts),
                              "model_config": dataclasses.asdict(self.prepared.model),
                              "config": dataclasses.asdict(self.config),
                              "iteration": it, "stages": snapshot["stages"], "metrics": metrics},
                             self.config.checkpoint)

    def resume_from(self, ck: dict) -> None:
        """The snapshot of a checkpoint being resumed (``load_checkpoint``)."""
        self.snapshot = {"iteration": ck["iteration"], "stages": ck["stages"]}

    # -- moving weights -----------------------------------------------------------------------------
    def gather(self, moved: dict[str, int], alloc: dict[str, int]) -> Takeover:
        """The weights and optimizer state of each stage that processes ``moved`` to (name -> stage),
        exported from a live process that holds it (one that keeps the stage in ``alloc`` first);
        the stages that no live process holds are left in ``Takeover.orphans`` for the recovery
        policy (``recovery.StageRecovery.rebuild``) or the snapshot (``move``). Every export happens
        before any load (``move``), so a process that moves away from a stage can still be the source
        of that stage's weights. Each export is checked (``_passes``): a keeper caught is excluded and the
        next one asked; a stage none of whose keepers exports weights that check out is an orphan (no live
        process holds it any more)."""
        takeover = Takeover(dict(moved))
        roster = self.roster
        for stage in sorted(set(moved.values())):
            keepers = sorted((n for n, s in roster.holding.items() if s == stage and n in roster.inboxes),
                             key=lambda n: (alloc.get(n) != stage, n))
            for keeper in keepers:  # the next one if it dies before it answers, or its weights do not check out
                got = self.ask(m.Export(), m.Exported, [keeper])
                if keeper in got and self._passes(keeper, got[keeper]):
                    takeover.found[stage] = StageWeights(got[keeper].params, got[keeper].optimizer, keeper)
                    break
            else:
                takeover.orphans[stage] = sorted(n for n, s in moved.items() if s == stage)
        return takeover

    def move(self, takeover: Takeover, rebuilt: dict[int, StageWeights],
             limit: Callable[[str, int], int]) -> dict[int, str]:
        """Load each process of ``takeover.moved`` with its new stage: the weights ``gather`` found,
        else those the recovery policy ``rebuilt`` for an orphaned stage, else the latest snapshot
        (recorded as a "takeover" event); ``limit(name, stage)`` is the microbatches it may hold in
        flight. Returns where each stage's weights came from."""
        states = dict(takeover.found)
        for stage, nodes in takeover.orphans.items():
            if stage in rebuilt:
                states[stage] = rebuilt[stage]
                continue
            assert self.snapshot is not None, "a snapshot is taken at the start of the run"
            snap = self.snapshot["stages"][stage]
            states[stage] = StageWeights(snap["params"], snap["optimizer"],
                                         f"snapshot of iteration {snap['iteration']}")
            self._event("takeover", stage=stage, nodes=nodes, snapshot_iteration=snap["iteration"])
        if takeover.moved:
            self.load({s: {"params": w.params, "optimizer": w.optimizer} for s, w in states.items()},
                      takeover.moved, limit)
        return {s: states[s].source for s in sorted(states)}

    def load(self, stages: dict[int, dict], targets: dict[str, int], limit: Callable[[str, int], int]) -> None:
        """Each target process loads its stage's weights and optimizer state; ``roster.holding``
        follows, and the verifier hears what it holds (``Verifier.holds``). A target that is dead
        already, or dies meanwhile, is left out: it is re-planned around at the next attempt's boundary
        (two processes of one lost machine are often declared dead one after the other, the second while
        the first one's re-plan moves weights)."""
        roster = self.roster
        waiting = {name for name in targets if name in roster.inboxes}
        for name in sorted(waiting):
            stage = targets[name]
            st = stages[stage]
            roster.put(name, m.Load(stage, limit(name, stage), st["params"], st["optimizer"]))
        while waiting:
            try:
                msg = cast(m.Loaded, roster.recv(m.Loaded, names=waiting))  # a message of type Loaded
            except NodesLost as exc:
                waiting -= set(exc.names)
                continue
            waiting.discard(msg.sender)
            roster.holding[msg.sender] = msg.stage
            if self.verifier is not None:
                self.verifier.holds(msg.sender, targets[msg.sender], stages[targets[msg.sender]]["params"])


def _refuse(rejected: dict[int, list[str]]) -> None:
    """ExportRejected naming each stage of ``rejected`` (stage -> the replicas caught exporting it) and
    whom, when there is one."""
    if rejected:
        said = "; ".join(f"stage {st}: {', '.join(sorted(names))}" for st, names in sorted(rejected.items()))
        raise ExportRejected(f"no replica of stage(s) {', '.join(str(st) for st in sorted(rejected))} exported "
                             f"weights that check out (caught exporting other weights than they hold: {said}); "
                             "nothing was saved or evaluated from them")


def load_checkpoint(path: str, prep: Any) -> dict:
    """A checkpoint to resume ``prep``'s run from (:func:`checkpoint_file.load_checkpoint`, the one
    loader of checkpoints); PlanError (CheckpointFileError) when it is missing or does not match."""
    if not path:
        raise PlanError("resume needs checkpoint = the file the run wrote")
    into = checkpoint_file.ResumeInto(dataclasses.asdict(prep.model), prep.config.stages, prep.config.iterations)
    return checkpoint_file.load_checkpoint(path, into=into)
