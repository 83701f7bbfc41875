"""Untrusted processes (``roving.Process(trusted=False)``: a pipeline node that may run code of its own):
what the transport lets them do, and what it refuses, tried from real child processes.

A node serves an untrusted peer only the mailboxes made for it (its start-up payload) and postboxes,
whose items are raw frames stamped with the writer its connection authenticated; every other mailbox,
every service of a node, and any credentials from the session's CA are refused to it.
"""
from __future__ import annotations

import json
import queue

import pytest

import roving
from helpers_core import TIMEOUT
import helpers_untrusted as hu
from roving.transport import identity, mailbox, postbox, session
from roving.transport import node as _node


def _letter(box: postbox.Postbox) -> tuple[str, dict]:
    letter = box.get(TIMEOUT)
    return letter.writer, json.loads(bytes(letter.frames[0]))


def _start(target, *args) -> roving.Process:
    p = roving.Process(target=target, args=args, trusted=False, daemon=True)
    p.start()
    return p


def test_an_untrusted_child_starts_and_its_letters_carry_the_identity_its_connection_proved():
    box = postbox.Postbox()
    p = _start(hu.claim_to_be, box.address, "coordinator")
    writer, said = _letter(box)
    p.join(TIMEOUT)
    assert p.exitcode == 0
    assert said == {"writer": "coordinator"}  # what it wrote
    assert writer == p._uid and writer != session.current().uid  # who it is


def test_an_untrusted_child_may_not_use_a_shared_queue_another_childs_box_or_the_ca():
    box = postbox.Postbox()
    shared = roving.Queue()
    node = session.current().node()
    other = node.mailboxes.new_box(access=mailbox.Access(owner="some-other-child"))
    node.mailboxes.call_local(_node.PUT, other, 0, [b"another child's start payload"])
    p = _start(hu.probe_what_it_may_use, box.address, shared, other)
    writer, said = _letter(box)
    p.join(TIMEOUT)
    assert said["me"] == writer
    assert said["get"].startswith("refused")
    assert said["stolen"] == "refused"
    assert said["issued"].startswith("refused") and "untrusted" in said["issued"]  # by its own session
    assert said["asked"].startswith("refused")  # and by the CA's node, asked directly
    session.current().credentials.authority.issue(writer + "-spare")  # so that id was never issued
    with pytest.raises(queue.Empty):  # its put was dropped
        shared.get(timeout=0.2)
    assert node.mailboxes.items_in(other) == 1  # the payload is still there for its owner


def test_what_one_untrusted_writer_may_leave_unread_is_bounded_and_its_excess_counted():
    box = postbox.Postbox(untrusted_bytes=10_000)
    p = _start(hu.flood, box.address, 50, 1000)
    p.join(TIMEOUT)  # it confirmed that every item arrived before it said so and ended
    assert p.exitcode == 0
    letters = []
    while True:
        try:
            letters.append(box.get(0))
        except queue.Empty:
            break
    assert [len(x.frames[0]) for x in letters] == [1000] * 10  # 10 fit; the other 40 were refused,
    assert box.overflowed() == {p._uid: 41}  # and so was its last letter, while the 10 waited unread
    assert box.overflowed() == {}  # taken


def test_a_certificate_issued_untrusted_is_seen_untrusted_and_a_trusted_one_trusted():
    authority = identity.Authority(b"s" * 32)
    root = identity.Credentials(b"m" * 32, authority.issue("root"), authority)
    node = authority.issue("node-1", trusted=False)
    member = authority.issue("member-1")
    assert root.check_certificate(identity.Credentials(b"m" * 32, node).cert_der).trusted is False
    assert root.check_certificate(identity.Credentials(b"m" * 32, member).cert_der).trusted is True
    assert identity.Credentials(b"m" * 32, node).trusted is False
