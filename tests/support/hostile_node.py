"""A pipeline node that attacks: code the coordinator does not control, joining through the open door.

    python hostile_node.py HOST:PORT TOKEN MARKER_PATH

It joins as an honest node would (its own keys, the invitation), reports ready and beats, and once the
coordinator has told it its peers it tries what the trust boundary says a node cannot do, then prints
``RESULT <json>``: what each attempt came to, as this node saw it. The test checks the other side: the
marker file never written, no honest node blamed, this node caught, the training finished.
"""
from __future__ import annotations

import json
import os
import pickle
import socket
import queue
import sys
import threading
import time

import torch

from roving.pipeline.runtime import codec

from roving.pipeline.runtime import door

from roving.pipeline.runtime import mail
from roving.pipeline import protocol as m
from roving.pipeline.planning.plan import Route
from roving.pipeline.verify.receipts import Receipt
from roving.pipeline.verify.tensor_id import TensorId
from roving.transport import issuer, postbox, session
from roving.transport import node as _node


class Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def outcome(fn) -> str:
    try:
        fn()
    except Exception as exc:  # what it raised is the finding
        return f"refused: {type(exc).__name__}: {str(exc)[:200]}"
    return "done"


def main(address: str, token: str, marker: str) -> None:
    seed = os.urandom(32)
    placement = door.join(address, token, seed)
    here = session.enter(door.credentials_of(placement, seed), towards=placement.control.node)
    control, beats = postbox.Slot(placement.control), postbox.Slot(placement.beats)
    inbox = mail.Inbox(mail.Directory({placement.settings.coordinator_id: m.COORDINATOR}))
    name = placement.name
    control.send(codec.encode(m.Ready(name, placement.settings.incarnation, inbox.address)))
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            beats.send(codec.encode(m.Beat(name, placement.settings.incarnation)))
            stop.wait(0.3)

    threading.Thread(target=beat, daemon=True).start()
    peers = None
    deadline = time.monotonic() + 120
    while peers is None and time.monotonic() < deadline:
        try:
            msg = inbox.get(timeout=1)
        except queue.Empty:
            continue
        if isinstance(msg, m.Peers):
            peers = msg
    result: dict = {"name": name, "admitted": peers is not None}
    if peers is None:
        print("RESULT " + json.dumps(result), flush=True)
        return
    evil = pickle.dumps(Marker(marker), protocol=5)
    others = {n: postbox.Slot(a) for n, a in peers.inboxes.items() if n != name}
    # coordinator-only messages to every peer, and a pickle
    for slot in others.values():
        for msg in (m.Load(1, 1, {}, None), m.Stop(None), m.Abort(10 ** 6), m.Throttle(50.0),
                    m.Recheck(0, 1, 0, "forward", {}, None), m.Forget(sorted(others)), m.Release()):
            slot.send(codec.encode(msg))
        slot.send([evil])
    # a stolen start payload: every mailbox id the coordinator's node may have made
    endpoint = here.endpoint(placement.control.node)
    stolen = []
    for box in range(1, 64):
        if box in (placement.control.box, placement.beats.box):
            continue
        status, frames = endpoint.call(_node.GET, box, 0)
        if status == _node.OK:
            stolen.append(box)
    result["stolen"] = stolen
    # spare credentials
    result["issued"] = outcome(lambda: here.issue(name + "-spare"))
    result["asked"] = outcome(lambda: issuer.ask(placement.control.node, here.credentials, name + "-spare", 2))
    print("RESULT " + json.dumps(result), flush=True)  # what it found; the rest may be cut short
    # answers nobody asked for, and announcements out of turn: dropped, never the run's end
    for msg in (m.Rechecked(0, name, 12345, 0.0), m.EvidenceItems(0, name, {}, 777), m.WeightsShown(0, name, 0, {}),
                m.Loaded(name, 1), m.Stopped(name), m.Released(name), m.Exported(name, 0, {}, {}),
                m.Ready(name, 5, inbox.address), m.Done(10 ** 6, name, 0, 1.0)):
        control.send(codec.encode(msg))
    # a receipt in another node's name, and messages that do not fit the wire, to the coordinator
    other = next(iter(others))
    receipt = Receipt(TensorId(0, "activation", 0, 0, other), b"d" * 32, b"m" * 32)
    forged = json.loads(codec.encode(m.Done(0, name, 0, 1.0), json_only=True)[0])
    forged.append(other)  # a sender of its choosing: one field more than the message has
    for frames in ([evil], [json.dumps(forged).encode()], codec.encode(m.Norm(0, name, 0, -1.0)),
                   codec.encode(m.Forward(0, name, 0, 0, torch.ones(2), Route(name, (), ()), receipt)),
                   codec.encode(m.Failed(name, "a failure that ends nothing"))):
        control.send(frames)
    # a flood, until it is cut off (caught for the letters above, its connections closed)
    try:
        for _ in range(2000):
            control.send([b"x" * 65536])
        result["flood"] = "sent"
    except OSError as exc:
        result["flood"] = f"cut off: {type(exc).__name__}"
    print("RESULT " + json.dumps(result), flush=True)
    # wait to be fenced off: the coordinator revokes its credentials and stops answering it
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if not endpoint.ping(2):
                break
        except OSError:
            break
        time.sleep(0.2)  # its exclusion shows only as silence: there is no message to wait for
    stop.set()


