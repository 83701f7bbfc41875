"""The stage process's side of verification (``[verify]``; issue 32): the receipts it makes, what it keeps
of what it received, and the recomputations it runs when the coordinator asks it to check a replica.

With ``mode`` other than "off", a stage process (``stage_process``):

- seals every tensor it sends to another process with its ``Receipt`` (``receipts``), on the thread
  that sends it (``sealer``);
- keeps every tensor it receives from another process in the current round, with the sender's receipt
  (``Evidence.keep``): its activations, the gradients sent back to it, its replicas' gradient shares.
  Kept by its ``tensor_id.TensorId`` (round, what, mb, hop, sender: the message's own hop; mb = hop = -1
  for a share); the round's tensors are dropped with the round. The cost: the round's inbound tensors stay in memory
  until its step (at most what the process received in one iteration);
- takes a tensor that comes without its receipt, or with one for another message, as a *dispute* it
  reports at once, and one that does not match its receipt's digest as a dispute when it is shown (the
  sender may have lied, or it may: the coordinator cannot tell which, and blames neither for it);
- summarises each activation and gradient received for the coordinator's screening
  (``screen.summarize``), in the process's idle moments (``summarize_one``, when no work is ready and no
  message waiting) rather than as it arrives, so that no computation waits on a summary; what is left is
  summarised before the round's report (``summaries``);
- once its stage's gradient shares have all come (``shares``), summarises the ones it is the
  *summariser* of this round (``summariser``: one receiver per share, another each round, so that each
  share is one screening row, not one per receiver, and no single receiver speaks for a share every
  round), and reports its own share's cosine to each of the others';
- after each step where its stage had other replicas, reports a digest of the weights it stepped to
  (``stepped``), which the coordinator compares with theirs;
- shows kept tensors on request (``show``), and recomputes what the coordinator asks of it
  (``recompute``) with the weights it holds now, which every replica of its stage holds bitwise equal
  until the round's step.

``recompute`` and ``difference`` are also the coordinator's own (a confirmation, ``verify``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from .. import protocol as m
from . import receipts
from .conduct import HONEST, Conduct
from .receipts import Receipt
from .screen import cosines_to, summarize, summarize_squared
from .tensor_id import Kind, Screened, TensorId

log = logging.getLogger(__name__)

#: what can be recomputed (``recompute``), by the computation that made the tensor checked.
KINDS = (Kind.FIRST, Kind.VISIT, Kind.LOSS, Kind.SHARE)


@dataclass
class Kept:
    """A tensor received, its sender's receipt, and whether it matched it on arrival."""

    tensor: torch.Tensor
    receipt: Receipt | None
    disputed: bool


