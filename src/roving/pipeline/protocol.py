"""The messages between the training coordinator and its stage processes, and between stage processes.

Each message is a small frozen dataclass; it travels as data (``codec``: a JSON header and its tensors'
raw bytes, never pickled). Every message that a stage process sends has a ``sender``, which is not on
the wire: the reader's inbox (``mail.Inbox``) sets it from the identity the transport authenticated;
every message that belongs to one attempt at an iteration's
microbatch phase carries its ``round`` (a number that grows with every attempt: when a stage process
fails, the coordinator aborts the round and runs the iteration again under a new plan in a new round).
Both ends dispatch on the message's type; a message of a type a receiver does not handle is a
``ProtocolError`` naming the type and the receiver.

The messages travel through inboxes (``mail``): each stage process reads its own (a postbox of its
process, so that peers' sends go straight to it), and answers the coordinator in the coordinator's
``control`` inbox; heartbeats go to its ``beats`` inbox from a thread of their own.

coordinator -> stage process: ``Peers`` ``PeerJoined`` ``Forget`` ``Microbatch`` ``SyncOrder`` ``Step``
``Abort`` ``ProgressRequest`` ``Export`` ``Load`` ``StateRequest`` ``Throttle`` ``EvidenceRequest``
``Recheck`` ``ShowWeights`` ``Stop`` ``Release``.
stage process -> stage process: ``Forward`` ``Backward`` ``Gradients``.
stage process -> coordinator: ``Ready`` ``Done`` ``Norm`` ``Stepped`` ``State`` ``Exported`` ``Loaded``
``EvidenceItems`` ``Rechecked`` ``WeightsShown`` ``Progress`` ``Stopped`` ``Released`` ``Failed``; on
``beats``: ``Beat``.

Rounds (how the stage process reads them): it works on one round at a time. A message of a newer round
than its own means the coordinator gave up the current one (the explicit ``Abort`` may still be on its
way): the old round's work and gradients are dropped first. Messages of older rounds, and of a round
aborted, are dropped (a message can arrive after the abort of its round), so a re-run never mixes with
what was left of the aborted attempt, whatever order messages from different senders arrive in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ProtocolError
from .planning.plan import Route

#: the ``sender`` of the coordinator's messages.
COORDINATOR = "coordinator"


def unexpected(msg: Any, receiver: str, waiting_for: str = "") -> ProtocolError:
    """The error for ``msg`` arriving at ``receiver`` (optionally: while it waited for something)."""
    kind = type(msg).__name__ if isinstance(msg, Message) else f"{type(msg).__name__} (not a protocol message)"
    return ProtocolError(f"{receiver}: unexpected message {kind}"
                         + (f" while waiting for {waiting_for}" if waiting_for else ""))


@dataclass(frozen=True, slots=True)
class Message:
    """The base of every message."""


@dataclass(frozen=True, slots=True)
class RoundMessage(Message):
    """A message that belongs to one round (an attempt at an iteration's microbatch phase)."""

    round: int


# -- coordinator -> stage process --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Peers(Message):
    """Every admitted stage process's inbox (a ``PostboxAddress``), and the node id each one's
    connections authenticate as, by name (after all are ready; to a joining one on admission)."""

    inboxes: dict
    ids: dict = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PeerJoined(Message):
    """A stage process joined: its inbox, and the emulated link to it (None: send at once)."""

    name: str
    inbox: Any
    link: Any = None
    #: the node id its connections authenticate as
    node_id: str = ""


@dataclass(frozen=True, slots=True)
class Forget(Message):
    """These stage processes were declared dead: stop sending to them."""

    names: list


@dataclass(frozen=True, slots=True)
class Microbatch(RoundMessage):
    """A microbatch, to its origin (a stage-0 process), with the route it travels."""

    mb: int
    tokens: Any
    targets: Any
    route: Route


@dataclass(frozen=True, slots=True)
class SyncOrder(RoundMessage):
    """Average gradients with ``replicas`` (sorted names of this stage's processes) over ``count``
    microbatches, as soon as this process has run ``expect`` backward passes in the round (sent with
    the round's microbatches, so a stage's replicas average while other stages still work; None: at
    once). ``combined``: with verification on, report a digest of the gradient combined
    (``Norm.combined``; the coordinator asks for it where its replicas' weights check could not name
    a replica that combined another gradient by itself: ``verify.Verifier.combined_asked``)."""

    replicas: list
    count: int
    expect: int | None = None
    combined: bool = True


@dataclass(frozen=True, slots=True)
class Step(RoundMessage):
    """Scale the gradients by ``clip_coef`` and take an AdamW step with learning rate ``lr``."""

    clip_coef: float
    lr: float


@dataclass(frozen=True, slots=True)
class Abort(RoundMessage):
    """Drop all work of the round and its gradients."""


@dataclass(frozen=True, slots=True)
class ProgressRequest(RoundMessage):
    """The round stalled: say what you received and sent in it (``Progress``; ``runtime/stalls.py``)."""


@dataclass(frozen=True, slots=True)
class Export(Message):
    """Send this stage's weights and optimizer state (answered by ``Exported``)."""


@dataclass(frozen=True, slots=True)
class Load(Message):
    """Hold ``stage`` from now on with these weights and optimizer state (None: a fresh optimizer),
    at most ``in_flight`` microbatches at a time (answered by ``Loaded``)."""

    stage: int
    in_flight: int
    params: dict
    optimizer: dict | None


@dataclass(frozen=True, slots=True)
class StateRequest(Message):
    """Send this stage's weights, or with ``grads`` its gradients as they are now (answered by
    ``State``)."""

    grads: bool = False


@dataclass(frozen=True, slots=True)
class Throttle(Message):
    """Fault injection: compute ``factor`` times slower."""

    factor: float


@dataclass(frozen=True, slots=True)
class EvidenceRequest(RoundMessage):
    """Show the tensors of ``keys`` (each a ``tensor_id.TensorId``) that you received this round
    (``evidence.Evidence.show``); ``ask`` numbers the request, for its answer to name."""

    keys: tuple
    ask: int = 0


@dataclass(frozen=True, slots=True)
class Recheck(RoundMessage):
    """Recompute ``kind`` (``evidence.recompute``) of ``stage`` from ``inputs`` with the weights you hold
    now, and say how far ``claimed`` is from it (check number ``check``)."""

    check: int
    stage: int
    kind: str
    inputs: dict
    claimed: Any


@dataclass(frozen=True, slots=True)
class ShowWeights(RoundMessage):
    """Send the weights of the stage you hold now, for a check of round ``round`` (answered by
    ``WeightsShown``; a round's message, so that an answer left from an aborted round is dropped)."""


@dataclass(frozen=True, slots=True)
class Stop(Message):
    """Confirm every send to the ``live`` processes, answer ``Stopped``, exit when released."""

    live: list | None = None


@dataclass(frozen=True, slots=True)
class Release(Message):
    """After ``Stopped``: every process has stopped sending; exit."""


# -- stage process -> stage process ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Forward(RoundMessage):
    """Activations of microbatch ``mb``; ``hop`` is the receiver's index in ``route.nodes``, or
    ``len(route.nodes)`` when they return to the origin for the loss."""

    sender: str
    mb: int
    hop: int
    tensor: Any
    route: Route
    #: the sender's ``receipts.Receipt`` for ``tensor`` (None with verification off)
    receipt: Any = None


@dataclass(frozen=True, slots=True)
class Backward(RoundMessage):
    """Gradients of microbatch ``mb``'s activations; ``hop`` = -1 when they reach the origin."""

    sender: str
    mb: int
    hop: int
    tensor: Any
    route: Route
    #: the sender's ``receipts.Receipt`` for ``tensor`` (None with verification off)
    receipt: Any = None


@dataclass(frozen=True, slots=True)
class Gradients(RoundMessage):
    """A replica's summed gradients of the round, flattened, over ``count`` microbatches (its
    backward passes of the round; ``aggregate`` weighs replicas by it)."""

    sender: str
    flat: Any
    count: int = 0
    #: the sender's ``receipts.Receipt`` for ``flat`` (None with verification off)
    receipt: Any = None


# -- stage process -> coordinator --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ready(Message):
    """A stage process started (incarnation ``incarnation`` of its name) and reads ``inbox``."""

    sender: str
    incarnation: int
    inbox: Any


@dataclass(frozen=True, slots=True)
class Beat(Message):
    """A heartbeat, every ``heartbeat`` seconds from a thread of its own."""

    sender: str
    incarnation: int


@dataclass(frozen=True, slots=True)
class Done(RoundMessage):
    """Microbatch ``mb`` is done (its backward reached the origin ``sender``); its loss."""

    sender: str
    mb: int
    loss: float


@dataclass(frozen=True, slots=True)
class Norm(RoundMessage):
    """``sender``'s replicas of ``stage`` averaged: the squared norm of the averaged gradients."""

    sender: str
    stage: int
    sq_norm: float
    #: with verification on, what ``sender`` received this round (``evidence.Evidence``): a screening
    #: row (``tensor_id.Screened``: the ``TensorId`` and its ``screen.Summary``) per tensor (a tuple as
    #: the node sends them; read off the wire, a ``rows.ScreenedRows``: a sequence of the same rows), the
    #: ``TensorId`` of those that did not match their receipt, and its own gradient share's cosine to each
    #: other replica's, by name (3 replicas or more)
    screened: Sequence[Any] = ()
    disputes: tuple = ()
    cosines: Any = None
    #: with verification on, other replicas and ``SyncOrder.combined``: the digest of the gradient it
    #: combined from the replicas' shares (``evidence.Evidence.combined``), which every replica's must equal
    combined: Any = None


@dataclass(frozen=True, slots=True)
class Stepped(RoundMessage):
    """``sender`` stepped; its statistics since the previous step, and ``grad_norm``: the L2 norm of its
    stage's latest gradient (averaged over the replicas, before clipping; NaN when it had none), the
    input of CheckFree's recovery rule (``recovery``)."""

    sender: str
    stats: dict
    grad_norm: float = float("nan")
    #: with verification on: the digest of the weights it holds after the step
    #: (``receipts.weights_digest``), which every replica's of its ``platform`` must equal, and every
    #: export of its weights until its next step (``verify``)
    weights: Any = None
    #: what its arithmetic runs on (``evidence.platform``): replicas step bitwise alike on one platform
    platform: str = ""


@dataclass(frozen=True, slots=True)
class EvidenceItems(RoundMessage):
    """The answer to ``EvidenceRequest`` number ``ask``: ``TensorId`` -> (tensor, receipt, disputed) for the
    keys ``sender`` has."""

    sender: str
    items: dict
    ask: int = 0


@dataclass(frozen=True, slots=True)
class Rechecked(RoundMessage):
    """The answer to ``Recheck``: ``difference`` (``evidence.difference``; NaN when ``sender`` does not hold
    the stage)."""

    sender: str
    check: int
    difference: float


@dataclass(frozen=True, slots=True)
class WeightsShown(RoundMessage):
    """The answer to ``ShowWeights``: ``sender``'s stage and its weights by parameter name."""

    sender: str
    stage: int
    tensors: dict


@dataclass(frozen=True, slots=True)
class State(Message):
    """The answer to ``StateRequest``: ``sender``'s stage and its tensors by parameter name."""

    sender: str
    stage: int
    tensors: dict


@dataclass(frozen=True, slots=True)
class Exported(Message):
    """The answer to ``Export``: ``sender``'s stage, weights and optimizer state (on the CPU)."""

    sender: str
    stage: int
    params: dict
    optimizer: dict


@dataclass(frozen=True, slots=True)
class Loaded(Message):
    """The answer to ``Load``: ``sender`` holds ``stage`` now."""

    sender: str
    stage: int


@dataclass(frozen=True, slots=True)
class Progress(RoundMessage):
    """The answer to ``ProgressRequest``: the messages of the round ``sender`` received and sent, each as a
    (kind, microbatch, hop) triple, flat (``stalls.Key``; kind 0: activations, 1: gradients, 2: Done)."""

    sender: str
    received: tuple[int, ...] = ()
    sent: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Stopped(Message):
    """The answer to ``Stop``: every send of ``sender`` to a live process has arrived."""

    sender: str


@dataclass(frozen=True, slots=True)
class Released(Message):
    """The answer to ``Release``: ``sender`` leaves now (the coordinator need not confirm its sends to it)."""

    sender: str


@dataclass(frozen=True, slots=True)
class Failed(Message):
    """``sender`` raised: its traceback."""

    sender: str
    traceback: str


#: The messages only the coordinator sends (a stage process refuses them from anyone else).
COORDINATOR_MESSAGES = (Peers, PeerJoined, Forget, Microbatch, SyncOrder, Step, Abort, ProgressRequest, Export, Load,
                        StateRequest, Throttle, EvidenceRequest, Recheck, ShowWeights, Stop, Release)
