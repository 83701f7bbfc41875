"""Direct streams for pipe ends: when the two ends of a pipe are used by two processes, they talk over a
stream of their own (:mod:`roving.transport.stream`) instead of through the pipe's mailboxes.

The mailboxes at the pipe's owner stay the authority; a stream is an optimisation that comes and goes:

* **Claims.** The first time a process uses an end, it claims it at the owner (the CLAIM
  operation, :class:`.boxes.Boxes`).
  When the other end is claimed by another process, the owner names it and the claimant opens a stream
  to it. An end that two processes use at once is never linked: both keep to the mailbox.
* **Switching over.** Each direction moves to the stream on its writer's first send after the stream
  opened: the writer puts a *switch item* carrying the stream's token into the mailbox, then writes to
  the stream. The reader reads the mailbox until that item, then the stream. So every message is read
  in the order it was sent, whichever way it went.
* **Switching back.** A writer that stops using the stream (its end is pickled to another process,
  closed, or its process exits) writes a *back* message on the stream, then writes to the mailbox; the
  reader goes back to the mailbox when it reads it. A reader that stops closes a *gate* in its mailbox
  at the place of the stream's messages (:meth:`Mailbox.close_gate`), asks the writer's process to
  switch back (a message to its node, answered by its I/O thread even while the program is busy),
  moves what the stream still carries in front of the gate, and opens it. Readers elsewhere wait at
  the gate meanwhile, so nothing is read out of order, and nothing is lost unless a process dies.
* A stream that breaks (its peer died) ends both directions: what the peer had sent and nobody read is
  lost with it, as with a process that dies holding items; writers go back to the mailbox.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple, cast

from . import identity
from . import session as _session
from . import stream as _stream
from .endpoint import Endpoint
from .mailbox import OK, SWITCH
from .node import Node
from .wire import CLAIM, GATE, INSERT, PUT, PUT_FRONT, UNCLAIM, UNGATE

log = logging.getLogger(__name__)

DATA, RAW, BACK = b"D", b"R", b"B"
#: First frame of a mailbox item sent with send_bytes (its second frame is the data).
RAW_MARK = b"\x00roving-raw"
BOX, OPEN, DONE = 0, 1, 2  # a direction: still on the mailbox / on the stream / off the stream for good

_UNLINK = b"unlink"
_LOCK_WAIT = 5.0  # seconds to wait for a stream another thread of this process is using
_ends: "weakref.WeakValueDictionary[Tuple[str, int, int], End]" = weakref.WeakValueDictionary()
_links: Dict[str, "Link"] = {}
_relays: List[threading.Thread] = []
_lock = threading.Lock()

#: Set to False to keep every pipe on its mailboxes (benchmarks compare both ways).
enabled = True


def as_item(kind: bytes, frames: List[Any]) -> List[Any]:
    """The mailbox item for a stream message."""
    return [RAW_MARK, *frames] if kind == RAW else frames


def is_switch(frames: List[Any]) -> bool:
    return len(frames) == 2 and len(frames[0]) == len(SWITCH) and bytes(frames[0]) == SWITCH


class End:
    """A pipe end as its stream sees it: the interface between a :class:`roving.connection.Connection`,
    which holds one, and its :class:`Link`.

    ``owner`` is the node address of the pipe's mailboxes, reached through ``endpoint``; ``inbox`` and
    ``outbox`` are the mailboxes this end reads and writes (0: none). :attr:`lock` guards the rest:
    :attr:`link`, the stream this end uses now (None: the mailboxes), :attr:`claim` (None: not used in
    this process yet; "claimed"; "shared": claimed, but another process writes to it too, so never on a
    stream; "given": it went away) and :attr:`closed`.
    """

    def __init__(self, owner: str, endpoint: Endpoint, inbox: Optional[int], outbox: Optional[int]) -> None:
        self.owner, self.endpoint = owner, endpoint
        self.inbox, self.outbox = inbox or 0, outbox or 0
        self.lock = threading.RLock()
        self.link: Optional[Link] = None
        self.claim: Optional[str] = None
        self.closed = False

    @property
    def readable(self) -> bool:
        return bool(self.inbox)

    @property
    def writable(self) -> bool:
        return bool(self.outbox)

    @property
    def key(self) -> Tuple[str, int, int]:
        """Which end of which pipe: (owner, inbox, outbox), the same in every process."""
        return self.owner, self.inbox, self.outbox

    def attach(self, link: "Link") -> bool:
        """Install ``link`` (lock held by the caller, or taken here) unless the end was closed, has a
        stream already, or may not be linked; whether it was installed."""
        with self.lock:
            if self.closed or self.link is not None or self.claim != "claimed":
                return False
            self.link = link
            return True

    def detach(self, link: "Link") -> None:
        """Forget ``link`` if it is this end's stream."""
        with self.lock:
            if self.link is link:
                self.link = None