if __name__ == "__main__":
    main(*sys.argv[1:4])


#: The node that ``started_main`` makes hostile; every other runs roving's own stage process.
HOSTILE = "n01"


def started_main(settings, control, beats=None) -> None:
    """A stage process's target whose node ``HOSTILE`` runs code of its own (a started node whose machine
    is not the coordinator's to trust): it tries to take the other nodes' start payloads from the
    coordinator as they start, and sends what the wire refuses; the result is left in the file named by
    HOSTILE_NODE_RESULT."""
    from roving.pipeline.runtime.stage_process import stage_main

    if settings.name != HOSTILE:
        return stage_main(settings, control, beats)
    here = session.current()
    endpoint = here.endpoint(control.node)
    stolen = []
    open(os.environ["HOSTILE_NODE_RESULT"] + ".attacking", "w").close()  # the test starts the others now
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:  # the siblings' payloads wait at the coordinator while they start
        for box in range(1, 200):
            if box in (control.box, getattr(beats, "box", -1)):
                continue
            status, frames = endpoint.call(_node.GET, box, 0)
            if status == _node.OK:
                stolen.append(bytes(frames[0])[:1].decode("latin-1") if frames else "")
    issued = outcome(lambda: here.issue(settings.name + "-spare"))
    with open(os.environ["HOSTILE_NODE_RESULT"], "w") as f:
        json.dump({"stolen": stolen, "issued": issued, "host": socket.gethostname()}, f)
    slot = postbox.Slot(control)
    slot.send([pickle.dumps(Marker(os.environ["HOSTILE_NODE_RESULT"] + ".marker"), protocol=5)])
    slot.send(codec.encode(m.Norm(0, settings.name, 0, -1.0)))
    slot.confirm(10)


#: The node that keeps what it should pass on (``withholding_main``).
WITHHOLDER = "n01"


def withholding_main(settings, control, beats=None) -> None:
    """A stage process's target whose node ``WITHHOLDER`` keeps, from round 1 on, every microbatch's
    activations it should send to another process, and says in its account of a stalled round that it
    sent them (the lie that leaves its word against its peer's); every other node is honest."""
    from roving.pipeline.runtime import stage_process
    from roving.pipeline.runtime.stalls import FORWARD, Key

    if settings.name == WITHHOLDER:
        class Withholding(stage_process.StageProcess):
            def _forward_on(self, rnd, mb, hop, h, route, given=None):
                if rnd >= 1 and route.nodes:
                    self.sent.add(Key(FORWARD, mb, hop))
                    return
                super()._forward_on(rnd, mb, hop, h, route, given)

        stage_process.StageProcess = Withholding
    return stage_process.stage_main(settings, control, beats)
