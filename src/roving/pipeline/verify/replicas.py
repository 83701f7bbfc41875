"""The replicas of a stage (``verifier``, the module doc): what each holds (``held``: the digest of the
weights it reported after its latest step, or was loaded with, or, in a fresh run, its stage's initial
weights), on which platform (``platform``), the weights check after every step (``stepped``), the check of
weights that leave a node (``exported``), and the check of their averaging (``averaging``)."""

from __future__ import annotations

import collections
import math
from typing import Any, Iterable, Sequence

import torch

from . import receipts
from .aggregate import combine
from .audit import Audit
from .checks import Check, Source
from .evidence import difference
from .findings import Findings
from .gather import Gather
from .settings import Settings
from .tensor_id import Kind, TensorId
from ..stages import Stage


class Replicas:
    """What each replica holds and where, and the checks that compare a stage's replicas."""

    def __init__(self, settings: Settings, findings: Findings, roster: Any, model: Any, gather: Gather) -> None:
        self.settings, self.findings, self.roster, self.model, self.gather = settings, findings, roster, model, gather
        #: name -> (stage, digest of the weights it reported after its latest step): what it holds until
        #: its next step (a process's weights change only when it steps, or loads another stage's)
        self.held: dict[str, tuple[int, bytes]] = {}
        #: name -> the platform it first reported since it last loaded weights (``Stepped.platform``): where
        #: its weights are compared, whatever it claims later (a process's platform does not change)
        self.platform: dict[str, str] = {}

    def stepped(self, rnd: int, alloc: dict[str, int], digests: dict[str, Any],
                platforms: dict[str, str] | None = None) -> dict[str, str]:
        """The nodes of ``alloc`` stepped after round ``rnd``; ``digests``: name -> the digest of the weights
        each reported (``Stepped.weights``; those that did not step are left out), ``platforms``: name ->
        what its arithmetic runs on (``Stepped.platform``; one platform for all when not given). Compares
        the replicas of each stage on one platform (the module doc) and returns the nodes caught, name ->
        why (each also an event), for the trainer to exclude."""
        if not self.settings.on:
            return {}
        for name, p in (platforms or {}).items():  # (a platform that is no name is one of its own)
            self.platform.setdefault(name, p if isinstance(p, str) else f"not a platform: {p!r:.80}")
        for name, d in digests.items():  # what each holds now (none known: it stepped alone)
            if isinstance(d, bytes) and name in alloc:
                self.held[name] = (alloc[name], d)
            else:
                self.held.pop(name, None)
        replicated = {s for s in alloc.values() if sum(1 for x in alloc.values() if x == s) > 1}
        groups: dict[tuple[int, str], dict[str, Any]] = {}
        for name, stage in sorted(alloc.items()):
            if name in digests and stage in replicated:
                groups.setdefault((stage, self.platform.get(name, "")), {})[name] = digests[name]
        caught: dict[str, str] = {}
        for (stage, _), got in sorted(groups.items()):
            votes = collections.Counter(d if isinstance(d, bytes) else None for d in got.values())
            if len(votes) < 2:
                continue
            top, n = votes.most_common(1)[0]
            if len(got) >= 3 and 2 * n > len(got) and top is not None:
                agreeing = sorted(o for o, x in got.items() if x == top)
                for name in sorted(set(got) - set(agreeing)):
                    what = (f"stepped to other weights than {n} of the {len(got)} replicas of stage {stage}"
                            if isinstance(got[name], bytes) else "reported no digest of the weights it stepped to")
                    c = Check(name, stage, Kind.WEIGHTS, -1, -1, Source(name))
                    self.findings.catch(caught, name, "weights", c, reason=f"{what} after round {rnd}", round=rnd,
                                        agreeing=agreeing)
            else:
                self.findings.dispute(sorted(got), f"the replicas of stage {stage} stepped to different weights "
                                      f"after round {rnd}, with no majority of 3 or more", stage=stage, round=rnd)
        for name in caught:
            self.held.pop(name, None)
        self.findings.totals["caught"] += len(caught)
        return caught

    def loaded(self, names: Iterable[str]) -> None:
        """``names`` load other weights (a stage taken over, or a node admitted again, maybe elsewhere):
        what they reported after their latest step is no longer what they hold, and their platform is
        taken again from their next report."""
        for name in names:
            self.held.pop(name, None)
            self.platform.pop(name, None)

    def started(self, holding: dict[str, int | None]) -> None:
        """A fresh run's processes started (``holding``: name -> the stage each holds, None: not the run's
        initial weights): each holds its stage's initial weights, which the coordinator builds from the
        seed as the processes do (``model.init_part``), so what each holds is known before its first step."""
        if not self.settings.on:
            return
        digests: dict[int, bytes] = {}
        for name, stage in sorted(holding.items()):
            if stage is None:
                continue
            if stage not in digests:  # (built on the CPU, and let go: a stage process's are bitwise the same)
                digests[stage] = receipts.weights_digest(
                    Stage(self.model, stage, self.settings.stages, seed=self.settings.seed).state_dict())
            self.held[name] = (stage, digests[stage])

    def holds(self, name: str, stage: int, tensors: Any) -> None:
        """``name`` loaded ``tensors`` as its weights of ``stage`` (from the coordinator, which checked
        them or built them): it holds exactly those until its next step."""
        if self.settings.on:
            self.held[name] = (stage, receipts.weights_digest(tensors))
            self.platform.pop(name, None)

    def exported(self, name: str, holds: int | None, stage: Any, tensors: Any) -> dict[str, str]:
        """Check weights that ``name`` exported (a snapshot, a checkpoint, an evaluation, a stage taken
        over, a neighbour's for the recovery), as stage ``stage``, where the coordinator knows it ``holds``
        that stage (None: not known): they must be of the stage it holds, have the digest of what it holds
        (``held``: what it reported after its latest step, or was loaded with, or, in a fresh run before
        its first step, the stage's initial weights), and the digest a strict majority of its stage's live
        replicas on its platform hold, where there is one. Returns the node caught (name -> why; also an
        event, check "export"), for the caller to exclude and to take another replica's export; {} when
        they pass.

        What cannot be checked: with verification "off", nothing; weights whose node holds no known
        digest and whose stage has no such majority (a node that reported none after its step, in a stage
        of 2 replicas: a dispute; a single replica that did so) are taken as they come. A stage of a single
        replica is held to what it reported after its step and computes with (its computations are checked
        against the weights it shows, which must be those), not to the step itself, which no replica
        repeats. The optimizer state that comes with an export is not checked (the module doc)."""
        if not self.settings.on:
            return {}
        caught: dict[str, str] = {}
        c = Check(name, stage if isinstance(stage, int) else -1, Kind.EXPORT, -1, -1, Source(name))
        if not isinstance(stage, int) or isinstance(stage, bool) or (holds is not None and stage != holds):
            self.findings.catch(caught, name, "export", c, reason=f"exported weights of stage {stage!r} while it holds "
                        f"stage {holds}")
        elif not isinstance(tensors, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
            self.findings.catch(caught, name, "export", c, reason=f"exported weights of stage {stage} that are not a "
                        "state dict of tensors")
        else:
            got = receipts.weights_digest(tensors)
            held = self.held.get(name)
            own = held[1] if held is not None and held[0] == stage else None
            where = self.platform.get(name, "")
            peers = [d for o, (s, d) in self.held.items()
                     if s == stage and o != name and o in self.roster.inboxes and self.platform.get(o, "") == where]
            votes = collections.Counter(peers + ([own] if own is not None else []))
            top, agree = votes.most_common(1)[0] if votes else (None, 0)
            size = len(peers) + 1
            if own is not None and got != own:
                self.findings.catch(caught, name, "export", c, reason=f"exported weights of stage {stage} that differ "
                            "from its stepped digest (what it reported holding after its latest step, or was "
                            "loaded with)")
            elif top is not None and size >= 2 and 2 * agree > size and got != top:
                self.findings.catch(caught, name, "export", c, reason=f"exported weights of stage {stage} that differ "
                            f"from those {agree} of its stage's {size} replicas hold")
        for who in caught:
            self.held.pop(who, None)
        self.findings.totals["caught"] += len(caught)
        self.findings.totals["exports"] += 1
        return caught

    def combined_needed(self, replicas: Sequence[str]) -> bool:
        """Whether the replicas of a stage (``replicas``) must each report a digest of the gradient they
        combine this round (``Norm.combined``; the averaging check, ``averaging``): yes with verification
        on, unless they are 3 or more that all reported one platform. Then a replica that combines another
        gradient than its replicas steps to other weights than the others, and the weights check after
        the step names it (``stepped``; by the platform it reported first, so that a new claim cannot take
        it out of its group); with 2, or across platforms, only the averaging check can."""
        if not self.settings.on:
            return False
        known = {self.platform.get(n) for n in replicas}
        return len(replicas) < 3 or None in known or len(known) > 1

    def averaging(self, a: Audit) -> None:
        """Every replica of a stage must combine the shares as they were sent (so that they hold equal
        weights after the step): when the digests of what they combined (``Norm.combined``) differ, the
        coordinator combines the shares itself, each as its sender's receipt names it, and catches every
        replica whose gradient differs from that by more than ``tolerance``."""
        digests = {msg.sender: msg.combined for msg in a.norms}
        groups: dict[int, list[str]] = {}
        for name, stage in sorted(a.alloc.items()):
            groups.setdefault(stage, []).append(name)
        # only where the digests were asked for (``combined_asked``): a digest nobody asked for is no
        # evidence, and the replicas not asked keep no combined gradient to show
        split = {s: names for s, names in groups.items()
                 if tuple(names) in a.combined and len({digests.get(n) for n in names}) > 1}
        if not split:
            return
        wanted: dict[str, set] = {}
        for names in split.values():
            for r in names:
                holder = next(o for o in names if o != r)
                wanted.setdefault(holder, set()).add(TensorId(a.rnd, "share", -1, -1, r))
                wanted.setdefault(r, set()).add(TensorId.combined(a.rnd))
        self.gather.ask(a, wanted, lambda shown: self._judge_averaging(a, split, shown))

    def _judge_averaging(self, a: Audit, split: dict[int, list[str]], shown: dict[str, dict]) -> None:
        counts, visits = a.plan.backward_counts(), a.plan.stage_visits()
        for stage, names in split.items():
            shares = []
            for r in names:
                holder = next(o for o in names if o != r)
                c = Check(r, stage, Kind.SHARE, -1, -1, Source(holder, TensorId(a.rnd, "share", -1, -1, r)))
                share = self.gather.shown(c.claimed, shown, a.caught, c)
                if share is None:
                    break
                shares.append(share.float())
            if len(shares) < len(names):
                continue  # a share not shown, or disputed: dealt with above
            want = combine(shares, [counts.get(r, 0) for r in names], visits[stage], self.settings.aggregation)
            for r in names:
                got = shown.get(r, {}).get(TensorId.combined(a.rnd))
                c = Check(r, stage, Kind.COMBINE, -1, -1, Source(r, TensorId.combined(a.rnd)))
                d = difference(got[0] if isinstance(got, tuple) and got else None, want)
                if d > self.settings.tolerance:
                    self.findings.catch(a.caught, r, "combine", c,
                                        reason=f"combined its stage's shares into a gradient that differs by {d:.3g} "
                                        "from the shares as their senders sent them",
                                        difference=d if math.isfinite(d) else None, tolerance=self.settings.tolerance)