class Link:
    """The open stream of one pipe end in this process, and where each of its directions stands."""

    def __init__(self, stream: _stream.Stream, token: str, peer_node: str, end: End) -> None:
        self.stream, self.token, self.peer_node, self.end = stream, token, peer_node, end
        self.out = BOX if end.writable else DONE  # BOX: the switch item is not put yet
        self.in_ = BOX if end.readable else DONE
        self.relayed = False

    # -- the end's own threads ---------------------------------------------------------------
    def write(self, kind: bytes, frames: List[Any]) -> bool:
        """Send one message over the stream; False when it must go to the mailbox instead."""
        with self.stream.write_lock:
            if self.out == BOX:
                # Confirmed, not told: once a writer of another process is told this end stopped
                # writing here (revoke), the switch item is surely in the mailbox before its messages.
                self.end.endpoint.call(PUT, self.end.outbox, 0, [SWITCH, self.token.encode()])
                self.out = OPEN
            if self.out != OPEN:
                return False
            try:
                self.stream.send(kind, frames)
                return True
            except OSError as exc:
                log.debug("roving pipe stream %s broke while sending: %s", self.token, exc)
                self.out = DONE
        self._maybe_finish()
        return False

    def switch_in(self, frames: List[Any]) -> bool:
        """A switch item was read from the mailbox: True if it was this stream's (read it from now)."""
        if self.in_ == BOX and bytes(frames[1]).decode() == self.token:
            self.in_ = OPEN
            return True
        return False

    def read(self, timeout: Optional[float]) -> Optional[Tuple[bytes, List[Any]]]:
        """The next message on the stream within ``timeout`` s (None: wait), or None when none came.

        (BACK, []) means this direction is off the stream now: read the mailbox.
        """
        with self.stream.read_lock:
            if self.in_ != OPEN:
                return BACK, []
            if timeout is not None and not self.stream.readable(timeout):
                return None
            try:
                kind, frames = self.stream.recv()
            except EOFError as exc:
                log.debug("roving pipe stream %s ended: %s", self.token, exc)
                kind, frames = BACK, []
                self.out = DONE  # a broken stream cannot be written either
            if kind == BACK:
                self.in_ = DONE
        if kind == BACK:
            self._maybe_finish()
        return kind, frames

    def _maybe_finish(self) -> None:
        if self.in_ == DONE and self.out == DONE and not self.relayed:
            self._forget()
            self.stream.close()

    def _forget(self) -> None:
        with _lock:
            _links.pop(self.token, None)
        self.end.detach(self)

    # -- the peer asked this end to stop writing (its node's handler) -------------------------
    def stop_writing(self) -> None:
        if not self.stream.write_lock.acquire(timeout=_LOCK_WAIT):
            # Another thread is stuck sending (its peer does not read): the peer sees the stream end
            # instead of a back message when it closes.
            log.warning("roving pipe stream %s: a send did not finish; closing the stream", self.token)
            self.out = DONE
        else:
            try:
                if self.out != DONE:
                    try:
                        self.stream.send(BACK, [])
                    except OSError:
                        pass
                    self.out = DONE
            finally:
                self.stream.write_lock.release()
        self._maybe_finish()

    # -- this end leaves the stream ----------------------------------------------------------
    def unlink(self, stash: List[Tuple[bytes, List[Any]]]) -> None:
        """Take this end off the stream (its end is being pickled away, closed, or its process ends).

        ``stash`` holds messages already read here and not yet returned: they go back first. Returns
        once the mailbox is in a state that any process can read in order; what the stream still
        carries is moved by a thread of its own (:func:`wait_relays` at exit).
        """
        end = self.end
        self._forget()
        self.stop_writing()  # out = DONE, and the reader knows
        if self.stream.read_lock.acquire(timeout=_LOCK_WAIT):
            reading = self.in_
            self.in_ = DONE
            self.stream.read_lock.release()
        else:  # another thread of this process is blocked reading this end: it will see the end
            log.warning("roving pipe stream %s: left while another thread was reading it; what the "
                        "stream still carried is lost", self.token)
            reading = self.in_ = DONE
        token = self.token.encode()
        relay = reading != DONE
        if relay:
            self.relayed = True
            uid = _session.current().uid
            end.endpoint.call(GATE, end.inbox, 0, [token, uid.encode(), b"1" if reading == OPEN else b"0"])
        for kind, frames in reversed(stash):
            end.endpoint.tell(PUT_FRONT, end.inbox, as_item(kind, frames))
        if stash:
            end.endpoint.ping(30.0)
        if not relay:
            self.stream.close()
            return
        thread = threading.Thread(target=self._relay, name="roving-pipe-relay", daemon=True)
        with _lock:
            _relays[:] = [t for t in _relays if t.is_alive()]
            _relays.append(thread)
        thread.start()

    def _relay(self) -> None:
        end, token = self.end, self.token.encode()
        try:
            _session.current().endpoint(self.peer_node).tell(_UNLINK, 0, [token])
        except Exception as exc:  # its process has gone: the stream ends by itself
            log.debug("roving pipe stream %s: could not reach the peer's node: %s", self.token, exc)
        moved = 0
        try:
            while True:
                try:
                    kind, frames = self.stream.recv()
                except EOFError:
                    break
                if kind == BACK:
                    break
                end.endpoint.tell(INSERT, end.inbox, [token, *as_item(kind, frames)])
                moved += 1
            end.endpoint.tell(UNGATE, end.inbox, [token])
            end.endpoint.ping(30.0)
        except Exception:
            log.exception("roving pipe stream %s: moving %d message(s) back to the pipe failed",
                          self.token, moved)
        finally:
            self.stream.close()


