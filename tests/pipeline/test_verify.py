"""Verification of untrusted nodes (issue 32): receipts bind a node to what it sent; the recomputations
give exactly what the stages computed; evidence that a holder altered or withheld gets the holder caught,
and a dispute blames nobody; an audit (its round's nodes simulated here) that a node it asks dies in
raises NodesLost naming it, with no answer left on its way, and a non-finite gradient norm has every
computation of the round checked, its maker caught; and, in training on local roving processes, every
adversary kind is caught within the iteration it starts lying in (mode "full"; "spot" within a stated
number), honest nodes are never blamed (a framer is caught instead), training goes on without the caught
nodes, a node killed as the audit asks it has the round run again, and verification changes nothing of a
clean run's training."""

import collections
import copy
import dataclasses
import io
import math
import random
import types
from typing import Callable
from contextlib import redirect_stdout

import pytest
import torch

torch.set_num_threads(1)

from roving.pipeline import protocol as m
from roving.pipeline.verify import receipts
from roving.pipeline.verify import sampling as sampling_module
from roving.dashboard.pipeline_view import PipelineWatch
from roving.pipeline.verify.adversary import Adversary
from roving.pipeline.verify.conduct import HONEST
from roving.pipeline.verify.aggregate import combine
from roving.pipeline.errors import NodeFailed, NodesLost, NoMessage, PlanError
from roving.pipeline.verify.evidence import Evidence, difference, platform, recheck, recompute, summariser
from roving.pipeline.verify.screen import Summary, summarize
from roving.pipeline.presets import preset
from roving.pipeline.planning.plan import Plan, Route
from roving.pipeline.stages import Stage
from roving.pipeline.run.trainer import Trainer, TrainConfig, prepare
from roving.pipeline.verify.audit import Audit
from roving.pipeline.verify.checks import Check, Source, round_checks
from roving.pipeline.verify.tensor_id import Kind, Screened
from roving.pipeline.verify.reports import well_formed
from roving.pipeline.verify.rows import ScreenedRows
from roving.pipeline.runtime import codec
from roving.pipeline.verify.tensor_id import TensorId as T
from roving.pipeline.verify.verifier import Verifier

CFG = preset("tiny", max_seq_len=16)
RUN_KEY = b"k" * 32


