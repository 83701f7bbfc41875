"""The training run's membership: the stage processes, their inboxes, their heartbeats, joining and
admission, and the coordinator's receiving end of the protocol.

``Roster`` starts stage processes on the run's backend, keeps what it knows of each (its process, its
inbox once admitted, its incarnation, its last heartbeat, the stage whose weights it holds), receives
their messages, and finds the dead: a process that exits, or whose heartbeats stop for ``dead_after``
seconds, is declared dead and killed (so that one that was only unreachable cannot come back with stale
work), every live process is told to forget it, and ``recv`` raises ``NodesLost``. It reports the lost
ones (``take_lost``) and never plans: what to do about them is the trainer's.

Joining: ``request_join`` (and join request files in the trainer's ``control`` folder, see ``roving
pipeline join``) starts a stage process on the run's backend; when it reports ready it is admitted at
the next iteration boundary (``admit``): it gets every inbox, and every process gets its inbox. The
trainer then places it (a re-plan with the node joined), and it receives its stage's weights and
optimizer state from a live replica, or from the latest snapshot when none holds the stage
(``weights``). Restarted processes (``restart``) join the same way.
"""

from __future__ import annotations

import logging
import os
import queue as _queue
import threading
import time
from typing import Any, Callable

from ...transport.session import current as current_session
from .. import protocol as m
from ..verify.adversary import parse_adversaries
from ..errors import NodeFailed, NodesLost, NoMessage, PlanError
from .mail import Directory, Inbox
from ..verify.receipts import node_key
from .joining import Joining, RemoteProcess
from .senders import Senders
from .stage_process import StageSettings, stage_main

log = logging.getLogger(__name__)


