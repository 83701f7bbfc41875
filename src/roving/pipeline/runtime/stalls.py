"""Who stalled a round: the nodes' own accounts of what they received and sent, read against the plan.

A round stalls when a microbatch stops on its way (``RoundStalled``: no message for ``stall_after``
seconds while every node lives). A network drop does that, and so does a node that keeps, or spoils, what
it should pass on: a peer refuses a message the wire does not take and says nothing to the coordinator,
so the round waits for ever. Retried on the same plan, such a node would stall every attempt and end the
run. So at a stall the coordinator asks each live node on the unfinished microbatches' routes what it
received and what it sent this round (``protocol.Progress``), and walks each unfinished microbatch's
chain of messages (:func:`chain`) to the first one its receiver does not have:

* its sender says it did not send it either, though it had the input (a node keeps nothing back from
  work it can do: forward work waits only while its in-flight activations are at ``in_flight``, and
  backward work never waits): the sender is *convicted by its own account* (:attr:`Verdict.held`);
* its sender says it sent it: the two accounts disagree, and nothing tells which is true (a network
  drop, a receiver that threw it away, or a sender that lies). The pair's link is *broken*
  (:attr:`Verdict.disputes`); neither is blamed. :func:`bench` then keeps out of the plan a smallest
  set of nodes that leaves no such link between two nodes in use (greedily: the node with the most
  broken links first), recomputed at every stall, so a node that disputes with one peer after another is
  soon the one kept out, and its honest partners come back. A link broken once, by a node that broke no
  other, keeps no one out (:func:`suspect`): a network drop does that too, and the round is simply run
  again on the same plan;
* a node that does not answer is taken to have received and sent nothing.

The coordinator (:data:`COORDINATOR`) is trusted: a message it sent and its receiver denies, or one a
node says it sent it and it does not have, breaks that node's link with the coordinator; broken again,
the node is the one kept out. Nothing here blames a node on another's word.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AbstractSet, Callable, Iterable, Mapping, Protocol, Sequence

from .. import protocol as m
from ..errors import NodesLost, NoMessage
from ..planning.plan import Plan, Route
from ..protocol import COORDINATOR

if TYPE_CHECKING:
    from ..dispatch import Dispatch


class Mail(Protocol):
    """What the stalls need of the run's roster (roster.Roster): the admitted nodes, and a way to them
    (a protocol, so that this module, which the stage processes import, needs not the roster's)."""

    @property
    def inboxes(self) -> Mapping[str, object]: ...

    def put(self, name: str, msg: m.Message) -> None: ...

#: Kinds of message in a chain (``Key.kind``): activations forward (the coordinator's ``Microbatch`` is
#: hop -1), gradients backward, and the origin's ``Done``.
FORWARD, BACKWARD, DONE = 0, 1, 2


@dataclass(frozen=True, order=True)
class Key:
    """One message of a microbatch's way, as nodes report it: its kind, microbatch and hop."""

    kind: int
    mb: int
    hop: int


@dataclass(frozen=True)
class Step:
    """One message of a chain: who sends ``key`` to whom, and whether its work needs room in flight."""

    key: Key
    sender: str
    receiver: str
    #: the receiver's work on it is forward work (waits while its in-flight activations are full)
    forward_work: bool


def chain(mb: int, route: Route) -> list[Step]:
    """Every message microbatch ``mb`` takes on ``route``, in order (``stage_process``: the origin embeds
    and runs its stage, activations go hop by hop and back to the origin for the loss, gradients go back
    the same way, and the origin reports ``Done``)."""
    o, nodes = route.origin, list(route.nodes)
    k = len(nodes)
    steps = [Step(Key(FORWARD, mb, -1), COORDINATOR, o, True)]
    if k:
        at = [o, *nodes]
        steps += [Step(Key(FORWARD, mb, h), at[h], nodes[h], True) for h in range(k)]
        steps.append(Step(Key(FORWARD, mb, k), nodes[-1], o, False))  # back at the origin for the loss
        steps += [Step(Key(BACKWARD, mb, h), o if h == k - 1 else nodes[h + 1], nodes[h], False)
                  for h in range(k - 1, -1, -1)]
        steps.append(Step(Key(BACKWARD, mb, -1), nodes[0], o, False))
    steps.append(Step(Key(DONE, mb, 0), o, COORDINATOR, False))
    return steps


@dataclass
class Account:
    """What one node says it received and sent this round."""

    received: set[Key] = field(default_factory=set)
    sent: set[Key] = field(default_factory=set)

    @classmethod
    def from_flat(cls, received: Sequence[int], sent: Sequence[int]) -> "Account":
        """From ``protocol.Progress``'s flat triples (kind, mb, hop, kind, mb, hop, ...); a trailing
        partial triple is ignored (the account is the node's word, whatever it says)."""
        def keys(flat: Sequence[int]) -> set[Key]:
            return {Key(*flat[i:i + 3]) for i in range(0, len(flat) - len(flat) % 3, 3)}
        return cls(keys(received), keys(sent))


def flat(keys: Iterable[Key]) -> tuple[int, ...]:
    """``keys`` as ``protocol.Progress`` carries them."""
    return tuple(x for key in sorted(keys) for x in (key.kind, key.mb, key.hop))


@dataclass
class Verdict:
    """What a stall's accounts show: nodes convicted by their own account (name -> why), and broken links."""

    held: dict[str, str] = field(default_factory=dict)
    disputes: set[frozenset[str]] = field(default_factory=set)


def attribute(routes: Mapping[int, Route], accounts: Mapping[str, Account], in_flight: Mapping[str, int],
              done: Iterable[int] = ()) -> Verdict:
    """The verdict on a stalled round: ``routes`` of its microbatches (all of them, so that what each
    node holds in flight is known), ``accounts`` of the nodes that answered (a node missing from it
    received and sent nothing), ``in_flight`` of each node (its plan's limit), ``done``: the microbatches
    the coordinator has the ``Done`` of."""
    done = set(done)
    empty = Account()
    coordinator = Account(received={Key(DONE, mb, 0) for mb in done},
                          sent={Key(FORWARD, mb, -1) for mb in routes})

    def account(name: str) -> Account:
        return coordinator if name == COORDINATOR else accounts.get(name, empty)

    chains = {mb: chain(mb, route) for mb, route in routes.items()}
    verdict = Verdict()
    for mb in sorted(set(routes) - done):
        for i, step in enumerate(chains[mb]):
            if step.key in account(step.receiver).received:
                continue
            sender = account(step.sender)
            if step.key in sender.sent:
                verdict.disputes.add(frozenset((step.sender, step.receiver)))
            elif step.sender != COORDINATOR and not _blocked(step.sender, chains[mb][i - 1], chains, sender,
                                                             in_flight.get(step.sender, 1)):
                verdict.held.setdefault(step.sender, f"kept microbatch {mb}'s {_WHAT[step.key.kind]} (hop "
                                                     f"{step.key.hop}) though it could pass it on, by its own account")
            break
    return verdict


_WHAT = {FORWARD: "activations", BACKWARD: "gradients", DONE: "loss"}


def _blocked(name: str, given: Step, chains: Mapping[int, list[Step]], said: Account, limit: int) -> bool:
    """Whether ``name``, given ``given`` (the input it says it has), may rightly wait: the input is
    forward work and its own account has ``limit`` microbatches in flight (a microbatch is in flight at a
    node from the forward work it did on it, whose output it sent on, until the backward work it did on
    it, whose output it sent back)."""
    if not given.forward_work:
        return False
    held = 0
    for steps in chains.values():
        out = back = False
        for before, step in zip(steps, steps[1:]):
            if step.sender == name and before.receiver == name and step.key in said.sent:
                out = out or before.forward_work
                back = back or before.key.kind == BACKWARD
        held += out and not back
    return held >= limit


def suspect(broken: Mapping[frozenset[str], Sequence[int]]) -> set[frozenset[str]]:
    """The broken links that keep a node out of the plan: one broken more than once, or one of a node
    that broke links with two peers or more (the coordinator aside). A single broken link is a network
    drop as often as a lie: the round is run again on the same plan, and only a second time tells."""
    partners: dict[str, set[str]] = {}
    for link in broken:
        for node in link - {COORDINATOR}:
            partners.setdefault(node, set()).update(link - {node})
    return {link for link, rounds in broken.items()
            if len(rounds) > 1 or any(len(partners.get(n, ())) > 1 for n in link - {COORDINATOR})}


def bench(disputes: Iterable[frozenset[str]]) -> set[str]:
    """Nodes to keep out of the plan so that no broken link joins two nodes in use: a node with the most
    broken links among those still open first (ties: by name), until none is open; the coordinator is
    never one of them (a link to it is closed by its other end)."""
    links = {frozenset(d) for d in disputes if len(d) == 2}
    out: set[str] = set()
    for link in links:
        if COORDINATOR in link:
            out |= link - {COORDINATOR}
    while True:
        open_links = [link for link in links if not link & out and COORDINATOR not in link]
        if not open_links:
            return out
        degree: dict[str, int] = {}
        for link in open_links:
            for node in link:
                degree[node] = degree.get(node, 0) + 1
        out.add(min(degree, key=lambda n: (-degree[n], n)))


#: Seconds the coordinator waits for the nodes' accounts of a stalled round.
ACCOUNT_WAIT_S = 10.0
#: Rounds a broken link stays broken: a network drop between two honest nodes keeps one of them out of
#: the plan no longer than this; a node that breaks links on purpose breaks them again, at one stall each.
LINK_ROUNDS = 50


class Stalls:
    """The coordinator's side: the run's broken links and benched nodes, and the accounts of each stall.

    ``roster`` is the run's (``put`` a message to a node); ``dispatch`` the reader of the control inbox
    (``dispatch.Dispatch``: the nodes' ``Progress`` comes to this object's handler); ``limit(name, stage)``
    the in-flight limit of a node at a stage; ``event(kind, **fields)`` records."""

    def __init__(self, roster: Mail, dispatch: Dispatch, limit: Callable[[str, int], int],
                 event: Callable[..., None]) -> None:
        self.roster, self.dispatch, self._limit, self._event = roster, dispatch, limit, event
        self._accounts: dict[str, Account] | None = None  # while a stall's accounts are taken
        self._asked: set[str] = set()
        dispatch.on(m.Progress, self._take)
        #: the links broken (a pair of names), each with the rounds it broke in (kept ``LINK_ROUNDS``)
        self.broken: dict[frozenset[str], list[int]] = {}
        #: the nodes kept out of the plan now (``bench``)
        self.benched: set[str] = set()
        self._change: tuple[set[str], set[str]] = (set(), set())

    def account(self, rnd: int, plan: Plan, done: Iterable[int]) -> dict[str, str]:
        """Ask the live nodes on the unfinished microbatches' routes of round ``rnd`` for their accounts
        (``ACCOUNT_WAIT_S`` at most), judge them, and update the bench (taken by :meth:`take_change`).
        Returns the nodes convicted by their own account (name -> why): the caller excludes them."""
        done = set(done)
        routes = dict(enumerate(plan.paths))
        asked = sorted({n for mb in set(routes) - done for n in (routes[mb].origin, *routes[mb].nodes)}
                       & set(self.roster.inboxes))
        for name in asked:
            self.roster.put(name, m.ProgressRequest(rnd))
        accounts = self._accounts = {}
        self._asked = set(asked)
        deadline = time.monotonic() + ACCOUNT_WAIT_S
        try:
            self.dispatch.until(lambda: set(asked) <= set(accounts) or time.monotonic() > deadline, rnd=rnd,
                                timeout=ACCOUNT_WAIT_S)
        except (NoMessage, NodesLost):  # those that did not answer received and sent nothing; the lost are
            pass                          # the roster's to report at the next check
        finally:
            self._accounts = None
        limits = {n: self._limit(n, s) for n, s in plan.allocation.items()}
        verdict = attribute(routes, accounts, limits, done)
        for link in verdict.disputes:
            self.broken.setdefault(link, []).append(rnd)
        back = self._rebench(rnd, exclude=set(verdict.held))
        self._event("stall-accounts", round=rnd, answered=sorted(accounts), silent=sorted(set(asked) - set(accounts)),
                    held=verdict.held, disputes=sorted(sorted(d) for d in verdict.disputes),
                    benched=sorted(self.benched), back=sorted(back))
        return verdict.held

    def _take(self, msg: m.Message) -> None:
        """A node's account (``Progress``): kept while a stall's are taken, from a node asked, once."""
        assert isinstance(msg, m.Progress)
        if self._accounts is not None and msg.sender in self._asked and msg.sender not in self._accounts:
            self._accounts[msg.sender] = Account.from_flat(msg.received, msg.sent)

    def refresh(self, rnd: int) -> set[str]:
        """Forget the links broken ``LINK_ROUNDS`` rounds before ``rnd``; the nodes that come back from the
        bench with that (also in :meth:`take_change`)."""
        old = any(rnd - at >= LINK_ROUNDS for rounds in self.broken.values() for at in rounds)
        return self._rebench(rnd) if old else set()

    def _rebench(self, rnd: int, exclude: AbstractSet[str] = frozenset()) -> set[str]:
        kept = {link: [at for at in rounds if rnd - at < LINK_ROUNDS] for link, rounds in self.broken.items()}
        self.broken = {link: rounds for link, rounds in kept.items() if rounds}
        benched = bench(suspect(self.broken)) - exclude
        newly, back = benched - self.benched, self.benched - benched
        self.benched = benched
        self._change = (self._change[0] - back | newly, self._change[1] - newly | back)
        return back

    def take_change(self) -> tuple[set[str], set[str]]:
        """(nodes newly benched, nodes back from the bench) since the last call: the next plan leaves the
        first out and takes the second in."""
        change, self._change = self._change, (set(), set())
        return change
