"""The evidence of a check (``verifier``, the module doc, 1.): the tensors it needs, asked of the nodes
that received them (``Gather.ask``), each judged by its sender's receipt as it is shown
(``Gather.shown``): a holder that shows a tensor its sender's receipt does not name, or shows nothing, is
caught itself; a tensor the holder reported at once as not matching its receipt, or a receipt whose MAC
is not its sender's, is a dispute."""

from __future__ import annotations

from typing import Any, Callable

from .. import protocol as m
from . import receipts
from .audit import Ask, Audit
from .checks import Check, Source
from .findings import Findings


class Gather:
    """Asks holders for the tensors they kept and judges what they show."""

    def __init__(self, findings: Findings, roster: Any) -> None:
        self.findings, self.roster = findings, roster
        self._ask_id = 0

    def ask(self, a: Audit, wanted: dict[str, set], then: Callable[[dict[str, dict]], None]) -> None:
        """Ask each holder of ``wanted`` (holder -> keys) for its kept tensors; ``then`` gets them (holder
        -> key -> (tensor, receipt, disputed)) once every holder answered (``take``)."""
        if not wanted:
            then({})
            return
        self._ask_id += 1
        for holder, keys in wanted.items():
            self.roster.put(holder, m.EvidenceRequest(a.rnd, tuple(sorted(keys)), self._ask_id))
        a.asks[self._ask_id] = Ask(set(wanted), then)

    def take(self, a: Audit, msg: m.EvidenceItems) -> None:
        """A holder's answer to an ask of ``a`` (once each; another's, or a second, is ignored)."""
        ask = a.asks.get(msg.ask)
        if ask is None or msg.sender not in ask.waiting:
            return
        ask.shown[msg.sender] = msg.items if isinstance(msg.items, dict) else {}
        ask.waiting.discard(msg.sender)
        if not ask.waiting:
            del a.asks[msg.ask]
            ask.then(ask.shown)

    def shown(self, src: Source, shown: dict[str, dict], caught: dict[str, str], c: Check) -> Any:
        """The tensor of ``src`` once it is covered by its sender's receipt for it (``src.key``: of the
        audit's round); None, after
        blaming the holder or recording a dispute, when it is not (the module doc, Evidence). A tensor
        under the receipt of another round is not this round's (its sender's work of another round is
        not checked against this round's inputs): its holder is caught."""
        key = src.key
        if not src.holder or key is None:
            return src.value
        got = shown.get(src.holder, {}).get(key)
        sender = key.sender
        if got is None or not isinstance(got, tuple) or len(got) != 3:
            self.findings.catch(caught, src.holder, "evidence", c,
                                reason=f"did not show the tensor {key.as_list()} it received from {sender}")
            return None
        tensor, receipt, disputed = got
        if disputed:
            self.findings.dispute([sender, src.holder], "a tensor did not match its sender's receipt on arrival",
                                  key=key.as_list())
            return None
        if not isinstance(receipt, receipts.Receipt) or receipt.id != key or not receipts.matches(receipt, tensor):
            self.findings.catch(caught, src.holder, "evidence", c,
                                reason=f"showed a tensor {key.as_list()} that {sender}'s receipt does not name")
            return None
        if not receipts.genuine(receipts.node_key(self.roster.run_key, sender), receipt):
            self.findings.dispute([sender, src.holder], "a receipt's MAC is not its sender's", key=key.as_list())
            return None
        return tensor

    def evidence(self, c: Check, shown: dict[str, dict], caught: dict[str, str]) -> tuple | None:
        """The check's tensors (claimed, inputs) once each is covered by its sender's receipt; None, after
        blaming or recording a dispute, when one is not."""
        outputs = [self.shown(src, shown, caught, c) for src in c.outputs()]
        if any(t is None for t in outputs):
            return None
        claimed = outputs[0] if len(outputs) == 1 else tuple(outputs)
        inputs = {}
        for name, src in c.inputs.items():
            inputs[name] = self.shown(src, shown, caught, c)
            if inputs[name] is None:
                return None
        visits = []
        for v in c.visits:
            got = {name: self.shown(src, shown, caught, c) for name, src in v.items()}
            if any(t is None for t in got.values()):
                return None
            visits.append(got)
        if c.kind == "share":
            inputs = {"visits": visits}
        return claimed, inputs