def tokens_and_targets(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


# -- receipts ---------------------------------------------------------------------------------------
def test_a_receipt_names_one_tensor_and_only_its_senders_key_makes_it():
    ka, kb = receipts.node_key(RUN_KEY, "a"), receipts.node_key(RUN_KEY, "b")
    assert ka != kb and receipts.node_key(RUN_KEY, "a") == ka and receipts.node_key(b"x" * 32, "a") != ka
    t = torch.randn(3, 4)
    r = receipts.seal(ka, T(2, "activation", 1, 0, "a"), t)
    assert receipts.genuine(ka, r) and receipts.matches(r, t) and receipts.matches(r, t.clone())
    assert not receipts.genuine(kb, r), "checked under another node's key"
    assert not receipts.genuine(ka, receipts.seal(kb, T(2, "activation", 1, 0, "a"), t)), "b made one in a's name"
    for field, value in (("mb", 2), ("round", 3), ("hop", 1), ("what", "gradient"), ("sender", "b")):
        assert not receipts.genuine(ka, dataclasses.replace(r, id=dataclasses.replace(r.id, **{field: value}))), field
    assert not receipts.genuine(ka, dataclasses.replace(r, digest=receipts.digest(t * 2)))
    nudged = t.clone()
    nudged[0, 0] += 1e-6
    assert not receipts.matches(r, nudged)
    assert not receipts.matches(r, t.double()) and not receipts.matches(r, t.reshape(4, 3)), "dtype and shape count"
    assert not receipts.genuine(ka, "not a receipt") and not receipts.matches(None, t)


def test_a_receiver_keeps_what_it_got_and_reports_a_tensor_that_does_not_match_its_receipt():
    ka = receipts.node_key(RUN_KEY, "a")
    ev = Evidence("b", "spot", receipts.node_key(RUN_KEY, "b"))
    t = torch.randn(2, 3)
    ev.keep("activation", 4, 0, 1, "a", t, receipts.seal(ka, T(4, "activation", 0, 1, "a"), t))
    ev.keep("activation", 4, 1, 1, "a", t + 1, receipts.seal(ka, T(4, "activation", 1, 1, "a"), t))  # not the tensor
    ev.keep("gradient", 4, 0, 0, "a", t, None)  # no receipt
    ev.keep("activation", 4, 2, 1, "a", t, receipts.seal(ka, T(4, "activation", 3, 1, "a"), t))  # another mb's
    ev.keep("activation", 4, 0, 1, "b", t, None)  # its own: not kept
    # no receipt, or one for another message: at once; a tensor its receipt does not name: when shown
    assert ev.disputes == [T(4, "gradient", 0, 0, "a"), T(4, "activation", 2, 1, "a")]
    shown = ev.show([T(4, "activation", 0, 1, "a"), T(4, "activation", 9, 9, "a"), T(4, "activation", 1, 1, "a"),
                     ("activation", 0, 1, "a")])
    assert list(shown) == [T(4, "activation", 0, 1, "a"), T(4, "activation", 1, 1, "a")], "a tuple is no key"
    assert torch.equal(shown[T(4, "activation", 0, 1, "a")][0], t) and shown[T(4, "activation", 0, 1, "a")][2] is False
    assert shown[T(4, "activation", 1, 1, "a")][2] is True and T(4, "activation", 1, 1, "a") in ev.disputes
    # summarised in idle moments (one at a time, oldest first), every one before the round's report
    assert ev.screened == [] and len(ev.unsummarised) == 4
    assert ev.summarize_one() and [row.tensor for row in ev.screened] == [T(4, "activation", 0, 1, "a")]
    rows = ev.summaries()
    assert [row.tensor for row in rows] == [T(4, "activation", 0, 1, "a"), T(4, "activation", 1, 1, "a"),
                                            T(4, "gradient", 0, 0, "a"), T(4, "activation", 2, 1, "a")]
    assert not ev.unsummarised and not ev.summarize_one()
    ev.keep("activation", 4, 3, 1, "a", t, None)
    ev.clear()
    assert not ev.kept and not ev.disputes and not ev.screened and not ev.unsummarised
    off = Evidence("b")
    assert off.seal("activation", 0, 0, 0, t) is None
    off.keep("activation", 0, 0, 0, "a", t, None)
    assert not off.kept, "verification off keeps nothing"


def test_each_share_is_summarised_by_one_other_replica_in_turn_and_a_replica_reports_its_own_shares_cosines():
    """4 replicas: d ran no microbatch (its share is zeros). Each round every other share is summarised by
    exactly one of its receivers (per microbatch: as ``summarize`` with its count), a different one each
    round; d's zeros make no row and take no part in cosines; each replica reports its own share's cosine to
    each other taken share (d, whose own is zeros, none)."""
    g = torch.Generator().manual_seed(2)
    common = torch.randn(5_000, generator=g)
    got = {n: common * 3 + torch.randn(5_000, generator=g) for n in "abc"} | {"d": torch.zeros(5_000)}
    counts = {"a": 3, "b": 2, "c": 1, "d": 0}
    summarisers: dict[str, list[str]] = {n: [] for n in "abcd"}
    for rnd in range(3):
        rows = {}
        for name in "abcd":
            ev = Evidence(name, "screen", receipts.node_key(RUN_KEY, name))
            cosines = ev.shares(rnd, got, counts)
            for row in ev.summaries():
                sender, summary = row.tensor.sender, row.summary
                assert row.tensor == T(rnd, "share", -1, -1, sender) and sender != name and sender not in rows
                assert summary == summarize(got[sender], divisor=counts[sender])
                rows[sender] = name
                summarisers[sender].append(name)
            naive = {o: float(torch.nn.functional.cosine_similarity(got[name], got[o], dim=0))
                     for o in "abc" if o != name}
            assert cosines.keys() == (naive.keys() if name != "d" else set()), name
            assert all(cosines[o] == pytest.approx(naive[o], rel=1e-5) for o in cosines)
        assert sorted(rows) == ["a", "b", "c"], rows  # d ran nothing: its zeros are no finding
        assert len(set(rows.values())) == 3, rows  # one share each (d's would have been the fourth's)
    assert {n: len(set(who)) for n, who in summarisers.items() if n != "d"} == {"a": 3, "b": 3, "c": 3}
    for n in range(2, 7):
        names = [f"r{i}" for i in range(n)]
        turns = {x: [summariser(x, names, rnd) for rnd in range(n - 1)] for x in names}
        for rnd in range(n - 1):  # each round: every share one summariser, each replica one share
            assert sorted(t[rnd] for t in turns.values()) == names
        assert all(sorted(t) == sorted(set(names) - {x}) for x, t in turns.items())  # each other in turn
    assert summariser("a", ["a"], 0) == "" and summariser("z", ["a", "b"], 0) == ""
    pair = Evidence("a", "screen", receipts.node_key(RUN_KEY, "a"))  # with d's zeros, a pair: its one cosine
    assert pair.shares(0, {n: got[n] for n in "abd"}, counts) == pytest.approx(
        {"b": float(torch.nn.functional.cosine_similarity(got["a"], got["b"], dim=0))}, rel=1e-5)
    alone = Evidence("a", "screen", receipts.node_key(RUN_KEY, "a"))
    assert alone.shares(0, {n: got[n] for n in "ad"}, counts) == {}, "no other share taken: no cosine"
    assert Evidence("a").shares(0, got, counts) == {} and Evidence("a").summaries() == ()


# -- recomputation ------------------------------------------------------------------------------------
def test_recomputations_give_what_the_stages_computed_along_a_route():
    """A microbatch through stage 0 -> 1 -> back to 0, as the stage processes run it (activations detached
    between processes); each kind recomputed from the tensors the processes exchanged matches, and the
    shares are the stages' accumulated gradients."""
    s0, s1 = Stage(CFG, 0, 2, seed=3), Stage(CFG, 1, 2, seed=3)
    cpu = torch.device("cpu")
    visits0, visits1 = [], []
    for seed in (0, 1):
        tokens, targets = tokens_and_targets(seed)
        h0 = s0(s0.embed(tokens))
        x1 = h0.detach().requires_grad_(True)
        y1 = s1(x1)
        a = y1.detach().requires_grad_(True)
        loss = s0.loss(a, targets)
        loss.backward()
        y1.backward(a.grad)
        h0.backward(x1.grad)
        assert difference(h0, recompute(s0, "first", {"tokens": tokens}, cpu)) < 1e-6
        visit = recompute(s1, "visit", {"x": x1.detach(), "g": a.grad}, cpu)  # forward and backward, at once
        assert difference((y1, x1.grad), visit) < 1e-6
        assert difference(a.grad, recompute(s0, "loss", {"a": a.detach(), "targets": targets}, cpu)) < 1e-6
        # a visit's difference is its worse part's; a lie in either part shows
        assert difference((y1, -x1.grad), visit) == pytest.approx(2.0, rel=1e-5)
        assert difference((y1 * 3, x1.grad), visit) == pytest.approx(2.0, rel=1e-5)
        assert difference(y1, visit) == math.inf and difference((y1,), visit) == math.inf
        visits0.append({"tokens": tokens, "targets": targets, "a": a.detach(), "g": x1.grad})
        visits1.append({"x": x1.detach(), "g": a.grad})
    for stage, visits in ((s0, visits0), (s1, visits1)):
        share = torch.cat([p.grad.flatten() for p in stage.parameters()])
        again = recompute(stage, "share", {"visits": visits}, cpu)
        assert difference(share, again) < 1e-5
        assert all(p.grad is not None for p in stage.parameters())
        assert torch.equal(torch.cat([p.grad.flatten() for p in stage.parameters()]), share), \
            "recomputing accumulated nothing into the stage's own gradients"
    tokens, targets = tokens_and_targets(5)  # a microbatch that never leaves the origin: one graph
    s0.zero_grad()
    s0.loss(s0(s0.embed(tokens)), targets).backward()
    share = torch.cat([p.grad.flatten() for p in s0.parameters()])
    assert difference(share, recompute(s0, "share", {"visits": [{"tokens": tokens, "targets": targets}]}, cpu)) < 1e-5
    with pytest.raises(ValueError, match="kind must be one of"):
        recompute(s0, "guess", {}, cpu)


def test_difference_is_relative_and_not_finite_values_differ_unless_the_recomputation_has_them_too():
    want = torch.tensor([3.0, 4.0])
    assert difference(want.clone(), want) == 0.0
    assert difference(want * 1.01, want) == pytest.approx(0.01, rel=1e-4)
    assert difference(want * 1e6 * 1.01, want * 1e6) == pytest.approx(0.01, rel=1e-4), "relative: scale-free"
    assert difference(torch.tensor([3.0, math.nan]), want) == math.inf
    assert difference(torch.tensor([3.0, math.inf]), torch.tensor([3.0, math.inf])) == 0.0
    assert difference(torch.tensor([3.0, -math.inf]), torch.tensor([3.0, math.inf])) == math.inf
    assert difference(want[:1], want) == math.inf and difference("x", want) == math.inf


# -- judging evidence ----------------------------------------------------------------------------------
class FakeRoster:
    run_key = RUN_KEY
    inboxes: dict = {}


def verifier(mode: str = "full", rate: float = 0.05, roster: object = None,
             verifiers: int = 2, confirm_rate: float = 0.0) -> tuple[Verifier, list]:
    events = []
    config = types.SimpleNamespace(mode=mode, verify_rate=rate, tolerance=1e-3, stages=2, seed=0, bf16=False,
                                   aggregation="mean", verifiers=verifiers, confirm_rate=confirm_rate,
                                   timeout=5.0)
    return Verifier(config, CFG, roster or FakeRoster(), lambda kind, **f: events.append((kind, f))), events


def test_a_holder_that_withholds_or_alters_a_tensor_is_caught_and_a_dispute_blames_nobody():
    ka = receipts.node_key(RUN_KEY, "a")
    t = torch.randn(2, 3)
    key = T(7, "activation", 0, 1, "a")
    r = receipts.seal(ka, key, t)
    check = Check("a", 0, Kind.FIRST, 0, 0, Source("c", key), {"tokens": Source(value=t)})
    other_hop = dataclasses.replace(r, id=dataclasses.replace(key, hop=2))
    cases = {
        "shown": ({"c": {key: (t, r, False)}}, None, []),
        "withheld": ({"c": {}}, "c", []),
        "altered": ({"c": {key: (t + 1, r, False)}}, "c", []),
        "another hop's receipt": ({"c": {key: (t, other_hop, False)}}, "c", []),
        "another round's tensor": ({"c": {key: (t + 1, receipts.seal(ka, dataclasses.replace(key, round=6), t + 1),
                                                False)}}, "c", []),
        "disputed on arrival": ({"c": {key: (t + 1, r, True)}}, None, ["a", "c"]),
        "a MAC not a's": ({"c": {key: (t, receipts.seal(b"x" * 32, key, t), False)}},
                          None, ["a", "c"]),
    }
    for name, (shown, culprit, disputed) in cases.items():
        v, events = verifier()
        caught: dict = {}
        got = v.gather.evidence(check, shown, caught)
        assert (got is not None) == (name == "shown"), name
        assert list(caught) == ([culprit] if culprit else []), name
        disputes = [f for kind, f in events if kind == "dispute"]
        assert [d["nodes"] for d in disputes] == ([disputed] if disputed else []), name
        assert v.suspects == set(disputed), name


# -- an audit of one round, its stage processes simulated here ------------------------------------------
class LocalRound:
    """Round 0 of ``plan`` on ``batches``, its stage processes simulated in this process as ``stage_process``
    runs them: the replicas of a stage hold equal weights; each node seals what it sends (``Evidence``),
    keeps what it receives, sends its summed gradients to its stage's other replicas, combines theirs
    (``aggregate.combine``) and reports a ``Norm`` (``norms``); ``liars``: node -> the ``Adversary`` that
    tampers with what it sends. Then it is the verifier's roster: ``put`` answers the audit's requests as a
    stage process does (``EvidenceItems``, ``Rechecked``, ``WeightsShown``) and ``recv`` hands the answers over in
    the order they were sent, dropping and refusing what ``Roster.recv`` drops and refuses. ``dies``: (node,
    message type): the node dies as it is sent its first message of that type, and the next ``recv`` raises
    NodesLost for it before it hands over anything more (the real roster's check can see a death before
    the answers already on their way). ``sent``: every message the nodes were sent, in order."""

    run_key = RUN_KEY

    def __init__(self, plan, batches, liars=None, dies=None) -> None:
        self.plan, self.alloc, self.liars, self.dies, self.rnd = plan, dict(plan.allocation), liars or {}, dies, 0
        self.batches = batches
        weights = {s: Stage(CFG, s, 2, seed=0) for s in set(self.alloc.values())}
        self.stage = {n: copy.deepcopy(weights[s]) for n, s in self.alloc.items()}
        self.evidence = {n: Evidence(n, "spot", receipts.node_key(RUN_KEY, n)) for n in self.alloc}
        self.backwards = dict.fromkeys(self.alloc, 0)
        self.inboxes = dict.fromkeys(self.alloc)  # the live nodes, as the verifier reads them
        self.dying: list[str] = []
        self.answers: collections.deque = collections.deque()
        self.sent: list[tuple[str, m.Message]] = []
        for mb, route in enumerate(plan.paths):
            self._microbatch(mb, route, *batches[mb])
        self.norms = self._average()

    def norm(self) -> float:
        """The round's gradient norm, as the trainer makes it from the Norms (one per stage)."""
        sq: dict[int, float] = {}
        for msg in self.norms:
            sq.setdefault(msg.stage, msg.sq_norm)
        return math.sqrt(sum(sq.values()))

    def _send(self, sender, what, mb, hop, t, to, given=None):
        out = t.detach().contiguous()
        if sender in self.liars:
            out = self.liars[sender].tamper(what, out, sender, self.rnd, mb, given).contiguous()
        receipt = self.evidence[sender].seal(what, self.rnd, mb, hop, out)
        for r in [to] if isinstance(to, str) else to:
            self.evidence[r].keep(what, self.rnd, mb, hop, sender, out, receipt)
        return out

    def _microbatch(self, mb, route, tokens, targets) -> None:
        o, nodes = route.origin, route.nodes
        first = self.stage[o]
        h = first(first.embed(tokens))
        self.backwards[o] += 1
        if not nodes:  # the loss at once, one graph
            first.loss(h, targets).backward()
            return
        t, stash = self._send(o, "activation", mb, 0, h, nodes[0]), []
        for hop, name in enumerate(nodes):
            x = t.detach().requires_grad_(True)
            y = self.stage[name](x)
            stash.append((x, y))
            t = self._send(name, "activation", mb, hop + 1, y, nodes[hop + 1] if hop + 1 < len(nodes) else o, given=t)
        a = t.detach().requires_grad_(True)
        first.loss(a, targets).backward()
        g = self._send(o, "gradient", mb, len(nodes) - 1, a.grad, nodes[-1])
        for hop in range(len(nodes) - 1, -1, -1):
            x, y = stash[hop]
            y.backward(g)
            self.backwards[nodes[hop]] += 1
            g = self._send(nodes[hop], "gradient", mb, hop - 1, x.grad, nodes[hop - 1] if hop else o, given=g)
        h.backward(g)

    def _average(self) -> list:
        norms, visits = [], self.plan.stage_visits()
        for s in sorted(set(self.alloc.values())):
            replicas = sorted(n for n, st in self.alloc.items() if st == s)
            shares = {}
            for r in replicas:
                mine = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float()
                                  for p in self.stage[r].parameters()])
                # a liar combines the share it sent, as its replicas do
                shares[r] = mine if len(replicas) == 1 else self._send(
                    r, "share", -1, -1, mine, [o for o in replicas if o != r])
            total = combine([shares[r] for r in replicas], [self.backwards[r] for r in replicas], visits[s])
            for r in replicas:
                ev = self.evidence[r]
                cosines = ev.shares(self.rnd, shares, self.backwards) if len(replicas) > 1 else {}
                norms.append(m.Norm(self.rnd, r, s, float(total.pow(2).sum()), ev.summaries(),
                                    tuple(ev.disputes), cosines or None,
                                    ev.combined(total) if len(replicas) > 1 else None))
        return norms

    def put(self, name: str, msg: m.Message) -> None:
        self.sent.append((name, msg))
        if name not in self.inboxes or name in self.dying:
            return
        if self.dies == (name, type(msg)):
            self.dying.append(name)
            return
        stage = self.alloc[name]
        if isinstance(msg, m.EvidenceRequest):
            items = self.evidence[name].show(msg.keys) if msg.round == self.rnd else {}
            self.answers.append(m.EvidenceItems(msg.round, name, items, msg.ask))
        elif isinstance(msg, m.Recheck):  # as StageProcess._on_recheck
            self.answers.append(recheck(self.stage[name], stage, msg, torch.device("cpu"),
                                        conduct=self.liars.get(name, HONEST), name=name))
        elif isinstance(msg, m.ShowWeights):
            self.answers.append(m.WeightsShown(msg.round, name, stage, {
                k: v.detach().clone() for k, v in self.stage[name].state_dict().items()}))
        else:
            raise AssertionError(f"the audit sent {name} a {type(msg).__name__}")

    def recv(self, kind, timeout=None, rnd=None, names=None, check=True) -> m.Message:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        while True:
            if self.dying:
                lost = {n: "its process exited with code -9" for n in self.dying}
                self.dying.clear()
                for n in lost:
                    del self.inboxes[n]
                raise NodesLost(lost)
            if not self.answers:
                raise NoMessage(f"no {kinds[0].__name__}: nothing more is on its way")
            msg = self.answers.popleft()
            if isinstance(msg, m.RoundMessage) and (not isinstance(msg, kinds) or rnd is not None and msg.round != rnd):
                continue
            if msg.sender not in self.inboxes:
                continue
            if not isinstance(msg, kinds) or names is not None and msg.sender not in names:
                raise NodeFailed(f"{type(msg).__name__} from {msg.sender}: not what was waited for")
            return msg

    def left(self) -> list[str]:
        """The answers on their way that a later wait would not drop (it refuses them: NodeFailed)."""
        return [f"{type(msg).__name__} from {msg.sender}" for msg in self.answers
                if not isinstance(msg, m.RoundMessage) and msg.sender in self.inboxes]


