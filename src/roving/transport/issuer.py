"""Credentials for the children of children: the session CA's service at the root's node.

The root issues its own children's credentials itself (:meth:`.session.Session.child_env`). A child
that starts processes of its own holds no CA: it asks the root's node for each (:func:`ask`), over a
connection authenticated with its own credentials. The CA issues each node id once, and to an asker
whose credentials are not revoked and are not an untrusted process's (:attr:`.identity.Peer.trusted`):
a pipeline node holds its own credentials and nothing that mints others.
"""
from __future__ import annotations

import json
import logging
from typing import Any, List

from . import identity, rpc
from .errors import IdentityError
from .node import Node

log = logging.getLogger(__name__)

OP = b"issue"


class _Issuer(rpc.Server):
    def serve(self, ident: bytes, req_id: int, kind: int, frames: List[Any]) -> None:
        asker = self.node.peer(ident)
        authority = self.node.credentials.authority
        try:
            if asker is None or identity.is_revoked(asker.node_id):
                raise IdentityError("the asker's credentials are not valid (revoked?)")
            if not asker.trusted:
                raise IdentityError(f"{asker.node_id} is an untrusted process: it can have no credentials issued")
            if authority is None:
                raise IdentityError("this node holds no CA")
            uid = bytes(frames[0]).decode()
            grant = authority.issue(uid)
        except (IdentityError, UnicodeDecodeError, IndexError) as exc:
            self.answer(ident, req_id, rpc.ERR, [str(exc).encode()])
            return
        log.debug("roving: issued credentials for %s, asked by %s", uid, asker.node_id)
        self.answer(ident, req_id, rpc.OK, [json.dumps({"seed": grant.seed.hex(), **grant.public()}).encode()])


def serve(node: Node) -> None:
    """Serve the session CA of this process (the root) at ``node``."""
    node.service("issuer", lambda n: _Issuer(n, OP))


def ask(ca_address: str, creds: identity.Credentials, uid: str, timeout: float) -> identity.Grant:
    """Credentials for the new process ``uid``, from the CA at ``ca_address``; IdentityError when it
    refuses, rpc.ServerGone (a ConnectionError) when it cannot be reached within ``timeout``."""
    caller = rpc.Caller(ca_address, creds, OP, "the session's certificate authority", connect_timeout=timeout)
    try:
        answer = caller.collect(caller.submit([uid.encode()]), timeout)
    finally:
        caller.close()
    if answer is None:
        raise IdentityError(f"the session's CA at {ca_address} did not answer within {timeout:g} s")
    status, frames = answer
    if status != rpc.OK:
        raise IdentityError(f"the session's CA refused credentials for {uid}: "
                                     f"{bytes(frames[0]).decode(errors='replace') if frames else 'no reason'}")
    told = json.loads(bytes(frames[0]))
    return identity.Grant(uid, bytes.fromhex(told["seed"]), told["cert"], told["ca"])
