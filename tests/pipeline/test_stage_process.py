"""A stage process driven directly with protocol messages, in threads of this process with plain
queues (no coordinator, no roving processes): a microbatch's forward, loss and backward along a
route through two stages, the replica averaging and the AdamW step give what the same stages
compute in one process; rounds are read as the protocol says; a message a stage process does not
handle is a clear error."""

import queue
import threading

import pytest
import torch

torch.set_num_threads(1)

from roving.pipeline import protocol as m
from roving.pipeline.verify.adversary import Adversary
from roving.pipeline.verify.conduct import Conduct
from roving.pipeline.presets import preset
from roving.pipeline.planning.plan import Route
from roving.pipeline.runtime.stage_process import StageProcess, StageSettings
from roving.pipeline.stages import Stage

CFG = preset("tiny", max_seq_len=16)
SEED, LR = 3, 1e-3


def settings(name: str, stage: int, adversary: Conduct | None = None) -> StageSettings:
    return StageSettings(name, stage, 2, CFG, SEED, in_flight=2, lr=LR, device="cpu", heartbeat=0,
                         adversary=adversary)


class Pair:
    """Stage processes "a" (stage 0) and "b" (stage 1) in threads, answering on one control queue."""

    def __init__(self, adversaries: dict[str, Conduct] | None = None) -> None:
        adversaries = adversaries or {}
        self.control = queue.Queue()
        self.inbox = {"a": queue.Queue(), "b": queue.Queue()}
        self.errors: list[BaseException] = []
        self.procs = {n: StageProcess(settings(n, s, adversaries.get(n)), self.inbox[n], self.control)
                      for n, s in (("a", 0), ("b", 1))}
        self.threads = [threading.Thread(target=self._run, args=(p,), daemon=True) for p in self.procs.values()]
        for t in self.threads:
            t.start()
        ready = [self.get(m.Ready) for _ in self.procs]
        assert sorted(r.sender for r in ready) == ["a", "b"]
        assert all(r.inbox is self.inbox[r.sender] for r in ready)
        for n in self.inbox:
            self.inbox[n].put(m.Peers(dict(self.inbox)))

    def _run(self, proc: StageProcess) -> None:
        try:
            proc.run()
        except BaseException as exc:
            self.errors.append(exc)

    def get(self, kind: type, timeout: float = 60.0) -> m.Message:
        msg = self.control.get(timeout=timeout)
        assert isinstance(msg, kind), f"expected {kind.__name__}, got {msg!r}"
        return msg

    def stop(self) -> None:
        for n in self.inbox:
            self.inbox[n].put(m.Stop(["a", "b"]))
        stopped = {self.get(m.Stopped).sender for _ in self.inbox}
        assert stopped == {"a", "b"}
        for n in self.inbox:
            self.inbox[n].put(m.Release())
        for t in self.threads:
            t.join(timeout=30)
        assert not self.errors, self.errors


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def test_forward_backward_and_step_round_trip_give_what_the_stages_compute_in_one_process():
    tokens, targets = batch(0)
    route = Route("a", ("b",), (1,))
    pair = Pair()
    try:
        pair.inbox["a"].put(m.Microbatch(0, 0, tokens, targets, route))
        for n in ("a", "b"):
            pair.inbox[n].put(m.SyncOrder(0, [n], 1, 1))
        got = [pair.get((m.Done, m.Norm)) for _ in range(3)]
        done = [g for g in got if isinstance(g, m.Done)]
        norms = {g.stage: g for g in got if isinstance(g, m.Norm)}
        assert len(done) == 1 and done[0].sender == "a" and done[0].mb == 0 and done[0].round == 0
        assert set(norms) == {0, 1} and norms[0].sender == "a" and norms[1].sender == "b"
        for n in ("a", "b"):
            pair.inbox[n].put(m.Step(0, 1.0, LR))
        stepped = {pair.get(m.Stepped).sender: None for _ in range(2)}
        assert set(stepped) == {"a", "b"}
        pair.inbox["a"].put(m.StateRequest())
        pair.inbox["b"].put(m.StateRequest())
        states = {s.stage: s for s in (pair.get(m.State), pair.get(m.State))}
    finally:
        pair.stop()

    # the same stages, the same batch, in this process
    s0, s1 = Stage(CFG, 0, 2, seed=SEED), Stage(CFG, 1, 2, seed=SEED)
    loss = s0.loss(s1(s0(s0.embed(tokens))), targets)
    loss.backward()
    assert done[0].loss == pytest.approx(float(loss.detach()), rel=1e-5)
    for stage, module in ((0, s0), (1, s1)):
        sq = sum(float(p.grad.pow(2).sum()) for p in module.parameters() if p.grad is not None)
        assert norms[stage].sq_norm == pytest.approx(sq, rel=1e-4)
        opt = torch.optim.AdamW(list(module.parameters()), lr=LR, weight_decay=0.1, betas=(0.9, 0.95))
        opt.step()
        want = module.state_dict()
        assert states[stage].tensors.keys() == want.keys()
        for k in want:
            assert torch.allclose(states[stage].tensors[k], want[k], atol=1e-6), (stage, k)