#: 2 replicas of each of 2 stages; microbatch 0 goes a -> c -> a, microbatch 1 b -> d -> b
PLAN = Plan(2, 0.0, {"a": 0, "b": 0, "c": 1, "d": 1}, [Route("a", ("c",), (1,)), Route("b", ("d",), (1,))])


@pytest.mark.parametrize("victim, asked", [("a", m.EvidenceRequest), ("d", m.Recheck), ("d", m.ShowWeights)],
                         ids=["evidence", "recheck", "weights"])
def test_a_node_the_audit_asks_that_dies_meanwhile_makes_it_raise_nodes_lost_naming_it_and_leave_nothing_to_come(
        victim, asked):
    """Mode "full", c's activations scaled: the node asked dies as it is asked, and its death is seen before
    the other nodes' answers arrive: a, for the evidence it holds (c's activations); d, to recheck c's work;
    d again, for its weights, when the coordinator confirms d's finding that c's work differs (c is asked for
    its weights too). The audit raises NodesLost naming it (the trainer runs the round again), and no answer
    is left on its way that the trainer's next wait would refuse (every answer belongs to the round, and a
    later round's wait drops it)."""
    batches = [tokens_and_targets(0), tokens_and_targets(1)]
    r = LocalRound(PLAN, batches, liars={"c": Adversary("scale")}, dies=(victim, asked))
    v, _ = verifier("full", roster=r)
    v.begin(0, PLAN, dict(PLAN.allocation), batches)
    for msg in r.norms:
        v.note(msg)
    with pytest.raises(NodesLost) as lost:
        v.audit(0, r.norm())
    assert any(n == victim and isinstance(msg, asked) for n, msg in r.sent), "it was asked"
    assert list(lost.value.names) == [victim]
    assert r.left() == []


def test_an_audit_runs_alongside_its_round_each_check_starting_as_soon_as_what_it_checks_was_sent():
    """Mode "full", c's tensors scaled. Nothing is asked before a microbatch is done; microbatch 0 done,
    the evidence of its computations alone is asked for; its answers taken (as the trainer hands them
    over while it waits for the round's messages), each computation goes to the other replica of its
    stage to recheck; d's mismatch on c's work has both weights asked for, and the coordinator's
    confirmation catches c, all before the round's end. A replica's share is drawn once it and the
    holder of its share have both averaged. The audit's end checks what is left; the work of a node
    caught is not checked any more."""
    batches = [tokens_and_targets(0), tokens_and_targets(1)]
    r = LocalRound(PLAN, batches, liars={"c": Adversary("scale")})
    v, events = verifier("full", roster=r)

    def take_answers() -> None:
        while r.answers:
            v.take(r.answers.popleft())

    v.begin(0, PLAN, dict(PLAN.allocation), batches)
    assert r.sent == []
    v.finished(0, 0)
    asked = [msg for _, msg in r.sent]
    assert asked and all(isinstance(msg, m.EvidenceRequest) for msg in asked)
    assert {key.mb for msg in asked for key in msg.keys} == {0}, "microbatch 0's tensors only"
    take_answers()
    rechecks = [(n, msg) for n, msg in r.sent if isinstance(msg, m.Recheck)]
    assert sorted(msg.kind for _, msg in rechecks) == ["first", "loss", "visit"]
    assert {n for n, msg in rechecks if msg.kind == "visit"} == {"d"}, "c's work to d"
    take_answers()
    assert {n for n, msg in r.sent if isinstance(msg, m.ShowWeights)} == {"c", "d"}
    take_answers()
    assert [(f["node"], f["check"], f["mb"]) for kind, f in events if kind == "caught"] == [("c", "visit", 0)]
    assert [f["why"][:48] for kind, f in events if kind == "caught"] == [
        "its forward and backward of microbatch 0 differ "], "c scales all it sends: both parts"
    before = len(r.sent)
    a, b = (msg for msg in r.norms if msg.sender in ("a", "b"))
    v.note(a)
    assert len(r.sent) == before, "a's share is held by b, which has not averaged yet"
    v.note(b)
    shares = {key for _, msg in r.sent[before:] if isinstance(msg, m.EvidenceRequest) for key in msg.keys
              if key.what == "share"}
    assert shares == {T(0, "share", -1, -1, "a"), T(0, "share", -1, -1, "b")}
    for msg in r.norms:
        if msg.sender in ("c", "d"):
            v.note(msg)
    assert list(v.audit(0, r.norm())) == ["c"]
    # every computation of the round but c's share: c was out before its share was drawn
    assert v.last["checks"] == 9 and v.last["caught"] == ["c"]
    assert not [f for kind, f in events if kind == "caught" and f["node"] != "c"]


def test_a_round_given_up_hands_over_whom_its_audit_caught_so_far_and_drops_the_rest():
    """c caught while its round runs (as above); the round is then given up (a node lost, or the round
    stalled): ``abandon`` returns c, for the trainer to exclude all the same; answers of that round that
    come later are ignored, and its audit cannot be finished."""
    batches = [tokens_and_targets(0), tokens_and_targets(1)]
    r = LocalRound(PLAN, batches, liars={"c": Adversary("scale")})
    v, events = verifier("full", roster=r)
    v.begin(0, PLAN, dict(PLAN.allocation), batches)
    v.finished(0, 0)
    for _ in range(3):  # evidence, then rechecks, then weights
        while r.answers:
            v.take(r.answers.popleft())
    assert list(v.abandon()) == ["c"]
    assert v.abandon() == {}
    v.finished(0, 1)
    v.take(m.Rechecked(0, "d", 1, math.inf))
    assert [f["node"] for kind, f in events if kind == "caught"] == ["c"]
    with pytest.raises(ValueError, match="not told of"):
        v.audit(0, r.norm())


def test_the_screening_rows_of_a_round_given_up_still_count_for_their_senders():
    """Each Norm's screening rows are screened as it comes (``Verifier.note``); when the round is then given
    up, what was noted stays in each sender's running statistics (those tensors were sent), and the next
    round's rows add to them."""
    batches = [tokens_and_targets(0), tokens_and_targets(1)]
    r = LocalRound(PLAN, batches)
    v, _ = verifier("screen", roster=r)
    rows = collections.Counter((row.tensor.what, row.tensor.sender) for msg in r.norms for row in msg.screened)
    assert rows, "every node reports what it received"

    def counted() -> collections.Counter:
        out: collections.Counter = collections.Counter()
        for boundary, nodes in v.screen.nodes.items():
            for n, ns in nodes.items():
                out[boundary[0], n] += ns.stats["norm"].count + sum(ns.found.values())
        return out

    v.begin(0, PLAN, dict(PLAN.allocation), batches)
    for msg in r.norms:
        v.note(msg)
    v.abandon()
    assert counted() == rows
    v.begin(1, PLAN, dict(PLAN.allocation), batches)
    for msg in r.norms:  # the same tensors again, as round 1's
        again = tuple(Screened(dataclasses.replace(row.tensor, round=1), row.summary) for row in msg.screened)
        v.note(dataclasses.replace(msg, round=1, screened=again))
    assert counted() == rows + rows


@pytest.mark.parametrize("loads, named", [({"a": 3, "b": 1}, False), ({"a": 1, "b": 1}, True)],
                         ids=["unequal-loads", "equal-loads"])
