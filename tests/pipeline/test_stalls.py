"""Who stalled a round (``runtime/stalls.py``): the nodes' accounts read against each microbatch's chain of
messages. Honest accounts are made by playing the chain forward to where it stopped; a liar's by editing
its own. The verdict never blames a node on another's word."""
from __future__ import annotations

from roving.pipeline import protocol as m
from roving.pipeline.errors import NoMessage
from roving.pipeline.planning.plan import Plan, Route
from roving.pipeline.runtime.stalls import (BACKWARD, COORDINATOR, DONE, FORWARD, LINK_ROUNDS, Account, Key, Stalls,
                                            attribute, bench, chain, flat, suspect)

R0 = Route("a", ("b", "c"), (1, 2))
R1 = Route("d", ("c", "b"), (2, 1))


def _played(routes: dict[int, Route], stop: dict[int, int]) -> dict[str, Account]:
    """Honest accounts of a round in which microbatch mb's messages up to (not including) ``stop[mb]``
    arrived (a microbatch not in ``stop`` finished)."""
    out: dict[str, Account] = {}
    for mb, route in routes.items():
        steps = chain(mb, route)
        for step in steps[:stop.get(mb, len(steps))]:
            if step.sender != COORDINATOR:
                out.setdefault(step.sender, Account()).sent.add(step.key)
            if step.receiver != COORDINATOR:
                out.setdefault(step.receiver, Account()).received.add(step.key)
    return out


def test_a_microbatchs_chain_goes_out_hop_by_hop_back_to_the_origin_and_back_down():
    keys = [(s.key.kind, s.key.hop, s.sender, s.receiver) for s in chain(7, R0)]
    assert keys == [(FORWARD, -1, COORDINATOR, "a"), (FORWARD, 0, "a", "b"), (FORWARD, 1, "b", "c"),
                    (FORWARD, 2, "c", "a"), (BACKWARD, 1, "a", "c"), (BACKWARD, 0, "c", "b"),
                    (BACKWARD, -1, "b", "a"), (DONE, 0, "a", COORDINATOR)]
    local = Route("a", (), ())
    assert [(s.key.kind, s.sender, s.receiver) for s in chain(0, local)] == [(FORWARD, COORDINATOR, "a"),
                                                                           (DONE, "a", COORDINATOR)]


def test_accounts_travel_as_flat_triples_and_a_broken_one_loses_only_its_tail():
    keys = {Key(FORWARD, 3, 0), Key(BACKWARD, 3, -1)}
    assert Account.from_flat(flat(keys), ()).received == keys
    assert Account.from_flat(flat(keys) + (1, 2), ()).received == keys


def test_a_node_that_keeps_what_it_could_pass_on_is_convicted_by_its_own_account():
    routes = {0: R0, 1: R1}
    accounts = _played(routes, {0: 2})  # b received mb 0's activations and sent nothing on
    verdict = attribute(routes, accounts, {n: 2 for n in "abcd"}, done={1})
    assert list(verdict.held) == ["b"] and not verdict.disputes


def test_a_node_waiting_with_its_in_flight_activations_full_is_not_blamed_the_one_that_keeps_them_is():
    """b may hold one microbatch in flight: mb 1's activations went on from b (to the origin d for the
    loss), so b rightly waits with mb 0's; d keeps mb 1's gradients (backward work never waits)."""
    routes = {0: R0, 1: R1}
    accounts = _played(routes, {0: 2, 1: 4})
    verdict = attribute(routes, accounts, {"a": 2, "b": 1, "c": 2, "d": 2})
    assert list(verdict.held) == ["d"] and not verdict.disputes, verdict
    # with room for two, b's waiting is its own doing
    verdict = attribute(routes, accounts, {"a": 2, "b": 2, "c": 2, "d": 2})
    assert sorted(verdict.held) == ["b", "d"], verdict


def test_a_sender_and_a_receiver_that_disagree_break_their_link_and_neither_is_blamed():
    routes = {0: R0}
    accounts = _played(routes, {0: 3})  # a sent mb 0's activations to b: b says it has nothing
    accounts["b"].received.discard(Key(FORWARD, 0, 1))
    accounts["b"].received.discard(Key(FORWARD, 0, 0))
    verdict = attribute(routes, accounts, {n: 2 for n in "abc"})
    assert verdict.disputes == {frozenset(("a", "b"))} and not verdict.held


