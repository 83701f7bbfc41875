"""Processes that hold no secret of the session (``identity.Credentials.certificate_only``: what a pipeline
node that joined through the open door holds): their own keys and an untrusted certificate. They reach
what an untrusted member reaches, on the certificate alone, once a node is told their key; nothing
before, and nothing after their credentials are revoked. Real ZeroMQ connections under CURVE, in this
process (which is the session's root, so it holds the CA).
"""
from __future__ import annotations

import os
import queue

import pytest

from helpers_core import TIMEOUT
from roving.transport import crypto, identity, mailbox, postbox, session, zap
from roving.transport import node as _node
from roving.transport.endpoint import Endpoint
from roving.transport.errors import AuthenticationError, IdentityError, TransportError


def _certificate_only(trusted: bool = False) -> identity.Credentials:
    """Credentials for a new process that is given only a certificate and the session's public client key."""
    here = session.current().credentials
    assert here.authority is not None
    grant = here.authority.issue("cert-only-" + os.urandom(4).hex(), trusted=trusted)
    return identity.Credentials.certificate_only(grant, crypto.session_client_key(here))


def test_credentials_without_the_member_secret_must_carry_an_untrusted_certificate():
    with pytest.raises(IdentityError, match="untrusted"):
        _certificate_only(trusted=True)
    creds = _certificate_only()
    here = session.current().credentials
    assert not creds.member and not creds.trusted
    assert creds.secret != here.secret  # it holds random bytes of its own, which prove nothing


def test_a_certificate_only_process_reaches_a_postbox_once_its_key_is_admitted_and_only_as_itself():
    box = postbox.Postbox()
    creds = _certificate_only()
    # not yet told of its key: ZeroMQ's handshake ends before anything it sends is read
    with pytest.raises(AuthenticationError, match=box.address.node.split("#")[0]):
        Endpoint(box.address.node, creds, None, connect_timeout=3).call(_node.SIZE, box.address.box, 3)
    zap.admit(creds.key, creds.node_id)
    writer = Endpoint(box.address.node, creds, None, connect_timeout=TIMEOUT)
    writer.tell(_node.PUT_NOREPLY, box.address.box, [b"from a node with a certificate only"])
    letter = box.get(TIMEOUT)
    assert letter.writer == creds.node_id
    assert [bytes(f) for f in letter.frames] == [b"from a node with a certificate only"]
    # what an untrusted process may not do, it may not do: read the box, or use a member's mailbox
    status, _ = writer.call(_node.GET, box.address.box, 0)
    assert status != _node.OK
    here = session.current().node()
    shared = here.mailboxes.new_box()
    here.mailboxes.call_local(_node.PUT, shared, 0, [b"a member's item"])
    status, _ = writer.call(_node.GET, shared, 0)
    assert status != _node.OK and here.mailboxes.items_in(shared) == 1


def test_revoked_certificate_only_credentials_are_refused_and_their_key_withdrawn():
    box = postbox.Postbox()
    creds = _certificate_only()
    zap.admit(creds.key, creds.node_id)
    Endpoint(box.address.node, creds, None, connect_timeout=TIMEOUT).tell(_node.PUT_NOREPLY, box.address.box,
                                                                           [b"before"])
    assert box.get(TIMEOUT).writer == creds.node_id
    identity.revoke(creds.node_id)
    with pytest.raises(TransportError):
        Endpoint(box.address.node, creds, None, connect_timeout=3).call(_node.SIZE, box.address.box, 3)
    with pytest.raises(queue.Empty):
        box.get(0.2)


def test_the_node_of_a_certificate_only_process_takes_a_members_letters():
    """A node that joined through the door serves its inbox: the coordinator and the started nodes (members,
    under the session's client key) reach it, and what they write comes stamped with who they are."""
    creds = _certificate_only()
    served = _node.Node(creds)
    try:
        box = served.mailboxes.new_box(access=mailbox.Access(untrusted=True, stamp=True))
        member = Endpoint(served.address, session.current().credentials, None, connect_timeout=TIMEOUT)
        status, _ = member.call(_node.PUT, box, TIMEOUT, [b"from the coordinator"])
        assert status == _node.OK
        status, frames = served.mailboxes.call_local(_node.GET, box, TIMEOUT)
        assert status == _node.OK
        assert bytes(frames[0]).decode() == session.current().uid
        assert bytes(frames[1]) == b"from the coordinator"
    finally:
        served.close()