@dataclass
class Evidence:
    """One stage process's receipts and kept tensors (the module doc). With ``mode = "off"`` it makes
    no receipt and keeps nothing."""

    name: str
    mode: str = "off"
    key: bytes = b""
    kept: dict[TensorId, Kept] = field(default_factory=dict)
    #: the screening rows of the tensors received this round
    screened: list[Screened] = field(default_factory=list)
    #: the tensors received this round and not summarised yet
    unsummarised: list[tuple[TensorId, torch.Tensor]] = field(default_factory=list)
    #: the tensors received this round that did not match their receipt
    disputes: list[TensorId] = field(default_factory=list)
    #: the gradient this process combined from its stage's shares this round (``combined``)
    total: torch.Tensor | None = None
    #: the CPU seconds of this process's verification work since ``spent`` was last called, by part
    #: (``timed``): "receipts" (the digest and MAC of each tensor sent, on its sender threads),
    #: "screening" (keeping and summarising what it got, its shares' cosines), "combined" (the digest of
    #: its combined gradient), "evidence" (kept tensors shown, their digests checked), "rechecks"
    #: (recomputations asked of it). What verification costs a node, in its own figures.
    cpu: dict[str, float] = field(default_factory=dict)
    _cpu_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def on(self) -> bool:
        return self.mode != "off"

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Count the CPU time of the calling thread inside the block as ``part`` of ``cpu`` (torch's own
        worker threads, where a node runs with more than one, are not counted)."""
        t0 = time.thread_time()
        try:
            yield
        finally:
            spent = time.thread_time() - t0
            with self._cpu_lock:
                self.cpu[part] = self.cpu.get(part, 0.0) + spent

    def spent(self) -> dict[str, float]:
        """``cpu`` as it is now, which starts again from nothing (a process reports it with each step)."""
        with self._cpu_lock:
            out, self.cpu = self.cpu, {}
        return out

    def clear(self) -> None:
        """A new round (or an aborted one): forget what the round received."""
        self.kept.clear()
        self.screened.clear()
        self.unsummarised.clear()
        self.disputes.clear()
        self.total = None

    def seal(self, what: str, rnd: int, mb: int, hop: int, tensor: torch.Tensor) -> Receipt | None:
        """This process's receipt for ``tensor`` as it sends it (None with verification off)."""
        if not self.on:
            return None
        return receipts.seal(self.key, TensorId(rnd, what, mb, hop, self.name), tensor)

    def sealer(self, what: str, rnd: int, mb: int, hop: int, tensor: torch.Tensor) -> Callable[[Any], Any] | None:
        """What puts this process's receipt for ``tensor`` on a message (``msg -> msg`` with ``receipt``
        set), for the sender thread to call just before the message goes out: the digest then runs
        there, beside this process's next computation (hashlib lets go of the GIL over large buffers),
        not before it. Made once, however many destinations call it; None with verification off."""
        if not self.on:
            return None
        made: list[Receipt] = []
        lock = threading.Lock()
        tensor_id = TensorId(rnd, what, mb, hop, self.name)

        def seal(msg: Any) -> Any:
            with lock:
                if not made:
                    with self.timed("receipts"):
                        made.append(receipts.seal(self.key, tensor_id, tensor))
            return dataclasses.replace(msg, receipt=made[0])
        return seal

    def keep(self, what: str, rnd: int, mb: int, hop: int, sender: str, tensor: torch.Tensor,
             receipt: Any) -> None:
        """``sender`` sent this process ``tensor`` (its ``receipt``): kept, checked, and, unless it is a share
        (``shares``), queued to be summarised (``summarize_one``)."""
        if not self.on or sender == self.name:
            return
        with self.timed("screening"):
            self._keep(TensorId(rnd, what, mb, hop, sender), tensor, receipt)

    def _keep(self, key: TensorId, tensor: torch.Tensor, receipt: Any) -> None:
        expected = isinstance(receipt, Receipt) and receipt.id == key
        # A receipt that names another message is a dispute at once; whether the tensor matches its digest
        # is checked when the tensor is shown (``show``): the kept tensor is the one that came, so the
        # answer is the same, and a tensor never shown is never hashed twice.
        disputed = not expected
        self.kept[key] = Kept(tensor, receipt if isinstance(receipt, Receipt) else None, disputed)
        if disputed:
            self.disputes.append(key)
        if key.what != "share":  # a share is summarised by one of its receivers, with the others (``shares``)
            self.unsummarised.append((key, tensor))

    def summarize_one(self) -> bool:
        """Summarise the oldest tensor not summarised yet; whether there was one."""
        if not self.unsummarised:
            return False
        key, tensor = self.unsummarised.pop(0)
        with self.timed("screening"):
            summary = summarize(tensor)
        self.screened.append(Screened(key, summary))
        return True

    def summaries(self) -> tuple[Screened, ...]:
        """Every summary of the round's tensors (those left summarised now): the screening rows the
        round's ``Norm`` carries."""
        while self.summarize_one():
            pass
        return tuple(self.screened)

    def combined(self, total: torch.Tensor) -> bytes | None:
        """This process combined ``total`` from its stage's shares this round: kept (shown under
        ``TensorId.combined``), and its digest returned for the coordinator (None with verification off). Kept by
        reference, not copied: the parameters' gradients are views of it, so it is what was combined
        until the step (whose clipping scales them in place), which ends every audit of the round."""
        if not self.on:
            return None
        with self.timed("combined"):
            self.total = total.detach().to("cpu")
            return receipts.digest(self.total)

    def stepped(self, weights: dict[str, torch.Tensor]) -> bytes | None:
        """This process stepped to ``weights`` (its stage's state dict): their digest for the coordinator
        (``receipts.weights_digest``; None with verification off), which compares it with its replicas'."""
        if not self.on:
            return None
        with self.timed("weights"):
            return receipts.weights_digest(weights)

    def show(self, keys: Sequence[Any]) -> dict[TensorId, tuple]:
        """The kept tensors of ``keys`` that this process has: key -> (tensor, receipt, disputed); its own
        combined gradient under ``TensorId.combined`` (no receipt). What is not a ``TensorId`` is not shown."""
        with self.timed("evidence"):
            return self._show(keys)

    def _show(self, keys: Sequence[Any]) -> dict[TensorId, tuple]:
        out: dict[TensorId, tuple] = {}
        for key in keys:
            if not isinstance(key, TensorId):
                continue
            if key.what == "combined":
                if self.total is not None and key.sender == "":
                    out[key] = (self.total, None, False)
                continue
            k = self.kept.get(key)
            if k is not None:
                if not k.disputed and not receipts.matches(k.receipt, k.tensor):
                    k.disputed = True
                    self.disputes.append(key)
                out[key] = (k.tensor, k.receipt, k.disputed)
        return out

    def shares(self, rnd: int, got: dict[str, torch.Tensor], counts: dict[str, int]) -> dict[str, float]:
        """Round ``rnd``'s gradient shares of this process's stage have all come (``got``: each replica's,
        its own included; ``counts``: the microbatches each ran): the screening rows of the shares this
        process is the ``summariser`` of (each summarised per microbatch, so that replicas of unequal loads
        compare; all zeros is no finding for one that ran none), and returned, with 2 replicas or more,
        its own share's cosine to each other replica's (``screen.cosines_to``: one that ran nothing, or
        sent what is not finite, left out; {} with no other taken, or its own not taken). The
        coordinator takes a share's cosine from what its *other* replicas report of it, so its sender has
        no say on its own.
        One pass over each share summarised, one over each other share for its norm and one for its dot
        product with this process's own: nothing is read twice."""
        if not self.on:
            return {}
        with self.timed("screening"):
            # its own share may be on its device; the others came to the CPU, where all are compared
            got = {n: t if t.device.type == "cpu" else t.detach().to("cpu") for n, t in got.items()}
            names = sorted(got)
            known: dict[str, float] = {}
            for sender in names:
                if sender == self.name or summariser(sender, names, rnd) != self.name:
                    continue
                count = counts.get(sender, 0)
                summary, known[sender] = summarize_squared(got[sender], divisor=count or 1)
                if not (count == 0 and summary.found == ("zeros",)):
                    self.screened.append(Screened(TensorId(rnd, "share", -1, -1, sender), summary))
            if self.name not in got or len(names) < 2:
                return {}
            return cosines_to(got[self.name], {n: got[n] for n in names if n != self.name}, known)


