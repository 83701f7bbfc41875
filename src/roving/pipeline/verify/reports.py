"""The coordinator's reading of what nodes report for screening (``verifier``, the module doc,
Screening): each ``Norm``'s rows fed to the ``screen.Screen`` as it comes (``screen``), and at the round's
end the shares' cosines judged and the nodes out of their band named (``suspects``). A report that is
not of the shape a stage process makes has its sender caught ("report")."""

from __future__ import annotations

import statistics

from .. import protocol as m
from .audit import Audit
from .checks import Check, Source
from .findings import Findings
from .rows import ScreenedRows
from .screen import Screen, sound
from .tensor_id import WHATS, Kind, Screened, TensorId


class Reports:
    """Screening reports read into the run's ``Screen``."""

    def __init__(self, findings: Findings) -> None:
        self.findings = findings
        self.screen = Screen()

    def screen_norm(self, a: Audit, msg: m.Norm) -> None:
        """Feed a ``Norm``'s screening rows to the screen as it comes (so that only the last one's are
        left for the round's end): the keys of tensors found bad at once go to ``a.flagged``, disputes
        become events, its share cosines are kept for ``suspects``. (The rows of a round later given up
        count too: those tensors were sent.) A report that is not one (a row, a dispute or a cosine of
        another shape) has its sender caught: only it could have sent it, over its own connection."""
        if not well_formed(msg):
            c = Check(msg.sender, a.alloc.get(msg.sender, -1), Kind.REPORT, -1, -1, Source())
            self.findings.catch(a.caught, msg.sender, "report", c,
                                reason="sent a screening report that is not one (its rows, disputes or cosines "
                                "malformed)")
            return
        for row in msg.screened:
            t = row.tensor
            stage = a.alloc.get(t.sender)
            if stage is None:
                continue
            # comparable tensors: of one stage, at one position on the routes (the residual stream
            # grows along a route, and a route may skip stages); shares of one stage and one load (a share
            # is summarised per microbatch, but where noise makes most of a gradient the norm of a mean
            # of k falls as 1/sqrt(k): honest replicas of unequal loads would stand apart)
            boundary = ("share", stage, a.loads.get(t.sender, -1)) if t.what == "share" else (t.what, stage, t.hop)
            if self.screen.add(boundary, t.sender, row.summary):
                a.flagged.add(t)
        for key in msg.disputes:
            self.findings.dispute([key.sender, msg.sender], "a tensor did not match its sender's receipt on arrival",
                                  key=key.as_list())
        # a replica reports its own share's cosine to each of its stage's other replicas': a
        # share's cosines are those its *other* replicas report, so that nobody speaks for its own
        stage = a.alloc.get(msg.sender)
        for name, cos in (msg.cosines or {}).items():
            if name != msg.sender and stage is not None and a.alloc.get(name) == stage:
                a.cosines.setdefault(name, []).append(cos)

    def suspects(self, a: Audit) -> None:
        """The round's end of screening: each share's cosine (the median of what its other replicas
        reported of it: one liar of 4 replicas is outvoted, of 3 it moves the mean of two; a suspect is
        only checked more), then the nodes out of their boundary's band, each new one an event. A share
        whose cosine of the round is opposed (``Screen.cosine``: below 0, and far below its earlier
        rounds') has its node's computations of the round checked at the suspect's rate
        (``sampling.Sampling.redraw``), in this round only: a negated share is opposed in every round it is
        negated. (With 2 replicas the one cosine is both shares': both are opposed; the checks tell which
        lied.) Likewise a node whose outputs' profile turned this round (``Screen.turned``)."""
        for name, values in a.cosines.items():
            if name in a.alloc:
                if self.screen.cosine(("share", a.alloc[name]), name, statistics.median(values)):
                    a.opposed.add(name)
        a.turned.update(n for n in self.screen.turned() if n in a.alloc)
        for s in self.screen.suspects():
            if s.node in a.alloc:
                self.findings.suspect(s)


def well_formed(msg: m.Norm) -> bool:
    """Whether a ``Norm``'s screening report has the shape a stage process makes: rows (``Screened``: a
    tensor of the Norm's round and a sound ``screen.Summary``; a tuple of them, or the ``rows.ScreenedRows``
    the wire reads them into), disputed tensors (``TensorId`` of its round), and cosines (name -> a
    number within [-1, 1], give or take far more than rounding), or none."""
    def key(k: object) -> bool:
        return (type(k) is TensorId and k.round == msg.round and k.what in WHATS and type(k.mb) is int
                and type(k.hop) is int and isinstance(k.sender, str))

    rows, disputes, cosines = msg.screened, msg.disputes, msg.cosines
    if type(rows) is ScreenedRows:  # as the wire brings them: whole numbers and known kinds already
        if not (rows.of_round(msg.round) and rows.sound()):
            return False
    elif not isinstance(rows, tuple) or not all(type(r) is Screened and key(r.tensor) and sound(r.summary)
                                                for r in rows):
        return False
    if not isinstance(disputes, tuple):
        return False
    if not all(key(k) for k in disputes):
        return False
    if cosines is None:
        return True
    return isinstance(cosines, dict) and all(
        isinstance(n, str) and isinstance(c, float) and abs(c) <= 1.01 for n, c in cosines.items())