def test_a_node_that_does_not_answer_received_nothing_so_its_sender_and_it_dispute():
    routes = {0: R0}
    accounts = _played(routes, {0: 4})
    del accounts["c"]
    verdict = attribute(routes, accounts, {n: 2 for n in "abc"})
    assert verdict.disputes == {frozenset(("b", "c"))} and not verdict.held


def test_a_node_that_denies_the_coordinators_microbatch_or_claims_a_done_never_seen_breaks_its_link_to_it():
    routes = {0: R0}
    verdict = attribute(routes, {}, {n: 2 for n in "abc"})
    assert verdict.disputes == {frozenset((COORDINATOR, "a"))}
    assert bench(verdict.disputes) == {"a"}
    accounts = _played(routes, {})  # it finished, the origin says it sent Done: the coordinator has none
    verdict = attribute(routes, accounts, {n: 2 for n in "abc"})
    assert verdict.disputes == {frozenset(("a", COORDINATOR))}


def test_the_bench_takes_the_node_with_the_most_broken_links_and_lets_its_partners_back():
    one = {frozenset(("u", "v"))}
    assert len(bench(one)) == 1
    later = one | {frozenset(("u", "w"))}
    assert bench(later) == {"u"}  # v and w come back
    assert bench(later | {frozenset(("x", "y"))}) in ({"u", "x"}, {"u", "y"})
    assert bench(set()) == set()


class _Roster:
    """The part of a roster ``Stalls`` uses: ``put``; every node asked answers with the account given for
    it, read by the dispatch below."""

    def __init__(self, accounts: dict[str, Account]) -> None:
        self.inboxes = {n: None for n in "abcd"}
        self.accounts, self.asked, self.answers = accounts, [], []

    def put(self, name, msg):
        self.asked.append((name, type(msg).__name__, msg.round))
        acc = self.accounts.get(name)
        if acc is not None:
            self.answers.append(m.Progress(msg.round, name, flat(acc.received), flat(acc.sent)))


class _Dispatch:
    """``dispatch.Dispatch`` reading the roster's answers."""

    def __init__(self, roster: _Roster) -> None:
        self.roster, self.handlers = roster, {}

    def on(self, kind, handler):
        self.handlers[kind] = handler

    def until(self, done, rnd, timeout):
        while not done():
            if not self.roster.answers:
                raise NoMessage("none")
            msg = self.roster.answers.pop(0)
            self.handlers[type(msg)](msg)


def test_a_link_broken_once_keeps_no_one_out_twice_one_node_until_it_is_old_and_then_it_comes_back():
    routes = {0: R0}
    accounts = _played(routes, {0: 3})
    accounts["b"].received -= {Key(FORWARD, 0, 0), Key(FORWARD, 0, 1)}
    roster, events = _Roster(accounts), []
    plan = Plan(stages=3, skip=0.0, allocation={"a": 0, "b": 1, "c": 2}, paths=[R0])
    stalls = Stalls(roster, _Dispatch(roster), lambda name, stage: 2, lambda kind, **f: events.append((kind, f)))
    assert stalls.account(7, plan, done=()) == {}
    assert sorted(n for n, *_ in roster.asked) == ["a", "b", "c"]  # the nodes on the unfinished route
    assert events[0][0] == "stall-accounts" and events[0][1]["disputes"] == [["a", "b"]]
    assert stalls.benched == set() and stalls.take_change() == (set(), set())  # once: a drop, run again
    assert stalls.account(9, plan, done=()) == {}
    assert len(stalls.benched) == 1 and stalls.benched < {"a", "b"}
    assert stalls.take_change() == (stalls.benched, set()) and stalls.take_change() == (set(), set())
    kept = set(stalls.benched)
    assert stalls.refresh(7 + LINK_ROUNDS - 1) == set()
    # the first break ages out: the link was broken once in the last LINK_ROUNDS rounds, and that keeps no one out
    assert stalls.refresh(7 + LINK_ROUNDS) == kept and stalls.benched == set()
    assert stalls.take_change() == (set(), kept)


def test_a_node_that_breaks_links_with_two_peers_is_kept_out_at_once_its_peers_are_not():
    broken = {frozenset(("u", "v")): [1], frozenset(("u", "w")): [1]}
    assert bench(suspect(broken)) == {"u"}
    assert suspect({frozenset(("u", "v")): [1]}) == set()
    assert suspect({frozenset(("u", COORDINATOR)): [1], frozenset(("v", COORDINATOR)): [2]}) == set()
