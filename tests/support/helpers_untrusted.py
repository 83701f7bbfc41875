"""Targets of the tests of untrusted processes (tests/transport/test_untrusted.py): each runs in a child
started with ``trusted=False`` and tells what it could and could not do as JSON letters to a postbox."""
from __future__ import annotations

import json
import queue

import roving
from roving.transport import node as _node
from roving.transport import issuer, postbox, session


def _tell(slot: postbox.Slot, **what) -> None:
    slot.send([json.dumps(what).encode()])


def _outcome(fn) -> str:
    try:
        fn()
    except queue.Empty:
        return "empty"
    except Exception as exc:  # what it raised is the finding
        return f"refused: {type(exc).__name__}: {exc}"
    return "done"


def probe_what_it_may_use(address: postbox.PostboxAddress, shared: roving.Queue, other_box: int) -> None:
    """Try the parent's shared queue (put and get), a box made for another child, an issue of
    credentials; report each outcome, then say it is done (after the put, on the same connection)."""
    slot = postbox.Slot(address)
    me = session.current().uid
    shared.put("from an untrusted child")  # dropped by the parent's node: no answer is asked
    got = _outcome(lambda: shared.get(timeout=2))
    endpoint = session.current().endpoint(address.node)
    status, frames = endpoint.call(_node.GET, other_box, 1)
    stolen = "refused" if status == _node.ERROR else f"status {status}"
    here = session.current()
    issued = _outcome(lambda: here.issue(me + "-spare"))
    asked = _outcome(lambda: issuer.ask(here.ca_address, here.credentials, me + "-spare", 2))
    _tell(slot, me=me, get=got, stolen=stolen, issued=issued, asked=asked)


def flood(address: postbox.PostboxAddress, items: int, size: int) -> None:
    """Send ``items`` items of ``size`` bytes, then confirm they all arrived (refused or kept)."""
    slot = postbox.Slot(address)
    for _ in range(items):
        slot.send([b"x" * size])
    slot.confirm(30)
    _tell(slot, flooded=items)


def claim_to_be(address: postbox.PostboxAddress, name: str) -> None:
    """Send a letter whose content names another process as its writer."""
    _tell(postbox.Slot(address), writer=name)


def send_letters(address: postbox.PostboxAddress, letters: list) -> None:
    """Send each of ``letters`` (a list of frames) as it is, then confirm they arrived."""
    slot = postbox.Slot(address)
    for frames in letters:
        slot.send(frames)
    slot.confirm(30)