def test_shares_are_screened_per_load_so_honest_replicas_of_unequal_loads_are_not_named(loads, named):
    """A stage's two replicas, a and b, whose shares are noise-dominated gradients summed over their loads:
    summarised per microbatch, a share of 3 has a third of the variance of a share of 1, so its log norm
    stands about log(sqrt(3)) apart from the other's however honest both are (a 200-iteration clean run had
    such a pair named at iteration 67). Screened per load, they are not compared: 200 rounds name nobody.
    Of equal loads, shares that far apart are a pair to name (one of them scales its share): both are."""
    alloc = {"a": 0, "b": 0, "x": 1}
    v, events = verifier("screen")
    g = torch.Generator().manual_seed(0)
    for rnd in range(200):
        a = Audit(rnd, None, alloc, {}, {}, loads)
        rows = tuple(Screened(T(rnd, "share", -1, -1, n),
                              summarize(sum(torch.randn(2000, generator=g) for _ in range(k)), divisor=k))
                     for n, k in (("a", 3), ("b", 1)))
        v.reports.screen_norm(a, m.Norm(rnd, "x", 1, 1.0, rows, (), None, None))
        v.reports.suspects(a)
    suspects = {(f["node"], f["check"]) for kind, f in events if kind == "suspect"}
    assert not a.caught
    assert suspects == ({("a", "norm"), ("b", "norm"), ("a", "std"), ("b", "std")} if named else set()), suspects