def summariser(sender: str, replicas: Sequence[str], rnd: int) -> str:
    """Which of ``sender``'s other replicas summarises its share of round ``rnd`` for screening (``replicas``
    in one order for all of them; "" with no other): the one ``k`` places after it, ``k`` going from 1 to
    ``n - 1`` round after round, so that each replica summarises exactly one share a round and each
    share is summarised by each of its other replicas in turn."""
    n = len(replicas)
    if n < 2 or sender not in replicas:
        return ""
    return replicas[(list(replicas).index(sender) + 1 + rnd % (n - 1)) % n]


def platform(device: torch.device) -> str:
    """What a process's arithmetic runs on, as far as it decides the bits of an optimizer step: the
    device's kind and model (the CPU's vector unit, as torch dispatches to it; the GPU's name and compute
    capability) and torch's version. Replicas on one platform step bitwise alike; across platforms a
    fused multiply-add or a vector width may round otherwise."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        kind = f"cuda:{torch.cuda.get_device_name(device)}:sm{major}{minor}"
    elif device.type == "cpu":
        kind = f"cpu:{torch.backends.cpu.get_cpu_capability()}"
    else:
        kind = device.type
    return f"{kind}:torch {torch.__version__}"


def difference(got: Any, want: Any) -> float:
    """How far a tensor sent (``got``) is from its recomputation (``want``): ``|got - want| / |want|``
    (L2 over the finite elements; relative, so a tolerance covers float nondeterminism at any scale);
    inf when ``got`` is not a tensor of ``want``'s shape, or is not finite where ``want`` is (or the
    other way round, or with other infinities). For a tuple of tensors (a visit's two outputs), the
    largest of its parts' differences (inf when ``got`` is not a tuple of as many)."""
    if isinstance(want, tuple):
        if not isinstance(got, tuple) or len(got) != len(want):
            return math.inf
        return max((difference(g, w) for g, w in zip(got, want)), default=0.0)
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor) or got.shape != want.shape:
        return math.inf
    g, w = got.detach().float().to(want.device), want.detach().float()
    fg, fw = torch.isfinite(g), torch.isfinite(w)
    if not torch.equal(fg, fw):
        return math.inf
    if not bool(fg.all()):
        bad = ~fg
        if not torch.equal(torch.isnan(g[bad]), torch.isnan(w[bad])) or \
                not torch.equal(torch.nan_to_num(g[bad]), torch.nan_to_num(w[bad])):
            return math.inf
        g, w = g[fg], w[fw]
    return float((g - w).norm()) / max(float(w.norm()), 1e-12)