def test_a_lazy_adversary_returns_its_input_unchanged_and_the_origin_computes_the_loss_without_its_stage():
    tokens, targets = batch(2)
    route = Route("a", ("b",), (1,))
    pair = Pair({"b": Adversary("lazy")})
    try:
        pair.inbox["a"].put(m.Microbatch(0, 0, tokens, targets, route))
        done = pair.get(m.Done)
    finally:
        pair.stop()
    s0, s1 = Stage(CFG, 0, 2, seed=SEED), Stage(CFG, 1, 2, seed=SEED)
    with torch.no_grad():
        h0 = s0(s0.embed(tokens))
        skipped, honest = float(s0.loss(h0, targets)), float(s0.loss(s1(h0), targets))
    assert done.loss == pytest.approx(skipped, rel=1e-5)
    assert abs(done.loss - honest) > 1e-4, "the stage's computation would change the loss: the test could fail"


class Recording(Conduct):
    """A conduct of no adversary's kind: it records each hook the stage process calls and lies about
    nothing (what it is given, it gives back)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def tamper(self, what, tensor, node, rnd, mb, given=None):
        self.calls.append(("tamper", what, node, rnd, mb))
        return tensor


def test_a_stage_process_calls_its_conducts_hook_on_every_tensor_it_sends_whatever_the_conduct_is():
    """The stage processes call the one hook object they hold for each activation and gradient sent to
    another process, never asking what it is: one that is no adversary is called the same, and,
    lying about nothing, leaves the loss the honest one."""
    tokens, targets = batch(2)
    route = Route("a", ("b",), (1,))
    conducts = {"a": Recording(), "b": Recording()}
    pair = Pair(conducts)
    try:
        pair.inbox["a"].put(m.Microbatch(0, 0, tokens, targets, route))
        done = pair.get(m.Done)
    finally:
        pair.stop()
    assert conducts["a"].calls == [("tamper", "activation", "a", 0, 0), ("tamper", "gradient", "a", 0, 0)]
    assert conducts["b"].calls == [("tamper", "activation", "b", 0, 0), ("tamper", "gradient", "b", 0, 0)]
    s0, s1 = Stage(CFG, 0, 2, seed=SEED), Stage(CFG, 1, 2, seed=SEED)
    with torch.no_grad():
        honest = float(s0.loss(s1(s0(s0.embed(tokens))), targets))
    assert done.loss == pytest.approx(honest, rel=1e-5)


def test_an_aborted_rounds_microbatch_is_dropped_and_the_next_round_runs():
    tokens, targets = batch(1)
    route = Route("a", ("b",), (1,))
    pair = Pair()
    try:
        pair.inbox["a"].put(m.Abort(0))
        pair.inbox["a"].put(m.Microbatch(0, 5, tokens, targets, route))  # of the aborted round: dropped
        pair.inbox["a"].put(m.Microbatch(1, 6, tokens, targets, route))
        done = pair.get(m.Done)
        assert (done.round, done.mb) == (1, 6)
        with pytest.raises(queue.Empty):
            pair.control.get(timeout=1.0)  # nothing for microbatch 5
    finally:
        pair.stop()


def test_export_and_load_move_a_stage_between_processes():
    pair = Pair()
    try:
        pair.inbox["a"].put(m.Export())
        ex = pair.get(m.Exported)
        assert ex.sender == "a" and ex.stage == 0
        pair.inbox["b"].put(m.Load(0, 1, ex.params, ex.optimizer))
        loaded = pair.get(m.Loaded)
        assert (loaded.sender, loaded.stage) == ("b", 0)
        pair.inbox["b"].put(m.StateRequest())
        state = pair.get(m.State)
        assert state.stage == 0 and all(torch.equal(state.tensors[k], v) for k, v in ex.params.items())
    finally:
        pair.stop()


@pytest.mark.parametrize("bad, named", [
    (m.Done(0, "x", 0, 1.0), "unexpected message Done"),
    (("fwd", 0, 0, 0, None, None), r"unexpected message tuple \(not a protocol message\)"),
])
def test_a_message_a_stage_process_does_not_handle_is_a_clear_error(bad, named):
    control, inbox = queue.Queue(), queue.Queue()
    proc = StageProcess(settings("a", 0), inbox, control)
    inbox.put(bad)
    with pytest.raises(m.ProtocolError, match=f"stage process a: {named}"):
        proc.run()
    assert isinstance(control.get(timeout=5), m.Ready)


def test_messages_pickle_with_their_fields_and_stay_small():
    import pickle

    msg = m.Forward(3, "a", 1, 0, torch.zeros(2), Route("a", ("b",), (1,)))
    back = pickle.loads(pickle.dumps(msg, protocol=5))
    assert back.round == 3 and back.sender == "a" and back.route == msg.route and torch.equal(back.tensor, msg.tensor)
    assert not hasattr(msg, "__dict__"), "slotted: no per-message dict"
    with pytest.raises(AttributeError):
        msg.round = 4  # frozen
    assert len(pickle.dumps(m.Abort(7), protocol=5)) < 80


@pytest.mark.parametrize("rule", ["mean", "median"])
def test_replicas_combine_their_shares_by_the_aggregation_rule_so_a_tampered_share_is_outvoted(rule):
    """Three replicas of stage 0 each run a microbatch (a route through no other stage); "c" sends a tampered share
    (``weights``). Under ``median`` the honest replicas' averaged gradient is the coordinate-wise
    median of the three shares as sent (``aggregate.combine``); under ``mean`` the lie drags it."""
    from roving.pipeline.verify.aggregate import combine

    names = ("a", "b", "c")
    lie = Adversary("weights", seed=4)
    control = queue.Queue()
    inbox = {n: queue.Queue() for n in names}
    procs = {n: StageProcess(StageSettings(n, 0, 2, CFG, SEED, in_flight=2, lr=LR, device="cpu", heartbeat=0,
                                           aggregation=rule, adversary=lie if n == "c" else None),
                             inbox[n], control) for n in names}
    errors: list[BaseException] = []

    def run(p):
        try:
            p.run()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in procs.values()]
    for t in threads:
        t.start()
    try:
        assert {control.get(timeout=60).sender for _ in names} == set(names)  # Ready
        for n in names:
            inbox[n].put(m.Peers(dict(inbox)))
        for i, n in enumerate(names):
            tokens, targets = batch(10 + i)
            inbox[n].put(m.Microbatch(0, i, tokens, targets, Route(n, (), ())))
            inbox[n].put(m.SyncOrder(0, list(names), 3, 1))
        got = [control.get(timeout=60) for _ in range(6)]
        assert not errors, errors
        norms = {g.sender: g.sq_norm for g in got if isinstance(g, m.Norm)}
        assert set(norms) == set(names), got
    finally:
        for n in names:
            inbox[n].put(m.Stop(list(names)))
        for n in names:
            control.get(timeout=60)
            inbox[n].put(m.Release())
        for t in threads:
            t.join(timeout=30)
    assert not errors, errors

    shares = []
    for i, n in enumerate(names):
        stage = Stage(CFG, 0, 2, seed=SEED)
        tokens, targets = batch(10 + i)
        stage.loss(stage(stage.embed(tokens)), targets).backward()
        flat = torch.cat([p.grad.flatten().float() for p in stage.parameters()])
        shares.append(lie.tamper("share", flat, n, 0, -1) if n == "c" else flat)
    want = float(combine(shares, [1, 1, 1], 3, rule).pow(2).sum())
    honest = float(combine(shares[:2] + [shares[0]], [1, 1, 1], 3, "median").pow(2).sum())
    for n in ("a", "b"):
        assert norms[n] == pytest.approx(want, rel=1e-4), (n, norms, want)
    if rule == "median":
        assert want < 4 * honest, "the median is not dragged by the tampered share"
    else:
        assert want > 4 * honest, "the mean is dragged by it: the comparison could fail"


def test_a_stage_process_told_to_forget_a_peer_refuses_that_peers_credentials_from_then_on():
    """Exclusion reaches the peers: ``Forget`` (from the coordinator, through a real inbox) revokes the
    node id the coordinator's ``Peers`` gave the forgotten name, so its connections here are closed and
    refused, and its letters are no one's."""
    from roving.pipeline.runtime import mail
    from roving.transport import identity, session

    directory = mail.Directory({session.current().uid: m.COORDINATOR})
    inbox = mail.Inbox(directory, accept=mail.coordinator_only)
    other = mail.Inbox(mail.Directory())
    control: queue.Queue = queue.Queue()
    proc = StageProcess(settings("a", 0), inbox, control)
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _run_catching(proc, errors), daemon=True)
    thread.start()
    to_a = mail.Outbox(inbox.address)  # this process is the coordinator of the directory
    forgotten = "node-b-" + session.new_uid()
    try:
        assert isinstance(control.get(timeout=60), m.Ready)
        to_a.put(m.Peers({"a": inbox.address, "b": other.address}, {"b": forgotten}))
        to_a.put(m.Forget(["b"]))
        to_a.put(m.Stop(["a"]))
        assert isinstance(control.get(timeout=60), m.Stopped)
        assert identity.is_revoked(forgotten)
        assert directory.name(forgotten) is None
    finally:
        to_a.put(m.Release())
        thread.join(timeout=30)
    assert not errors, errors


def _run_catching(proc: StageProcess, errors: list) -> None:
    try:
        proc.run()
    except BaseException as exc:
        errors.append(exc)
