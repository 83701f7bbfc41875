"""Nodes joining a training run: a stage process started to join (``request_join``, a restart under a
known name or a new node), a node that came through the open door (``enroll``), waiting until they are
ready, and admitting them at an iteration boundary (``admit``: peers both ways). Placing them (a re-plan
with the node joined) is the trainer's.

``Joining`` is that part of ``roster.Roster``; the membership it adds to (``universe``, ``procs``,
``inboxes``, ``ready``, ``holding``) is the roster's, declared below and set by ``Roster``.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

from ...transport import zap
from ...transport.crypto import session_client_key
from ...transport.identity import revoke
from ...transport.session import current as current_session
from .. import protocol as m
from ..errors import NodeFailed, NoMessage, PlanError
from ..planning.network import Node
from .door import Placement
from .mail import Inbox
from .senders import Senders
from .stage_process import StageSettings


class Joining:
    """Nodes started to join, enrolled through the door, waited for and admitted (a mixin of ``Roster``)."""

    prepared: Any  # run.runspec.Prepared (the run's room is above the runtime's)
    config: Any  # run.runspec.TrainConfig
    control: Inbox
    beats: Inbox
    universe: dict[str, Node]
    procs: dict[str, Any]
    inboxes: dict[str, Any]
    excluded: dict[str, str]
    ready: dict[str, tuple[int, Any]]
    holding: dict[str, int | None]
    last_beat: dict[str, float]
    failed_starts: dict[str, str]
    _event: Callable[..., None]
    launch: Callable[..., None]
    _started: Callable[[str, Any, "int | None"], None]
    _settings: Callable[[str, int, int], StageSettings]
    put: Callable[[str, m.Message], None]
    _senders: Callable[[], Senders]
    _ids: Callable[[], "dict[str, str]"]
    recv: Callable[..., m.Message]
    _peers_delivered: Callable[[list[str]], None]

    def enroll(self, region: str | None, identity_public: bytes, node_key: str) -> Placement:
        """Place a node that came through the open door (``door``): a new name in ``region``, holding
        stage 0 until the next re-plan gives it its stage, with a certificate for its own keys (marked
        untrusted). It joins when it reports ready, as a node ``request_join`` started does."""
        name = self._new_node(None, region)
        node_id = "door-" + os.urandom(8).hex()
        authority = current_session().credentials.authority
        if authority is None:
            raise PlanError("only the session's root can admit nodes through the open door")
        cert = authority.certify(node_id, identity_public, node_key, trusted=False)
        settings = dataclasses.replace(self._settings(name, 0, sorted(self.universe).index(name)), device="auto",
                                       emulate=None, adversary=None)
        self._started(name, RemoteProcess(node_id), None)
        self._event("join-requested", nodes=[name], why="the open door")
        zap.admit(node_key, node_id)  # its connections, under its own key, reach the handshake here
        return Placement(name, node_id, cert, authority.ca_pem, session_client_key(current_session().credentials),
                         settings, self.control.address, self.beats.address)

    def request_join(self, name: str | None = None, region: str | None = None) -> str:
        """Start a stage process that joins the run when it is ready. A ``name`` the run knew (one
        that died) restarts it; a new name (or none: one is made up) adds a node in ``region``
        (default: the regions in turn), with the run's compute speed and memory. Returns its name.
        Raises PlanError for a live name or an unknown region."""
        if name is not None and (name in self.inboxes or (name in self.procs and self.procs[name].is_alive())):
            raise PlanError(f"node {name} is already running")
        if name in self.excluded:
            raise PlanError(f"node {name} was excluded ({self.excluded[name]}): it cannot join again")
        name = self._new_node(name, region)
        index = sorted(self.universe).index(name)
        self.launch(name, 0, index)
        self.holding[name] = None
        self._event("join-requested", nodes=[name])
        return name

    def _new_node(self, name: str | None, region: str | None) -> str:
        """``name`` if the run knew it, else a new node (named ``name``, or made up) in ``region`` (default:
        the regions in turn) with the run's compute speed and memory. PlanError for an unknown region."""
        if name is None or name not in self.universe:
            regions = sorted({r for pair in self.prepared.network.links for r in pair} |
                             {n.region for n in self.universe.values()})
            if region is None:
                region = regions[len(self.universe) % len(regions)]
            elif region not in regions:
                raise PlanError(f"unknown region {region!r}; the network has {', '.join(regions)}")
            if name is None:
                k = len(self.universe)
                while f"n{k:02d}" in self.universe:
                    k += 1
                name = f"n{k:02d}"
            template = next(iter(self.universe.values()))
            self.universe[name] = dataclasses.replace(template, name=name, region=region)
        return name

    def wait_ready(self, names: list[str], timeout: float) -> None:
        """Wait until the processes ``names`` are ready (not admitted yet). NodeFailed if one is not
        within ``timeout`` seconds, or fails or exits first."""
        deadline = time.monotonic() + timeout
        while any(n not in self.ready for n in names):
            failed = {n: self.failed_starts[n] for n in names if n in self.failed_starts and n not in self.ready}
            if failed:
                raise NodeFailed("joining node(s) failed before they were ready: "
                                 + "; ".join(f"{n}: {why}" for n, why in sorted(failed.items())))
            if time.monotonic() > deadline:
                raise NodeFailed(f"node(s) {', '.join(n for n in names if n not in self.ready)} not ready "
                                 f"within {timeout:g} s")
            try:
                self.recv(m.Ready, timeout=max(0.1, deadline - time.monotonic()), check=False)
            except NoMessage:
                pass

    def admit(self) -> list[str]:
        """Admit the processes that reported ready: peers both ways (the emulated link to each, when
        the network is emulated). Returns their names (sorted); placing them is the caller's."""
        joined = sorted(self.ready)
        for name in joined:
            _, inbox = self.ready.pop(name)
            everyone = self.prepared.network.with_nodes(list(self.universe.values()))
            for other in self.inboxes:
                link = everyone.link(other, name) if self.config.emulate_network else None
                self.put(other, m.PeerJoined(name, inbox, link, self.procs[name].node_id))
            self.inboxes[name] = inbox
            self._senders().add(name, inbox)
            self.last_beat[name] = time.monotonic()
            self.put(name, m.Peers(self.inboxes, self._ids()))
        if joined:  # nobody new: nothing to wait for (and a dead peer would hold the wait to its timeout)
            self._peers_delivered(list(self.inboxes))
        return joined


class RemoteProcess:
    """A stage process someone else started (it came through the open door): the coordinator cannot
    see or end its process, only its heartbeats and its credentials. ``kill`` revokes them (every
    connection it has to this process is closed; peers refuse it once told to forget it)."""

    exitcode = None

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._ended = False

    def is_alive(self) -> bool:
        """Until killed (its heartbeats tell whether it still works: ``Roster._dead``)."""
        return not self._ended

    def kill(self) -> None:
        self.revoke_credentials()
        self._ended = True

    def revoke_credentials(self) -> None:
        revoke(self.node_id)

    def join(self, timeout: float | None = None) -> None:
        """Nothing to wait for: its process is not this machine's."""