def recompute(stage: Any, kind: str, inputs: dict, device: torch.device,
              bf16: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What ``stage`` (a ``stages.Stage`` holding the weights to check against) computes for ``kind``
    (``KINDS``) from ``inputs``; nothing accumulates into the stage's own gradients.

    - "first": the origin's forward, ``inputs["tokens"]`` -> its activations;
    - "visit": a visited stage's two computations for one microbatch, from the activations it got
      (``inputs["x"]``) and the gradient that came back for its output (``inputs["g"]``): the pair
      (its activations ``stage(x)``, the gradient of ``stage(x)`` times ``g`` with respect to ``x``),
      from one forward (checking the backward needs the forward anyway: the two cost what the
      backward alone does);
    - "loss": the gradient of the loss of ``inputs["a"]`` (activations back at the origin) for
      ``inputs["targets"]``, with respect to ``a``;
    - "share": the stage's summed parameter gradients over ``inputs["visits"]``, flattened as a share
      is: for stage 0 each visit is ``tokens``, ``targets`` and, where the microbatch left the origin,
      ``a`` and ``g`` (the gradient that came back); for the others ``x`` and ``g``.
    """
    auto = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    def on(t: torch.Tensor, grad: bool = False) -> torch.Tensor:
        t = t.to(device)
        return t.detach().requires_grad_(True) if grad else t

    if kind == "first":
        with torch.no_grad(), auto:
            return stage(stage.embed(on(inputs["tokens"]))).float()
    if kind == "loss":
        a = on(inputs["a"], grad=True)
        with auto:
            loss = stage.loss(a, on(inputs["targets"]))
        return torch.autograd.grad(loss, a)[0].float()
    if kind == "visit":
        x = on(inputs["x"], grad=True)
        with auto:
            y = stage(x)
        return y.detach().float(), torch.autograd.grad(y, x, on(inputs["g"]).to(y.dtype))[0].float()
    if kind == "share":
        return _share(stage, inputs["visits"], on, auto)
    raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")


def recheck(stage: Any, held: int, msg: m.Recheck, device: torch.device, bf16: bool = False,
            conduct: Conduct = HONEST, name: str = "") -> m.Rechecked:
    """A stage process's answer to ``msg`` (a ``Recheck``), as process ``name`` holding ``stage`` (a
    ``stages.Stage``) of index ``held``: the difference of ``msg.claimed`` from its recomputation; NaN
    when it does not hold the stage or cannot recompute it; what it answers goes through its
    ``conduct`` (a lying verifier says otherwise)."""
    diff = math.nan
    if msg.stage == held:
        try:
            diff = difference(msg.claimed, recompute(stage, msg.kind, msg.inputs, device, bf16))
        except Exception as exc:
            log.warning("%s: could not recompute %s: %s", name, msg.kind, exc)
    diff = conduct.reports(name, msg.round, diff)
    return m.Rechecked(msg.round, name, msg.check, diff)


def _share(stage: Any, visits: Sequence[dict], on: Any, auto: Any) -> torch.Tensor:
    params = list(stage.parameters())
    total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    for v in visits:
        outputs: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        with auto:
            if "tokens" in v:
                h = stage(stage.embed(on(v["tokens"])))
                if v.get("a") is None:  # the microbatch never left the origin: one graph
                    outputs.append(stage.loss(h, on(v["targets"])))
                    grads.append(None)
                else:
                    outputs += [stage.loss(on(v["a"], grad=True), on(v["targets"])), h]
                    grads += [None, on(v["g"]).to(h.dtype)]
            else:
                y = stage(on(v["x"]))
                outputs.append(y)
                grads.append(on(v["g"]).to(y.dtype))
        got = torch.autograd.grad(outputs, params, grads, allow_unused=True)
        for acc, g in zip(total, got):
            if g is not None:
                acc.add_(g.float())
    return torch.cat([t.flatten() for t in total])