# -- this process's side -----------------------------------------------------------------------

def _listener() -> _stream.Listener:
    node = _session.current().node()

    def setup(node: Node) -> bool:
        node.register_handler(_UNLINK, _on_unlink)
        node.register_notice(_UNLINK, lambda payload: _on_unlink(b"", payload))
        node.register_stream_purpose("pipe", _on_open)
        return True

    node.service("pipe-streams", setup)
    return node.streams()


class _Revocations:
    """Closes this process's pipe streams with a process whose credentials are revoked (identity.revoke):
    the ends go on over their mailboxes, as when the peer's process ends."""

    def revoked(self, node_id: str) -> None:
        with _lock:
            doomed = [link for link in _links.values()
                      if link.stream.peer is not None and link.stream.peer.node_id == node_id]
        for link in doomed:
            link.stream.close()


_revocations = _Revocations()
identity.on_revoke(_revocations)


def claim(end: End) -> Optional[str]:
    """Claim ``end`` for this process at the pipe's owner; open a stream when its peer is claimed.

    Returns the node address of another process that holds the claim (the end is used by two
    processes: this one must keep to the mailbox, and that one must first stop writing to its stream,
    see :func:`revoke`), else None."""
    if not enabled:
        return None
    session = _session.current()
    listener = _listener()
    _ends[end.key] = end
    request = {"end": [end.inbox, end.outbox], "uid": session.uid,
               "stream": listener.address, "node": session.node().address}
    status, frames = end.endpoint.call(CLAIM, end.inbox or end.outbox, 0, [json.dumps(request).encode()])
    if status != OK:
        return None
    answer = json.loads(bytes(frames[0]))
    if answer.get("answer") == "no":
        return answer.get("holder") or None
    if answer.get("answer") != "go":
        return None
    token = _stream.new_token()
    opening = {"purpose": "pipe", "token": token, "owner": end.owner, "end": [end.outbox, end.inbox],
               "node": session.node().address}
    try:
        stream = _stream.connect(answer["stream"], session.credentials, opening, timeout=10.0,
                                 expect=identity.node_key(str(answer.get("node", ""))))
    except (OSError, ConnectionError) as exc:
        log.debug("roving: pipe end stays on its mailbox: %s", exc)
        return None
    link = Link(stream, token, answer["node"], end)
    if not end.attach(link):
        stream.close()
        return None
    with _lock:
        _links[token] = link
    return None