def test_a_shares_cosine_is_what_its_other_replicas_report_and_a_malformed_report_has_its_sender_caught():
    """A replica's cosine of its own share (its sender has no say on its own) or of another stage's is
    not taken; the median of the other replicas' reports is. A Norm whose screening report is not one (a
    row, a summary, a disputed key or a cosine of another shape) has its sender caught ("report"), with
    nothing of it screened; every Norm that honest nodes make passes."""
    alloc = {"a": 0, "b": 0, "c": 0, "d": 0, "x": 1}
    v, events = verifier("screen")
    a = Audit(0, None, alloc, {}, {})
    for sender, cos in (("a", {"a": 1.0, "b": 0.2, "x": -1.0}), ("c", {"b": 0.4}), ("d", {"b": 0.9}),
                        ("x", {"a": -1.0})):
        v.reports.screen_norm(a, m.Norm(0, sender, alloc[sender], 1.0, (), (), cos, None))
    assert a.cosines == {"b": [0.2, 0.4, 0.9]} and not a.caught and not events
    v.reports.suspects(a)
    assert v.screen.nodes[("share", 0)]["b"].stats["cosine"].mean == pytest.approx(0.4)
    good = summarize(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
    key = T(0, "activation", 0, 1, "a")
    row = Screened(key, good)
    bad = {"a row that is a tuple": dict(screened=(("activation", 0, 1, "a", good),)),
           "rows not a tuple": dict(screened=[row]),
           "a summary not sound": dict(screened=(Screened(key, Summary((), math.nan, 0.0, 0.0)),)),
           "a hop not a number": dict(screened=(Screened(dataclasses.replace(key, hop="1"), good),)),
           "a row of another round": dict(screened=(Screened(dataclasses.replace(key, round=3), good),)),
           "a row of no kind of tensor": dict(screened=(Screened(dataclasses.replace(key, what="weights"), good),)),
           "a disputed key that is a tuple": dict(disputes=(("activation", 0, 1, "a"),)),
           "cosines not a dict": dict(cosines=[("b", 0.5)]), "a cosine of 3": dict(cosines={"b": 3.0}),
           "a cosine not a number": dict(cosines={"b": "high"}), "a NaN cosine": dict(cosines={"b": math.nan})}
    for why, fields in bad.items():
        v, events = verifier("screen")
        a = Audit(0, None, alloc, {}, {})
        msg = dataclasses.replace(m.Norm(0, "c", 0, 1.0, (row,), (), None, None), **fields)
        v.reports.screen_norm(a, msg)
        assert list(a.caught) == ["c"] and a.caught["c"].startswith("report:"), why
        assert [f["check"] for kind, f in events if kind == "caught"] == ["report"], why
        assert not v.screen.nodes and not a.cosines, why
    batches = [tokens_and_targets(0), tokens_and_targets(1)]
    r = LocalRound(PLAN, batches, liars={"c": Adversary("scale")})
    v, _ = verifier("screen", roster=r)
    a = Audit(0, PLAN, dict(PLAN.allocation), {}, {})
    for msg in r.norms:
        v.reports.screen_norm(a, msg)
    assert not a.caught and v.screen.nodes


def test_a_screening_report_read_off_the_wire_is_judged_as_the_rows_its_sender_sent():
    """A ``Norm``'s rows read off the wire (``rows.ScreenedRows``, judged from its columns) are well formed
    exactly where the tuple of rows its sender sent is: a NaN or infinite statistic, a profile with a NaN or
    an infinity, or a row of another round has its sender caught ("report"); a row with a finding is sound
    whatever its statistics or profile (judged row by row where it has a profile); honest rows pass."""
    alloc = {"a": 0, "b": 0, "c": 0}
    good = summarize(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
    key = T(0, "activation", 0, 1, "a")
    with_nan = good.profile.clone()
    with_nan[2] = math.nan
    cases = {"honest rows": ((Screened(key, good), Screened(T(0, "share", -1, -1, "b"), Summary(("zeros",)))), True),
             "no rows": ((), True),
             "a NaN norm": ((Screened(key, dataclasses.replace(good, norm=math.nan)),), False),
             "an infinite std": ((Screened(key, good), Screened(key, dataclasses.replace(good, std=-math.inf))), False),
             "a NaN in a profile": ((Screened(key, good), Screened(key, dataclasses.replace(good, profile=with_nan))),
                                    False),
             "an infinite profile": ((Screened(key, dataclasses.replace(good, profile=torch.full((3,), math.inf))),),
                                     False),
             "a row of another round": ((Screened(key, good), Screened(dataclasses.replace(key, round=3), good)),
                                        False),
             "a finding, and a NaN mean beside it": ((Screened(key, Summary(("zeros",))),
                                                      Screened(key, dataclasses.replace(good, mean=math.nan))), False),
             "a finding with NaN statistics": ((Screened(key, Summary(("non-finite",), math.nan, 0.0, math.inf)),),
                                               True),
             "a finding with a NaN profile": ((Screened(key, Summary(("zeros",), 0.0, 0.0, 0.0, with_nan)),
                                               Screened(key, good)), True),
             "a finding with a profile, and a NaN norm": ((Screened(key, Summary(("zeros",), 0.0, 0.0, 0.0, with_nan)),
                                                          Screened(key, dataclasses.replace(good, norm=math.nan))),
                                                         False)}
    for why, (rows, ok) in cases.items():
        sent = m.Norm(0, "c", 0, 1.0, rows, (), None, None)
        read = codec.decode(codec.encode(sent), "c")
        assert type(read.screened) is (ScreenedRows if rows else tuple), why
        assert well_formed(sent) is ok and well_formed(read) is ok, why
        v, events = verifier("screen")
        a = Audit(0, None, alloc, {}, {})
        v.reports.screen_norm(a, read)
        assert (list(a.caught) == ["c"] and a.caught["c"].startswith("report:")) is not ok, why
        assert [f["check"] for kind, f in events if kind == "caught"] == ([] if ok else ["report"]), why


def test_a_gradient_norm_that_is_not_finite_has_every_computation_of_the_round_checked_and_its_maker_caught():
    """Mode "spot" at rate 0 (nothing is drawn): c sends a NaN in its activations of microbatch 0, which
    reaches the loss, the gradients, stage 0's combined gradient and so the norm. Every computation of the
    round is then checked, each rechecked by the other replica of its stage: 3 a microbatch (the origin's
    first forward, the visit at stage 1: its forward and backward, the loss) and the 4 replicas' shares;
    c is caught, and no honest node, though a's loss, c's backward and a's and c's shares are NaN too.
    With a finite norm, the same round has only the tensors screening found non-finite checked."""
    batches = [tokens_and_targets(0), tokens_and_targets(1)]
    r = LocalRound(PLAN, batches, liars={"c": Adversary("nan")})
    norm = r.norm()
    assert not math.isfinite(norm), "c's NaN reached the gradient norm"
    v, events = verifier("spot", rate=0.0, roster=r)
    v.begin(0, PLAN, dict(PLAN.allocation), batches)
    for msg in r.norms:
        v.note(msg)
    caught = v.audit(0, norm)
    every = sum(len(route.nodes) + 2 for route in PLAN.paths) + len(PLAN.allocation)
    assert every == 10 and v.last["checks"] == every
    rechecks = [msg for _, msg in r.sent if isinstance(msg, m.Recheck)]
    assert collections.Counter(msg.kind for msg in rechecks) == {"first": 2, "visit": 2, "loss": 2, "share": 4}
    assert v.last["rechecks"] == every
    assert list(caught) == ["c"] and [f["node"] for kind, f in events if kind == "caught"] == ["c"]
    assert not [f for kind, f in events if kind == "dispute"]
    v, _ = verifier("spot", rate=0.0, roster=r)  # the same round, its norm finite
    v.begin(0, PLAN, dict(PLAN.allocation), batches)
    for msg in r.norms:
        v.note(msg)
    assert list(v.audit(0, 1.0)) == ["c"]
    assert 0 < v.last["checks"] < every


def test_in_screen_mode_a_last_stage_that_makes_its_activations_nan_is_caught_in_that_round_and_nobody_else():
    """The plan given explicitly (PLAN: microbatch 0 goes a -> c -> a): c, the last stage its microbatch
    visits, makes its activations NaN. The loss at a is then NaN, and so is the gradient that comes back
    to c, but c's forward output was computed from finite activations alone: screen mode catches c for
    it, before the step, in this round ("non-finite", its visit of microbatch 0), and neither a (its loss
    and share computed from c's NaN) nor anyone else. Judged with the gradient that came back for it, c's
    visit was excused: nobody was caught, the NaN reached the step, and honest nodes were blamed in the
    next round (their weights NaN by then)."""
    batches = [tokens_and_targets(0), tokens_and_targets(1)]
    r = LocalRound(PLAN, batches, liars={"c": Adversary("nan")})
    norm = r.norm()
    assert not math.isfinite(norm), "c's NaN reached the gradient norm"
    v, events = verifier("screen", roster=r)
    v.begin(0, PLAN, dict(PLAN.allocation), batches)
    for msg in r.norms:
        v.note(msg)
    assert list(v.audit(0, norm)) == ["c"]
    assert [(f["node"], f["check"], f["computation"], f["mb"]) for kind, f in events if kind == "caught"] == [
        ("c", "non-finite", "visit", 0)]
    assert not [f for kind, f in events if kind == "dispute"]


def test_replicas_that_step_to_different_weights_a_majority_of_three_names_the_odd_one_two_are_a_dispute():
    """After each step every replica of a stage with others reports the digest of its weights: equal digests
    pass; where they differ, a strict majority of 3 or more names the others (a missing digest counts as
    a different one), caught for check "weights"; 2 replicas that differ, or no majority, are a dispute
    that blames nobody; a stage of one replica, or a node that did not step, is not compared; mode "off"
    compares nothing."""
    alloc = {"a": 0, "b": 0, "c": 0, "d": 1, "e": 1, "f": 2, "g": 3, "h": 3, "i": 3, "j": 3}
    good, bad, other = b"w" * 32, b"x" * 32, b"y" * 32
    v, events = verifier("screen")
    assert v.stepped(0, alloc, dict.fromkeys(alloc, good)) == {} and events == []
    caught = v.stepped(1, alloc, {"a": good, "b": bad, "c": good, "d": good, "e": bad, "f": None,
                                  "g": good, "h": good, "i": None})  # j did not step (it died)
    assert sorted(caught) == ["b", "i"]
    found = {f["node"]: f for kind, f in events if kind == "caught"}
    assert set(found) == {"b", "i"} and all(f["check"] == "weights" for f in found.values())
    assert found["b"]["agreeing"] == ["a", "c"]
    assert "other weights than 2 of the 3 replicas of stage 0" in found["b"]["why"]
    assert "reported no digest" in found["i"]["why"] and found["i"]["agreeing"] == ["g", "h"]
    disputes = [f for kind, f in events if kind == "dispute"]
    assert [(f["nodes"], f["stage"]) for f in disputes] == [(["d", "e"], 1)], "two replicas: who is right is unknown"
    assert v.held["a"] == (0, good) and v.held["e"] == (1, bad) and "b" not in v.held and "f" not in v.held
    events.clear()
    assert v.stepped(2, {"a": 0, "b": 0, "c": 0}, {"a": good, "b": bad, "c": other}) == {}
    assert [f["nodes"] for kind, f in events] == [["a", "b", "c"]], "no majority: a dispute"
    events.clear()
    mixed = {"a": 0, "b": 0, "c": 0, "d": 0, "e": 0}
    on = {"a": "cpu:AVX2", "b": "cpu:AVX2", "c": "cpu:AVX2", "d": "cuda:X", "e": "cuda:X"}
    caught = v.stepped(3, mixed, {"a": good, "b": good, "c": bad, "d": other, "e": other}, on)
    assert list(caught) == ["c"], "compared within a platform: d and e step to other bits, as their platform does"
    assert not [f for kind, f in events if kind == "dispute"]
    v.stepped(3, {"a": 0, "d": 1}, {"a": None, "d": None})
    assert "a" not in v.held and "d" not in v.held, "stepped alone: what it holds now is not known"
    assert "b" in v.held
    v.loaded(["b"])
    assert "b" not in v.held, "loaded another stage's weights: its report no longer holds"
    off, events = verifier("off")
    assert off.stepped(0, alloc, {"a": good, "b": bad, "c": good}) == {} and events == []


def test_the_combined_digest_is_asked_only_where_the_weights_check_could_not_name_a_wrong_combiner():
    """3 replicas or more that reported one platform: no digest of the combined gradient is asked (one that
    combined another steps to other weights, which the majority names); 2 replicas, platforms unknown or
    mixed, or a replica that loaded other weights since: asked. A replica is compared on the platform it
    reported first: a new claim after it does not take it out of its group."""
    v, events = verifier("spot")
    alloc = {"a": 0, "b": 0, "c": 0, "d": 1, "e": 1, "f": 2, "g": 2, "h": 2}
    assert v.combined_needed(["a", "b", "c"]), "no platform reported yet"
    same = {n: b"w" * 32 for n in alloc}
    plats = dict.fromkeys(alloc, "cpu avx2 torch 2") | {"h": "cuda H100 sm90 torch 2"}
    assert v.stepped(0, alloc, same, plats) == {}
    assert not v.combined_needed(["a", "b", "c"])
    assert v.combined_needed(["d", "e"]) and v.combined_needed(["f", "g", "h"])
    # a digest that nobody asked for is no evidence: the others keep no combined gradient to show
    audit = Audit(1, None, alloc, {}, {}, norms=[m.Norm(1, n, s, 1.0, (), (), None, b"d" * 32 if n == "a" else None)
                                                  for n, s in alloc.items()])
    v.replicas.averaging(audit)  # (FakeRoster cannot be asked for evidence: an ask would raise)
    assert not audit.caught and not audit.asks and not events
    v._audit = audit  # the round's SyncOrders: the audit remembers which stages were asked
    assert v.combined_asked(1, ["e", "d"]) and not v.combined_asked(1, ["a", "b", "c"])
    assert v.combined_asked(2, ["f", "g", "h"])  # (mixed platforms) another round's: not this audit's
    assert audit.combined == {("d", "e")}
    caught = v.stepped(1, alloc, same | {"c": b"x" * 32}, plats | {"c": "a platform of its own"})
    assert list(caught) == ["c"] and caught["c"].startswith("weights:"), caught
    v.loaded(["a"])
    assert v.combined_needed(["a", "b"]) and v.combined_needed(["a", "b", "g"])
    assert v.stepped(2, alloc, same, plats | {"a": ["not", "a", "name"]}) == {}  # (no majority to name it by)
    assert v.combined_needed(["a", "b", "c"]), "a platform of its own: the averaging check again"
    assert not verifier("off")[0].combined_needed(["a", "b"])


def test_a_platform_names_the_device_kind_its_model_and_torch():
    """What a replica's weights are compared within (``evidence.platform``): on the CPU, the vector unit
    torch dispatches to, and torch's version; replicas differing in either are not compared."""
    here = platform(torch.device("cpu"))
    assert here == f"cpu:{torch.backends.cpu.get_cpu_capability()}:torch {torch.__version__}"


@pytest.mark.parametrize("who", ["c", "d"])
def test_a_confirmation_catches_a_node_whose_weights_shown_are_not_those_it_reported_after_its_step(who):
    """c's visit differs (it scales what it sends), d rechecks it and reports the mismatch, and the
    coordinator asks both for their weights: a node (the one checked or its verifier) that shows other
    weights than the digest it reported after its latest step is caught for check "weights" (it may
    compute with other weights than it shows); the other is not blamed for it."""
    batches = [tokens_and_targets(0), tokens_and_targets(1)]
    r = LocalRound(PLAN, batches, liars={"c": Adversary("scale")})
    v, events = verifier("full", roster=r)
    honest = receipts.weights_digest(r.stage["d"].state_dict())
    v.held.update(c=(1, honest), d=(1, honest))
    v.held[who] = (1, b"z" * 32)  # what it reported after its step is not what it shows now
    v.begin(0, PLAN, dict(PLAN.allocation), batches)
    for msg in r.norms:
        v.note(msg)
    caught = v.audit(0, r.norm())
    checks = {f["node"]: f["check"] for kind, f in events if kind == "caught"}
    assert checks[who] == "weights" and who in caught
    assert "showed other weights of stage 1 than it reported" in caught[who]
    if who == "d":  # c's own lie is still caught by the recomputation of another of its computations
        assert set(caught) <= {"c", "d"}
    assert not set(checks) - {"c", "d"}


def audited(r: LocalRound, mode: str = "full", **settings) -> tuple[Verifier, list, dict[str, str]]:
    """The whole audit of ``r``'s round by a verifier of ``mode`` (``settings``: as ``verifier`` takes
    them): the verifier, its events and whom it caught."""
    v, events = verifier(mode, roster=r, **settings)
    v.begin(0, r.plan, dict(r.plan.allocation), r.batches)
    for msg in r.norms:
        v.note(msg)
    return v, events, v.audit(0, r.norm())


class Accomplice:
    """A verifier that computes honestly but passes every recheck it is sent (as a colluder does for its
    accomplice's work): the ``Adversary`` interface that ``LocalRound`` and ``evidence.recheck`` call."""

    def tamper(self, what, tensor, node, rnd, mb, given=None):
        return tensor

    def reports(self, node, rnd, difference):
        return 0.0


class Fixed(random.Random):
    """Draws that always come out ``x`` (for ``Verifier.rng``; its choices of verifiers as a seeded one's)."""

    def __init__(self, x: float) -> None:
        super().__init__(0)
        self.x = x

    def random(self) -> float:
        return self.x


@pytest.mark.parametrize("x, made_up", [(0.21, True), (0.22, False)])
def test_a_negated_share_is_opposed_and_its_nodes_computations_of_the_round_are_made_up_to_the_suspects_rate(
        x, made_up):
    """Mode "spot" at 0.05, c negating its gradients and share, after 4 rounds in which c's and d's shares
    pointed together (cosines 0.02 and 0.03, given to the screen); every draw comes out ``x``, so none is
    drawn as the round runs (x > 0.05). At the round's end c's share points away from d's: their cosine is
    below 0 and 3 standard deviations below those rounds', so both are opposed (with 2 replicas the one
    cosine is both shares'), and each computation of theirs is drawn again with the chance that makes its
    whole chance SUSPECT_RATE: (0.25 - 0.05) / (1 - 0.05) = 0.2105, so at 0.21 all of c's and d's are
    checked and c is caught, at 0.22 none is. Stage 0's pair (a, b), with no earlier rounds, is not opposed
    whatever its cosine (it got c's negated gradients), and gets no second draw. Without the liar c's and
    d's cosine is above 0: nobody is opposed, nothing drawn."""
    batches = [tokens_and_targets(0), tokens_and_targets(1)]
    for liars in ({"c": Adversary("signflip")}, {}):
        r = LocalRound(PLAN, batches, liars=liars)
        v, events = verifier("spot", rate=0.05, roster=r)
        for cosine in (0.02, 0.03, 0.02, 0.03):
            assert not v.screen.cosine(("share", 1), "c", cosine) and not v.screen.cosine(("share", 1), "d", cosine)
        v.rng = Fixed(x)
        v.begin(0, PLAN, dict(PLAN.allocation), batches)
        v.finished(0, 0)
        v.finished(0, 1)
        for msg in r.norms:
            v.note(msg)
        assert not r.sent, "nothing drawn as the round ran"
        caught = v.audit(0, r.norm())
        cosine = next(msg.cosines["c"] for msg in r.norms if msg.sender == "d")
        if not liars:
            assert cosine > 0 and v.last["opposed"] == [] and v.last["checks"] == 0 and not caught
            continue
        assert cosine < 0 and v.last["opposed"] == ["c", "d"]
        theirs = [c for c in round_checks(0, PLAN, dict(PLAN.allocation), batches) if c.node in ("c", "d")]
        assert v.last["checks"] == (len(theirs) if made_up else 0)
        assert list(caught) == (["c"] if made_up else [])


def test_a_suspect_named_at_the_rounds_end_has_its_computations_of_that_round_made_up_to_the_suspects_rate():
    """Mode "spot" at 0.05, an honest round, every draw coming out 0.21 (none drawn as the round runs). Stage
    0's pair (a, b) had its shares' cosine at -0.5 in 8 earlier rounds (given to the screen: the same each
    round, so no round is opposed): at this round's end the band names both (their mean cosine far below
    0), and their computations of this very round are drawn again with the make-up chance 0.2105, so all
    are checked; stage 1's (c, d), not suspects, are not. Nobody is caught (the round is honest)."""
    batches = [tokens_and_targets(0), tokens_and_targets(1)]
    r = LocalRound(PLAN, batches)
    v, events = verifier("spot", rate=0.05, roster=r)
    for _ in range(8):
        assert not v.screen.cosine(("share", 0), "a", -0.5) and not v.screen.cosine(("share", 0), "b", -0.5)
    v.rng = Fixed(0.21)
    v.begin(0, PLAN, dict(PLAN.allocation), batches)
    v.finished(0, 0)
    v.finished(0, 1)
    for msg in r.norms:
        v.note(msg)
    assert not r.sent and not v.suspects, "nothing drawn as the round ran, nobody a suspect yet"
    assert v.audit(0, r.norm()) == {}
    assert v.suspects == {"a", "b"} and v.last["opposed"] == []
    assert {(f["node"], f["check"]) for kind, f in events if kind == "suspect"} == {("a", "cosine"), ("b", "cosine")}
    theirs = [c for c in round_checks(0, PLAN, dict(PLAN.allocation), batches) if c.node in ("a", "b")]
    assert v.last["checks"] == len(theirs) > 0


def test_what_a_turned_nodes_verifier_passed_before_the_round_ended_is_confirmed_at_its_end():
    """Mode "spot" at rate 1 and ``confirm_rate`` 0: stage 1 is c and d, c scales what it sends and d passes
    every recheck (the whole stage in league). Every computation is drawn as the round runs, and every
    answer has come (all passed) before the round's end, where screening finds c and d turned (given
    here: one round cannot have a profile of its own to lose). Those passed rechecks of theirs are then
    confirmed by the coordinator: c is caught for its computation, d for a false match, nobody else; with
    no node turned nothing is confirmed and nobody is caught."""
    batches = [tokens_and_targets(0), tokens_and_targets(1)]
    for turned in ({"c": [("activation", 1, 1)], "d": [("activation", 1, 1)]}, {}):
        r = LocalRound(PLAN, batches, liars={"c": Adversary("scale"), "d": Accomplice()})
        v, events = verifier("spot", rate=1.0, roster=r)
        v.screen.turned = lambda: turned
        v.begin(0, PLAN, dict(PLAN.allocation), batches)
        v.finished(0, 0)
        v.finished(0, 1)
        for msg in r.norms:
            v.note(msg)
        while r.answers:  # every answer taken while the round runs
            v.take(r.recv(v.kinds))
        passed = [k for k in v._audit.rechecks.values() if k.check.node in ("c", "d")]
        assert passed and all(not k.confirming and set(k.answers.values()) == {0.0} for k in passed)
        caught = v.audit(0, r.norm())
        checks = {f["node"]: f["check"] for kind, f in events if kind == "caught"}
        if turned:
            assert set(caught) == {"c", "d"} and checks["d"] == "false match" and v.last["turned"] == ["c", "d"]
            assert v.last["confirmations"] >= 1
        else:
            assert caught == {} and v.last["confirmations"] == 0


#: stage 1 has 3 replicas: microbatch 0 goes a -> c -> a, 1 b -> d -> b, 2 a -> e -> a
PLAN3 = Plan(2, 0.0, {"a": 0, "b": 0, "c": 1, "d": 1, "e": 1},
             [Route("a", ("c",), (1,)), Route("b", ("d",), (1,)), Route("a", ("e",), (1,))])


@pytest.mark.parametrize("verifiers", [1, 2])
def test_with_two_verifiers_an_accomplice_that_passes_a_wrong_computation_is_caught_with_its_maker(verifiers):
    """Stage 1 has 3 replicas: c scales what it sends, d passes every recheck (an accomplice), e is
    honest. Mode "full": each computation of c is rechecked by ``verifiers`` of d and e (its share by
    one). With 2, e's
    mismatch has the coordinator confirm, c is caught for its computation and d for a "false match" (the
    coordinator's difference is far beyond what float nondeterminism could make d's 0), with the evidence;
    e is not blamed. With 1, each computation goes to d or e at random: c is caught where e was drawn
    for one of its computations (not otherwise: d passes them all), and d's matches are never held to a
    confirmation: it is not caught, the escape that 2 closes."""
    batches = [tokens_and_targets(i) for i in range(3)]
    r = LocalRound(PLAN3, batches, liars={"c": Adversary("scale"), "d": Accomplice()})
    v, events, caught = audited(r, verifiers=verifiers)

    def per_check(stage: int, shares: bool) -> set[int]:
        return set(collections.Counter(msg.check for _, msg in r.sent if isinstance(msg, m.Recheck)
                                       and msg.stage == stage and (msg.kind == "share") == shares).values())

    # as many verifiers a check as asked, where the stage has that many others (stage 0: one other), and
    # one for a share (its recheck redoes its replica's every visit)
    assert per_check(1, False) == {verifiers} and per_check(1, True) == per_check(0, False) == {1}
    checks = {f["node"]: f for kind, f in events if kind == "caught"}
    assert "c" not in caught or checks["c"]["check"] in ("visit", "share")
    assert "e" not in caught and not {"a", "b"} & set(caught)
    if verifiers == 2:
        assert "c" in caught and checks["d"]["check"] == "false match" and checks["d"]["computed_by"] == "c"
        assert checks["d"]["difference"] == 0.0 and checks["d"]["confirmed_difference"] > 0.5
        assert "matches (difference 0)" in caught["d"]
    else:  # c is caught where e was drawn for one of its computations (each drawn for one, at random)
        by_e = any(r.check.node == "c" and "e" in r.answers for r in v._audit.rechecks.values())
        assert ("c" in caught) == by_e and "d" not in caught


def test_an_accomplice_is_held_to_the_confirmation_even_when_its_colluder_was_caught_by_another_check_first():
    """Microbatch 0 done: c's visit goes to d (passes it) and e (a mismatch), and its confirmation waits
    for the weights. c is caught meanwhile by another check (set here before the weights come): the
    confirmation still runs, for d's answer, and d is caught for a false match."""
    batches = [tokens_and_targets(i) for i in range(3)]
    r = LocalRound(PLAN3, batches, liars={"c": Adversary("scale"), "d": Accomplice()})
    v, events = verifier("full", roster=r)
    v.begin(0, PLAN3, dict(PLAN3.allocation), batches)
    v.finished(0, 0)
    weights = []
    while r.answers:  # the evidence and the rechecks; the weights held back
        msg = r.answers.popleft()
        (weights.append if isinstance(msg, m.WeightsShown) else v.take)(msg)
    a = v._audit
    assert [k.check.node for k in a.confirming] == ["c"] and weights
    a.caught["c"] = "visit: caught by another check (this test)"
    for msg in weights:
        v.take(msg)
    assert a.caught["d"].startswith("false match: reported that c's visit matches")


def test_a_verifier_whose_weights_differ_from_the_nodes_is_a_dispute_and_the_node_is_judged_on_its_own():
    """As above, c scales what it sends and d passes every recheck, but d's weights have since moved
    (its held weights are no longer c's): d's match cannot be judged against the coordinator's
    recomputation with c's weights, so it is a dispute (c and d suspects), not a false match; c is
    caught all the same, on its own weights (e's mismatch confirmed); e is not blamed."""
    batches = [tokens_and_targets(i) for i in range(3)]
    r = LocalRound(PLAN3, batches, liars={"c": Adversary("scale"), "d": Accomplice()})
    with torch.no_grad():
        next(r.stage["d"].parameters()).add_(1.0)  # after the round: what it shows and recomputes with now
    v, events, caught = audited(r)
    assert set(caught) == {"c"}, caught
    disputes = [f for kind, f in events if kind == "dispute"]
    assert disputes and all(f["nodes"] == ["c", "d"] and "weights of two replicas" in f["why"] for f in disputes)
    assert {"c", "d"} <= v.suspects


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_colluders_that_are_a_whole_stage_pass_each_other_unless_the_coordinator_confirms_what_they_passed(rate):
    """Stage 1 has 2 replicas: c scales what it sends, d (its only other replica, so the verifier of each
    of its computations) passes every recheck. With ``confirm_rate`` 0 nothing of c's is ever
    recomputed by anyone but d: nobody is caught (the limit a whole colluding stage is). At 1 the
    coordinator recomputes what d passed: c is caught for its computation, d for a "false match"."""
    batches = [tokens_and_targets(0), tokens_and_targets(1)]
    r = LocalRound(PLAN, batches, liars={"c": Adversary("scale"), "d": Accomplice()})
    v, events, caught = audited(r, confirm_rate=rate)
    checks = {f["node"]: f for kind, f in events if kind == "caught"}
    if rate == 0.0:
        assert caught == {} and v.last["confirmations"] == 0
    else:
        assert set(caught) == {"c", "d"} and checks["c"]["check"] in ("visit", "share")
        assert checks["c"]["verifier"] == "coordinator" and checks["d"]["check"] == "false match"


def test_a_verifier_that_answers_a_recheck_with_no_difference_is_caught_and_nobody_else():
    """d answers every recheck with a word, not a difference (only d could have sent it, over its own
    connection): d is caught ("report") and the audit goes on; nobody else is blamed."""

    class Garbler(Accomplice):
        def reports(self, node, rnd, difference):
            return "fine"

    batches = [tokens_and_targets(0), tokens_and_targets(1)]
    r = LocalRound(PLAN, batches, liars={"d": Garbler()})
    _, events, caught = audited(r)
    assert list(caught) == ["d"] and "with str, not a difference" in caught["d"]
    assert [f["check"] for kind, f in events if kind == "caught"] == ["report"]


# -- training with adversaries --------------------------------------------------------------------------
BASE = dict(model="tiny", stages=3, skip=0.0, microbatches=4, samples=2, seq_len=16, lr=3e-3, warmup=1,
            eval_every=100, eval_batches=2, planner_budget=5.0, planner_evals=40, replan_budget=1.0,
            replan_evals=20, speed=1e-3, clip=1.0, timeout=120, in_flight=2, seed=1,
            start_wait=120)  # every node in the plan from iteration 0, however slowly a loaded machine starts it


def train(adversaries: dict[int, list[str]] | Callable[[dict], dict[int, list[str]]], *, nodes: int,
          iterations: int, mode: str = "full", start: int = 1, rate: float = 0.05, control: str = "",
          **extra) -> tuple[dict, dict[str, str], Trainer]:
    """Train with adversaries given by stage: {stage: [kind, ...]} (or a function of the plan's stages,
    stage -> its nodes, that gives it) lie from iteration ``start`` on; returns the metrics, the
    adversaries (node -> kind) and the trainer (stopped)."""
    prep = prepare(TrainConfig(**{**BASE, **extra}, nodes=nodes, iterations=iterations, mode=mode,
                               verify_rate=rate, control=control))
    by_stage: dict[int, list[str]] = {}
    for name, stage in sorted(prep.plan.allocation.items()):
        by_stage.setdefault(stage, []).append(name)
    if callable(adversaries):
        adversaries = adversaries(by_stage)
    liars = {}
    for stage, kinds in adversaries.items():
        for name, kind in zip(by_stage[stage], kinds):
            liars[name] = kind
    prep.config.adversaries = ", ".join(f"{n}:{k}:{start}" for n, k in liars.items())
    with Trainer(prep) as t:
        metrics = t.train()
    return metrics, liars, t


def caught_at(metrics: dict) -> dict[str, int]:
    return {e["node"]: e["iteration"] for e in metrics["events"] if e["event"] == "caught"}


def _frame_collude_weights(by_stage: dict[int, list[str]]) -> dict[int, list[str]]:
    """The colluding pair in the largest stage (it has honest replicas beside them to verify their work),
    the tampered share in a stage of 3 (no averaging check: its recheck catches it), the framer in the
    other (it reports an honest replica's work as wrong)."""
    big = max(by_stage, key=lambda s: (len(by_stage[s]), -s))
    three = next(s for s in sorted(by_stage) if s != big and len(by_stage[s]) == 3)
    rest = next(s for s in sorted(by_stage) if s not in (big, three))
    return {big: ["collude", "collude"], three: ["weights"], rest: ["frame"]}


@pytest.mark.parametrize("adversaries", [
    {0: ["signflip", "bias"], 1: ["scale", "noise"], 2: ["lazy", "nan"]},
    _frame_collude_weights,
], ids=["signflip-bias-scale-noise-lazy-nan", "frame-collude-weights"])
def test_every_adversary_kind_is_caught_in_full_mode_and_no_honest_node_is(adversaries):
    """9 nodes on 3 stages, 4 or 6 of them lying from iteration 1: each is caught in that iteration (with two
    verifiers a check, a colluder's work is verified by at least one honest replica, and
    the framer verifies every computation of its stage's others); nobody else is; training runs every
    iteration without them, on finite losses."""
    # 9 microbatches: each replica is on some route in iteration 1 (one on none would send only a share of
    # zeros, which scaled or negated is still zeros: nothing to catch)
    metrics, liars, t = train(adversaries, nodes=9, iterations=4, microbatches=9)
    caught = caught_at(metrics)
    assert set(caught) == set(liars), (caught, liars)
    assert all(it == 1 for it in caught.values()), caught
    checks = {e["node"]: e for e in metrics["events"] if e["event"] == "caught"}
    for name, kind in liars.items():
        if kind == "frame":  # caught for a false report about an honest node's work
            assert checks[name]["check"] == "false mismatch" and checks[name]["computed_by"] not in liars
        if kind == "weights":  # sent a tampered share: its recheck, in the audit before the step (3 replicas
            # on one platform: no averaging check; the weights check after the step would be next)
            assert checks[name]["check"] == "share"
    assert len(metrics["iterations"]) == 4 and all(math.isfinite(r["train_loss"]) for r in metrics["iterations"])
    assert not set(liars) & set(t.alloc) and set(t.roster.excluded) == set(liars)
    with pytest.raises(PlanError, match="was excluded"):
        t.roster.request_join(next(iter(liars)))
    last = metrics["iterations"][-1]["verify"]
    assert last["checks"] > 0 and last["caught"] == []


@pytest.mark.parametrize("replicas, check", [(2, "combine"), (3, "weights")], ids=["2-replicas", "3-or-more"])
def test_a_replica_that_averages_another_share_than_it_sent_is_caught_in_the_iteration_it_starts(replicas, check):
    """Spot mode at rate 0 (no computation drawn), 9 nodes: a ``weights`` liar sends its replicas a tampered
    share and averages its true one, so its combined gradient differs from theirs. In a stage of 2 replicas
    the averaging check (the replicas' digests of what they combined, every round) catches it; in one of 3
    or more on one platform no such digest is asked, and the weights check after the step names it (it
    stepped with another gradient than the others). Either way in the iteration it starts, and nobody else."""
    def liar(by_stage: dict) -> dict:
        for stage, names in sorted(by_stage.items()):
            if len(names) >= 2 and (len(names) >= 3) == (replicas >= 3):
                return {stage: ["weights"]}
        raise AssertionError(f"the plan has no stage of {replicas} replicas to test with: {by_stage}")

    metrics, liars, t = train(liar, nodes=9, iterations=3, mode="spot", rate=0.0, start=1,
                              microbatches=9)  # every replica on a route: none sends a share of zeros
    liar = next(iter(liars))
    caught = [e for e in metrics["events"] if e["event"] == "caught"]
    assert [(e["node"], e["check"], e["iteration"]) for e in caught] == [(liar, check, 1)]
    assert all(r["verify"]["rechecks"] == 0 for r in metrics["iterations"])
    assert liar in t.roster.excluded and len(metrics["iterations"]) == 3


def test_a_negated_share_has_its_node_opposed_in_the_round_it_starts_and_caught_by_the_checks_that_draws(monkeypatch):
    """Spot mode at rate 0 (only what opposition makes up is drawn), with an opposed node's chance raised to 1
    here so that the test waits on no draw: a ``signflip`` liar in a stage of 2 replicas, from iteration 5
    (after the 4 rounds a baseline needs), sends a share that points away from its replica's (the cosine its
    replica's stage process reports of it), so both are opposed in iteration 5, and every computation of
    theirs is checked: the liar is caught there (by whichever of its computations), its honest replica is not,
    and training goes on without it."""
    monkeypatch.setattr(sampling_module, "SUSPECT_RATE", 1.0)

    def liar(by_stage: dict) -> dict:
        return {next(s for s, names in sorted(by_stage.items()) if len(names) == 2): ["signflip"]}

    metrics, liars, t = train(liar, nodes=6, iterations=7, mode="spot", rate=0.0, start=5)
    liar_name = next(iter(liars))
    assert caught_at(metrics) == {liar_name: 5}
    # the pair, once, in iteration 5's first run (the record of iteration 5 is its run again without the
    # liar), and no band suspect that could have had it drawn instead
    assert t.verifier.totals["opposed"] == 2
    assert not [e for e in metrics["events"] if e["event"] == "suspect"]
    assert liar_name in t.roster.excluded and len(metrics["iterations"]) == 7
    assert all(math.isfinite(r["train_loss"]) for r in metrics["iterations"])


@pytest.mark.parametrize("rate", [0.0, 1.0], ids=["drawn-at-the-round-end", "passed-before-it"])
def test_a_whole_stage_that_colludes_is_turned_in_the_round_it_starts_and_both_are_caught_at_confirm_rate_0(
        monkeypatch, rate):
    """A stage of 2 replicas, both ``collude`` from iteration 5 (the same made-up tensors: each is the other's only
    verifier, and passes it), ``confirm_rate`` 0 (the default). Their outputs' profile turns in iteration 5
    (``Screen.turned``: one of them at least), so what their verifiers pass that round is confirmed by the
    coordinator: both are caught in iteration 5 (the liar for its computation, the accomplice for a false match),
    nobody else, and training goes on without the stage. At spot rate 0 (a turned node's chance raised to 1 here, so
    that the test waits on no draw) the checks are drawn at the round's end; at rate 1 they are all drawn while the
    round runs, and confirmed whether their verifiers passed them before its end (then at the end:
    ``test_what_a_turned_nodes_verifier_passed_before_the_round_ended_is_confirmed_at_its_end``) or after."""
    monkeypatch.setattr(sampling_module, "SUSPECT_RATE", 1.0)

    def pair(by_stage: dict) -> dict:
        return {next(s for s, names in sorted(by_stage.items()) if len(names) == 2 and s > 0): ["collude", "collude"]}

    metrics, liars, t = train(pair, nodes=6, iterations=7, mode="spot", rate=rate, start=5)
    assert caught_at(metrics) == {n: 5 for n in liars}
    checks = sorted(e["check"] for e in metrics["events"] if e["event"] == "caught")
    assert "false match" in checks and all(e["verifier"] == "coordinator" for e in metrics["events"]
                                           if e["event"] == "caught" and e["check"] != "false match")
    assert t.verifier.totals["turned"] >= 1 and t.verifier.totals["confirmations"] >= 1
    assert not set(liars) & set(t.alloc) and len(metrics["iterations"]) == 7
    assert all(math.isfinite(r["train_loss"]) for r in metrics["iterations"])


def test_a_replica_that_steps_to_other_weights_is_caught_at_that_step_and_training_goes_on_without_it(tmp_path):
    """Spot mode at rate 0 (no computation drawn), 3 replicas a stage: a ``drift`` liar sends and combines
    honestly but steps with another gradient from iteration 1; the replicas' weights check after that
    step catches it (check "weights") before anything reads its weights, nobody else is blamed, and the
    run goes on without it (its stage re-planned with the replicas left); `roving pipeline status`
    says so."""
    from roving.cli import main as roving_main

    metrics, liars, t = train({1: ["drift"]}, nodes=9, iterations=3, mode="spot", rate=0.0, start=1,
                              control=str(tmp_path))
    liar = next(iter(liars))
    caught = [e for e in metrics["events"] if e["event"] == "caught"]
    assert [(e["node"], e["check"], e["iteration"]) for e in caught] == [(liar, "weights", 1)]
    assert len(caught[0]["agreeing"]) == 2 and liar not in caught[0]["agreeing"]
    assert not [e for e in metrics["events"] if e["event"] == "dispute"]
    assert metrics["iterations"][1]["verify"]["caught"] == [liar]
    assert liar in t.roster.excluded and liar not in t.alloc and len(metrics["iterations"]) == 3
    assert all(math.isfinite(r["train_loss"]) for r in metrics["iterations"])
    out = io.StringIO()
    with redirect_stdout(out):
        assert roving_main(["pipeline", "status", "--control", str(tmp_path)]) == 0
    stage = caught[0]["stage"]
    said = out.getvalue()
    assert (f"caught by verification at iteration 1: {liar} excluded (weights check of {liar}'s weights, stage "
            f"{stage}): stepped to other weights than 2 of the 3 replicas of stage {stage} after round") in said


def test_each_round_reports_the_screening_rows_of_its_own_tensors_and_no_earlier_rounds(monkeypatch):
    """A stage process forgets a round's evidence when the next round starts: each round's Norms carry the
    summaries of the tensors received in that round alone (the same plan every round: as many each
    round), so nothing is screened twice and no dispute is reported again in a later round."""
    rows: collections.Counter = collections.Counter()
    note = Verifier.note

    def counting(self, msg):
        rows[msg.round] += len(msg.screened)
        return note(self, msg)

    monkeypatch.setattr(Verifier, "note", counting)
    metrics, _, _ = train({}, nodes=6, iterations=4, mode="screen")
    assert sorted(rows) == [0, 1, 2, 3] and len(set(rows.values())) == 1 and rows[0] > 0, rows
    assert not [e for e in metrics["events"] if e["event"] in ("caught", "dispute")]


def test_a_clean_run_blames_nobody_verification_changes_nothing_of_its_training_and_says_what_it_cost():
    # one microbatch an iteration: each stage replica then sums its gradients in one order (with more,
    # even one in flight per node, a replica gets its microbatches' gradients from several downstream
    # replicas in arrival order, and AdamW makes float differences of two orders grow past 1e-7 of the
    # loss in a few steps on a loaded machine: the CI failure)
    off, _, _ = train({}, nodes=6, iterations=5, mode="off", microbatches=1)
    on, _, t = train({}, nodes=6, iterations=5, mode="spot", rate=0.5, microbatches=1)
    assert not [e for e in on["events"] if e["event"] in ("caught", "dispute")]
    assert [r["train_loss"] for r in on["iterations"]] == [r["train_loss"] for r in off["iterations"]]
    assert sum(r["verify"]["rechecks"] for r in on["iterations"]) > 0
    assert "verify" not in off["iterations"][0]
    # what it cost, in each iteration's record: the coordinator's CPU for the audit, and the nodes' own
    # by part; every tensor sent was sealed and every one received kept and summarised, a stage of
    # several replicas digested what it combined, and the rechecks took CPU where there were any
    replicated = len(set(t.alloc.values())) < len(t.alloc)
    for r in on["iterations"]:
        cost = r["verify"]["node_cpu_seconds"]
        assert r["verify"]["cpu_seconds"] > 0 and cost["receipts"] > 0 and cost["screening"] > 0, cost
        assert (cost.get("combined", 0) > 0) == replicated, (cost, t.alloc)
        assert (cost.get("rechecks", 0) > 0) == (r["verify"]["rechecks"] > 0), r["verify"]


def test_spot_checks_catch_a_liar_within_the_stated_iterations_and_screening_alone_catches_non_finite_values(tmp_path):
    """Spot mode at rate 0.5: a node lying about every tensor has about 4 computations an iteration here,
    so it escapes an iteration with chance 0.5**4 = 0.06: it is caught within 6 (all but 1e-6). Screen
    mode recomputes nothing, but a non-finite tensor computed from finite inputs is the sender's fault;
    the catch shows in `roving pipeline status` and the dashboard."""
    from roving.cli import main as roving_main

    metrics, liars, _ = train({1: ["scale"]}, nodes=6, iterations=8, mode="spot", rate=0.5, start=2)
    assert list(caught_at(metrics)) == list(liars) and 2 <= caught_at(metrics)[next(iter(liars))] <= 7
    metrics, liars, _ = train({2: ["nan"]}, nodes=6, iterations=3, mode="screen", control=str(tmp_path))
    assert caught_at(metrics) == {next(iter(liars)): 1}
    event = next(e for e in metrics["events"] if e["event"] == "caught")
    assert event["check"] == "non-finite"
    out = io.StringIO()
    with redirect_stdout(out):
        assert roving_main(["pipeline", "status", "--control", str(tmp_path)]) == 0
    liar = next(iter(liars))
    assert f"caught by verification at iteration 1: {liar} excluded (non-finite check" in out.getvalue()
    shown = PipelineWatch(str(tmp_path), None).read()  # the dashboard's pipeline view
    assert [n["state"] for n in shown["nodes"] if n["name"] == liar] == ["excluded"]
    assert any(e.get("event") == "caught" and e.get("node") == liar for e in shown["events"])


def test_a_node_killed_as_the_audit_asks_it_has_the_round_run_again_without_it_and_training_goes_on():
    """4 nodes on 2 stages, every computation checked. In iteration 0 the first node asked for evidence
    whose stage has another replica is killed as it is asked; in iteration 1 the first node asked to
    recheck another's work. Each time the round is aborted naming it (the audit runs alongside the round:
    the death is seen by the round's wait or by the audit's), run again without it, and training goes on:
    both iterations done in 2 attempts on finite losses, nobody caught."""
    # every node in the run from the start (BASE's start_wait: else, under load, the run could start
    # without one and no stage would have a replica in iteration 0)
    prep = prepare(TrainConfig(**{**BASE, "stages": 2, "microbatches": 2, "planner_budget": 1.0},
                               nodes=4, iterations=2, mode="full"))
    killed: dict[int, str] = {}
    with Trainer(prep) as t:
        put = t.roster.put

        def put_and_kill(name: str, msg: m.Message) -> None:
            it = t.iteration_no
            asking = m.EvidenceRequest if it == 0 else m.Recheck
            if it not in killed and isinstance(msg, asking) and list(t.alloc.values()).count(t.alloc[name]) > 1:
                killed[it] = name
                t.roster.kill([name])
                t.roster.procs[name].join(timeout=30)
                assert not t.roster.procs[name].is_alive(), f"{name} still runs after kill -9"
            put(name, msg)

        t.roster.put = put_and_kill
        metrics = t.train()
    assert sorted(killed) == [0, 1] and len(set(killed.values())) == 2, killed
    aborted = [(e["iteration"], e["lost"]) for e in metrics["events"] if e["event"] == "aborted"]
    assert aborted == [(0, [killed[0]]), (1, [killed[1]])]
    assert [r["attempts"] for r in metrics["iterations"]] == [2, 2]
    assert all(math.isfinite(r["train_loss"]) and r["verify"]["checks"] > 0 for r in metrics["iterations"])
    assert not set(killed.values()) & set(t.alloc)
    assert not [e for e in metrics["events"] if e["event"] in ("caught", "dispute")]


def test_a_node_caught_before_another_dies_in_the_same_audit_is_in_the_nodes_lost_as_caught(monkeypatch):
    """The replicas' averaging check catches c (here made to, as a weights liar's tampered share would:
    LocalRound's replicas all combine what was sent); then a, asked for the evidence it holds, dies. The
    audit raises NodesLost naming both, with c as ``caught``, so that the trainer excludes it for good as
    it does a catch without a death; a is only lost."""
    batches = [tokens_and_targets(0), tokens_and_targets(1)]
    r = LocalRound(PLAN, batches, liars={"c": Adversary("scale")}, dies=("a", m.EvidenceRequest))
    v, events = verifier("full", roster=r)
    check = Check("c", 1, Kind.SHARE, -1, -1, Source("d", T(0, "share", -1, -1, "c")))
    monkeypatch.setattr(v.replicas, "averaging", lambda a: v.findings.catch(
        a.caught, "c", "averaging", check, reason="its replicas' combined gradients differ"))
    v.begin(0, PLAN, dict(PLAN.allocation), batches)
    for msg in r.norms:
        v.note(msg)
    with pytest.raises(NodesLost) as lost:
        v.audit(0, r.norm())
    assert sorted(lost.value.names) == ["a", "c"] and list(lost.value.caught) == ["c"]
    assert [f["node"] for kind, f in events if kind == "caught"] == ["c"]
    assert r.left() == []