class Roster(Joining):
    """The stage processes of one run (``prep``: a ``runspec.Prepared``). ``event(kind, **fields)``
    records what happened to them ("dead", "join-requested", "join-failed").

    Names: ``universe`` is every node ever known (the network's and those that joined), ``procs`` every
    process started (by name, the latest incarnation), ``inboxes`` the admitted live ones, ``starting``
    those started and not ready yet, ``ready`` those ready and not admitted yet, ``holding`` the stage
    whose weights each holds now (None: nothing useful yet)."""

    def __init__(self, prep: Any, event: Callable[..., None]) -> None:
        self.prepared, self.config, self.spec, self._event = prep, prep.config, prep.spec, event
        #: who is who: the node id each stage process's connections authenticate as, by name
        self.directory = Directory()
        self.control = Inbox(self.directory)
        self.beats = Inbox(self.directory)
        self.universe = {n.name: n for n in prep.network.nodes}
        #: adversary injection (``[verify] adversaries``): node -> how it lies
        self.adversaries = parse_adversaries(self.config.adversaries, self.config.seed)
        unknown = sorted(set(self.adversaries) - set(self.universe))
        if unknown:
            raise PlanError(f"adversaries: no node {', '.join(unknown)} in the run's network "
                            f"(its nodes: {', '.join(sorted(self.universe))})")
        #: the key every node's receipt key is derived from (``receipts``); no node holds it
        self.run_key = os.urandom(32)
        #: nodes caught computing wrong (``exclude``): never admitted again, by name
        self.excluded: dict[str, str] = {}
        self.procs: dict[str, Any] = {}
        self.inboxes: dict[str, Any] = {}
        self.incarnation: dict[str, int] = {}
        self.last_beat: dict[str, float] = {}
        self.starting: set[str] = set()
        self.ready: dict[str, tuple[int, Any]] = {}
        self.holding: dict[str, int | None] = {}
        #: declared dead since the trainer last took them (``take_lost``), with why.
        self.lost: dict[str, str] = {}
        #: messages dropped as not awaited, by sender (``recv``)
        self.unexpected: dict[str, int] = {}
        #: processes that failed or exited before they were admitted, with why (``_start_failed``)
        self.failed_starts: dict[str, str] = {}
        self._out: Senders | None = None
        self._monitor: threading.Thread | None = None
        self._stopping = threading.Event()
        self._checked = 0.0

    # -- starting --------------------------------------------------------------------------------
    def launch(self, name: str, stage: int, index: int, fresh: bool = True) -> None:
        """Start the stage process ``name`` holding ``stage`` (``index``: its place among the run's,
        which picks its GPU). ``fresh``: its initial weights are the run's (not on a resume)."""
        import roving

        s = self._settings(name, stage, index)
        inc = s.incarnation
        label = f"stage{stage}-{name}" if inc == 0 else f"{name}-restart{inc}"
        proc = roving.Process(target=stage_main, args=(s, self.control.address, self.beats.address),
                              name=label, daemon=True, trusted=False)
        proc.start()
        self._started(name, proc, stage if inc == 0 and fresh else None)

    def _started(self, name: str, proc: Any, holding: int | None) -> None:
        if name in self.procs:
            self.directory.drop(name)  # an earlier incarnation's id speaks for it no more
        self.directory.add(proc.node_id, name)
        self.procs[name] = proc
        self.starting.add(name)
        self.holding[name] = holding

    def _settings(self, name: str, stage: int, index: int) -> StageSettings:
        """What the stage process ``name`` is started with (a new incarnation of the name)."""
        everyone = self.prepared.network.with_nodes(list(self.universe.values()))
        emulate = ({o: everyone.link(name, o) for o in self.universe if o != name}
                   if self.config.emulate_network else None)
        limit = max(1, self.universe[name].in_flight(stage, self.spec, self.config.stages))
        inc = self.incarnation[name] = self.incarnation.get(name, -1) + 1
        return StageSettings(name, stage, self.config.stages, self.prepared.model, self.config.seed, limit,
                          lr=self.config.lr, weight_decay=self.config.weight_decay, device=self.config.device,
                          bf16=self.config.bf16, threads=self.config.threads, index=index, emulate=emulate,
                          incarnation=inc, heartbeat=self.config.heartbeat,
                          aggregation=self.config.aggregation, adversary=self.adversaries.get(name),
                          verify=self.config.mode, receipt_key=node_key(self.run_key, name),
                             coordinator_id=current_session().uid)

    def wait_started(self, alloc: dict[str, int], stages: int, start_wait: float, timeout: float) -> None:
        """Wait for the processes launched (``alloc``: name -> stage) to be ready: all of them, or, after
        ``start_wait`` seconds, enough to hold every one of ``stages``; one that fails or exits first
        is started without (``failed_starts``). NodeFailed when too few are ready within ``timeout``,
        or those that failed leave a stage that no ready process can hold."""
        t0 = time.monotonic()
        while self.starting:
            waited = time.monotonic() - t0
            if waited > start_wait and len({alloc[n] for n in self.ready}) == stages:
                return
            if waited > timeout:
                raise NodeFailed(f"node(s) {', '.join(sorted(self.starting))} not ready within {timeout:g} s")
            try:
                self.recv(m.Ready, timeout=0.5, check=False)
            except NoMessage:
                pass
        if len({alloc[n] for n in self.ready if n in alloc}) < stages and self.failed_starts:
            raise NodeFailed("too few nodes started to hold every stage: "
                             + "; ".join(f"{n}: {why}" for n, why in sorted(self.failed_starts.items())))

    def open(self) -> list[str]:
        """After the start: admit the ready processes (every one gets every inbox) and start watching
        heartbeats. Returns the processes still starting (they join when ready; their initial weights
        will be stale then)."""
        late = sorted(self.starting)
        for name in late:
            self.holding[name] = None
        self._out = Senders(m.COORDINATOR, {}, None)
        for name in sorted(self.ready):
            inc, inbox = self.ready.pop(name)
            self.inboxes[name] = inbox
            self._senders().add(name, inbox)
            self.last_beat[name] = time.monotonic()
        for name in self.inboxes:
            self.put(name, m.Peers(self.inboxes, self._ids()))
        self._peers_delivered(list(self.inboxes))
        self._monitor = threading.Thread(target=self._watch_beats, name="roving-heartbeats", daemon=True)
        self._monitor.start()
        return late

    def stop(self) -> None:
        """Stop the processes in two phases (see ``StageProcess._shut_down``); kills any that do not
        stop. After a start that failed part-way (some never reported ready, so there is no inbox to
        tell them to stop, and none has its peers), the started processes are killed at once."""
        self._stopping.set()
        live = sorted(self.inboxes)
        for name, proc in self.procs.items():  # started processes that were never admitted: kill them
            if (self._out is None or name not in self.inboxes) and proc.is_alive():
                proc.kill()
        if self._out is not None:
            try:
                for name in live:
                    self.put(name, m.Stop(live))
                self._await(m.Stopped, live, 30.0)
                for name in live:  # after everything sent to it, on its sender's one connection
                    self.put(name, m.Release())
                self._await(m.Released, live, 10.0)
                self._out.forget(live)  # each answered, so had everything, and is leaving: exit waits for none
            except Exception as exc:  # a process that failed is killed below
                log.warning("stage processes did not stop cleanly: %s", exc)
        for proc in self.procs.values():
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        # no thread of ours may be inside the transport when the interpreter exits
        if self._out is not None:
            self._out.close()
        if self._monitor is not None:
            self._monitor.join(timeout=2)

    def _await(self, kind: type, names: list[str], timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a ``kind`` message from each of ``names`` (or its end)."""
        waiting = set(names)
        deadline = time.monotonic() + timeout
        while waiting and time.monotonic() < deadline:
            try:
                msg = self.control.get(timeout=0.5)
            except _queue.Empty:
                waiting = {n for n in waiting if self.procs[n].is_alive()}
                continue
            if isinstance(msg, kind):
                waiting.discard(getattr(msg, "sender", ""))

    def _unexpected(self, sender: str | None, why: str) -> None:
        """Note a message dropped as unexpected: logged the first time for each sender, counted always."""
        key = sender or "?"
        self.unexpected[key] = self.unexpected.get(key, 0) + 1
        if self.unexpected[key] == 1:
            log.warning("dropped a message of node %s: %s", key, why)

    def _ids(self) -> dict[str, str]:
        """The node id of each admitted process, by name (what its peers check its messages by)."""
        return {name: self.procs[name].node_id for name in self.inboxes}

    def put(self, name: str, msg: m.Message) -> None:
        """To a process's inbox, from a sender thread per process: one that died never blocks us."""
        self._senders().put(name, msg)

    def _senders(self) -> Senders:
        """The coordinator's senders to the stage processes (made by ``open``)."""
        if self._out is None:
            raise NodeFailed("the roster sends to stage processes only once it is open (Roster.open)")
        return self._out

    def kill(self, names: list[str]) -> None:
        """kill -9 the processes of ``names``."""
        for n in names:
            self.procs[n].kill()

    def exclude(self, caught: dict[str, str]) -> None:
        """Fence off nodes caught computing wrong (``verify``; name -> why): their credentials revoked,
        their processes killed, the others told to forget them, as the dead are (``take_lost`` has
        them), but never restarted, and their names never admitted again (``request_join``)."""
        for name, why in caught.items():
            self.excluded[name] = why
            proc = self.procs.get(name)
            if proc is not None:
                proc.revoke_credentials()
        gone = {n: f"excluded: {why}" for n, why in caught.items() if n in self.inboxes}
        if gone:
            self._drop(gone, restart=False)

    def wait_declared_dead(self, names: list[str], timeout: float) -> None:
        """Wait until none of ``names`` is admitted any more (each declared dead, ``check``); the lost
        are then in ``take_lost``. NodeFailed after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while any(n in self.inboxes for n in names):
            if time.monotonic() > deadline:
                raise NodeFailed(f"{', '.join(names)} not declared dead in {timeout:g} s")
            try:
                self.check(force=True)
            except NodesLost:
                pass
            time.sleep(0.05)  # a death is seen by polling (the exit, the heartbeats): no event to wait on

    # -- failure detection -----------------------------------------------------------------------
    def _watch_beats(self) -> None:
        while not self._stopping.is_set():
            try:
                beat = self.beats.get(timeout=0.5)
            except _queue.Empty:
                continue
            except Exception:  # the queue closes as the coordinator exits
                return
            if isinstance(beat, m.Beat) and self.incarnation.get(beat.sender) == beat.incarnation:
                self.last_beat[beat.sender] = time.monotonic()

    def _dead(self) -> dict[str, str]:
        """Admitted processes that are dead now, with why; forgets started ones whose process exited."""
        now = time.monotonic()
        dead = {}
        for name in self.inboxes:
            proc = self.procs[name]
            quiet = now - self.last_beat.get(name, now)
            if not proc.is_alive():
                dead[name] = f"its process exited with code {proc.exitcode}"
            elif self.config.dead_after > 0 and quiet > self.config.dead_after:
                dead[name] = f"no heartbeat for {quiet:.1f} s"
        for name in sorted(self.starting | set(self.ready)):
            proc = self.procs[name]
            if not proc.is_alive():
                log.warning("node %s exited before it joined (exit code %s)", name, proc.exitcode)
                self._event("join-failed", nodes=[name], why=f"exit code {proc.exitcode}")
                self.starting.discard(name)
                self.ready.pop(name, None)
        return dead

    def check(self, force: bool = False) -> None:
        """Raise NodesLost (after fencing them off) if admitted processes died or were caught sending what
        the wire refuses (``_catch_refused``); at most every 0.1 s."""
        now = time.monotonic()
        if not force and now - self._checked < 0.1:
            return
        self._checked = now
        caught = self._catch_refused()
        if caught:
            raise NodesLost(caught, caught)
        dead = self._dead()
        if dead:
            self._drop(dead)
            raise NodesLost(dead)

    def _catch_refused(self) -> dict[str, str]:
        """Exclude the stage processes that sent what the wire refuses (``mail.Inbox.refused``: a message
        that does not decode or fit its schema, one a node may not send, more than it may leave unread):
        no honest stage process does (letters from ids the run does not know are only logged)."""
        refused = {**self.beats.refused(), **self.control.refused()}
        caught = {name: f"it sent what the pipeline's wire refuses ({count} time(s); first: {why})"
                  for name, (count, why) in refused.items() if name in self.procs and name not in self.excluded}
        if not caught:
            return {}
        admitted = {n: f"excluded: {why}" for n, why in caught.items() if n in self.inboxes}
        for name, why in caught.items():
            log.warning("node %s caught: %s", name, why)
            self._event("caught", node=name, nodes=[name], check="wire", why=why)
            self.starting.discard(name)
            self.ready.pop(name, None)
            proc = self.procs[name]
            if name not in self.inboxes and proc.is_alive():
                proc.kill()
        self.exclude(caught)
        return admitted

    def _drop(self, dead: dict[str, str], restart: bool = True) -> None:
        """Fence dead processes off: kill what is left of them, stop sending to them, tell the others."""
        for name, why in dead.items():
            log.warning("node %s declared dead: %s", name, why)
            proc = self.procs.get(name)
            if proc is not None and proc.is_alive():
                proc.kill()
            self.inboxes.pop(name, None)
            self.last_beat.pop(name, None)
        self._senders().forget(list(dead))
        for name in self.inboxes:
            self.put(name, m.Forget(list(dead)))
        self._event("dead", nodes=sorted(dead), why=dead)
        self.lost.update(dead)
        if self.config.restart and restart:
            for name in dead:
                if not isinstance(self.procs.get(name), RemoteProcess):  # not ours to start again
                    self.request_join(name)

    def take_lost(self) -> dict[str, str]:
        """The processes declared dead since the last call, with why."""
        lost, self.lost = self.lost, {}
        return lost

    def recv(self, kind: type | tuple[type, ...], timeout: float | None = None, rnd: int | None = None,
             names: set[str] | None = None, check: bool = True) -> m.Message:
        """The next message of type ``kind`` (or one of the types) from the stage processes (of round
        ``rnd``, from one of ``names``).
        Raises NodesLost when an admitted process dies, fails or is caught meanwhile (with ``check``),
        NodeFailed when one that was starting raised, NoMessage when nothing came within ``timeout``.
        Other processes' ``Ready`` messages are kept for joining; round messages of other rounds or not
        asked for (left from an aborted round), messages of processes declared dead, and any other
        message not awaited (a late answer; what a node sends that nobody asked: ``unexpected``) are
        dropped: no message of a node ends the run."""
        timeout = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        kinds = kind if isinstance(kind, tuple) else (kind,)
        what = " or ".join(k.__name__ for k in kinds)
        while True:
            if check:
                self.check()
            elif time.monotonic() - self._checked >= 0.1:  # while starting: caught, not yet lost
                self._checked = time.monotonic()
                self._catch_refused()
            try:
                msg = self.control.get(timeout=0.1)
            except _queue.Empty:
                if not check:
                    for name in [n for n in self.starting if not self.procs[n].is_alive()]:
                        self._start_failed(name, f"its process exited with code {self.procs[name].exitcode} "
                                                 f"while the coordinator waited for {what}")
                if time.monotonic() > deadline:
                    raise NoMessage(f"no {what} message from the nodes within {timeout:g} s") from None
                continue
            if isinstance(msg, m.Failed):
                if msg.sender in self.inboxes:  # an admitted node's failure is its own loss, not the run's
                    self._drop({msg.sender: "it failed: " + (msg.traceback.strip().splitlines() or [""])[-1]})
                    raise NodesLost({msg.sender: "it failed"})
                if msg.sender in self.starting or msg.sender in self.ready:
                    self._start_failed(msg.sender, f"it failed:\n{msg.traceback}")
                continue
            if isinstance(msg, m.Ready):
                if self.incarnation.get(msg.sender) == msg.incarnation and msg.sender in self.starting:
                    self.starting.discard(msg.sender)
                    self.ready[msg.sender] = (msg.incarnation, msg.inbox)
                if m.Ready in kinds:
                    return msg
                continue
            if isinstance(msg, m.RoundMessage) and (not isinstance(msg, kinds) or
                                                    (rnd is not None and msg.round != rnd)):
                continue  # left from an aborted round
            sender = getattr(msg, "sender", None)
            if sender is not None and sender not in self.inboxes:
                continue  # from a process declared dead
            if not isinstance(msg, kinds) or (names is not None and sender not in names):
                # not what is awaited (a late answer, or a node that sends what nobody asked): dropped; a
                # node's message never ends the run
                self._unexpected(sender, str(m.unexpected(msg, "the coordinator", what)))
                continue
            return msg

    # -- joining (starting, enrolling, admitting: ``joining.Joining``) ------------------------------
    def _start_failed(self, name: str, why: str) -> None:
        """A process failed or exited before it was admitted: it is no longer waited for (the run starts,
        or goes on, without it: planned around, as a node that is late), and its process is ended."""
        log.warning("node %s failed to start: %s", name, why)
        self._event("join-failed", nodes=[name], why=why.splitlines()[0])
        self.failed_starts[name] = why
        self.starting.discard(name)
        self.ready.pop(name, None)
        proc = self.procs.get(name)
        if proc is not None and proc.is_alive():
            proc.kill()

    def _peers_delivered(self, names: list[str]) -> None:
        """Wait until every process has its peers: a stage process takes a message only from a writer its
        directory knows, so work that reached it before its ``Peers`` (sent by other threads, over other
        connections) would be refused and its round would stall."""
        late = self._senders().delivered(names, self.config.timeout)
        if late:
            log.warning("pipeline: the peers of %s not confirmed delivered within %g s", ", ".join(late),
                        self.config.timeout)