def revoke(owner: str, inbox: int, outbox: int) -> None:
    """Another process writes to the end (``owner``, ``inbox``, ``outbox``) that this process claimed:
    this process stops writing to its stream (a back message, then the mailbox) and never links it
    again, so that both write to the one mailbox and their messages keep their order there. Returns
    once the back message is sent (up to 5 s if another thread is sending)."""
    end = _ends.get((owner, inbox, outbox))
    if end is None:
        return
    with end.lock:
        if end.claim == "claimed":
            end.claim = "shared"  # claim() installs no stream for it from now on
        link = end.link
    if link is not None:
        link.stop_writing()


def unclaim(end: End) -> None:
    session = _session.current()
    request = {"end": [end.inbox, end.outbox], "uid": session.uid}
    end.endpoint.call(UNCLAIM, end.inbox or end.outbox, 0, [json.dumps(request).encode()])


def _on_open(request: dict, stream: _stream.Stream) -> bool:
    """Another process opens a stream to an end claimed here."""
    key = cast(Tuple[str, int, int], (str(request.get("owner")), *(int(x) for x in request.get("end", (0, 0)))))
    end = _ends.get(key)
    if end is None:
        return False
    if stream.peer is not None and identity.node_key(str(request.get("node"))) != stream.peer.key:
        log.warning("roving: refused a pipe stream from %s, which named another process's node",
                    stream.peer.node_id)
        return False
    link = Link(stream, str(request["token"]), str(request["node"]), end)
    with end.lock:
        # Installed before the opener hears yes (the switch item it then puts must find it), and its
        # writes wait until the yes is out (the opener reads it first).
        with stream.write_lock:
            if not end.attach(link):
                return False
            with _lock:
                _links[link.token] = link
            try:
                _stream.accept(stream)
            except OSError:
                end.link = None
                with _lock:
                    _links.pop(link.token, None)
                return False
    return True


def _on_unlink(ident: bytes, frames: List[Any]) -> None:
    """The peer stops reading its stream: stop writing to it (on a thread: this is the I/O thread)."""
    token = bytes(frames[-1]).decode()
    with _lock:
        link = _links.get(token)
    if link is not None:
        threading.Thread(target=link.stop_writing, name="roving-pipe-unlink", daemon=True).start()


def wait_relays(timeout: float) -> bool:
    """Wait until the messages of streams this process left are back in their mailboxes."""
    deadline = time.monotonic() + timeout
    with _lock:
        threads = list(_relays)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = [t for t in threads if t.is_alive()]
    if alive:
        log.warning("roving: %d pipe stream(s) still moving messages back at exit; they may be lost",
                    len(alive))
    return not alive
