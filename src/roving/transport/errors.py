"""Every error the transport raises, in one module with one base: ``TransportError``.

``except TransportError`` catches whatever the transport raises and nothing else. Each class is also of
the built-in kind that code written for ``multiprocessing`` already catches, so moving such code onto
roving changes none of its ``except`` clauses (``io.UnsupportedOperation`` is both an ``OSError`` and a
``ValueError`` the same way):

* **Cannot reach a peer** (``NodeError``, ``ConnectionLost``, ``AddressError``): ``OSError``, as a refused
  ``connect`` is. ``StreamError`` and ``ServerGone`` are ``ConnectionError``.
* **A peer that does not prove who it is** (``AuthenticationError``, ``IdentityError``): both
  ``multiprocessing.AuthenticationError`` (so ``roving.AuthenticationError``) and ``ConnectionError``.
* **Bad data, not a bad connection** (``SerializationError``, a ``TypeError``; ``MalformedMessage``, a
  ``ValueError``): *not* ``OSError``, so the ``except OSError`` that retries or reconnects on a broken
  connection never takes an object that cannot be pickled or a message that breaks the wire format for
  a network failure.

Each class is importable from the module that raises it too (``roving.transport.auth.AuthenticationError``,
``roving.transport.wire.MalformedMessage``), as before this module existed.
"""
from __future__ import annotations

import multiprocessing

from ..errors import RovingError

__all__ = ["TransportError", "NodeError", "ConnectionLost", "AddressError", "StreamError", "PeerLeftError",
           "ServerGone", "AuthenticationError", "IdentityError", "SerializationError", "MalformedMessage"]


class TransportError(RovingError):
    """The base of every error the transport raises; each is also of a built-in kind (see the module)."""


class NodeError(TransportError, OSError):
    """A roving node could not be reached, did not answer within the time given, or answered with an
    error; the message names its address."""


class ConnectionLost(NodeError):
    """The connection to a node broke while the node may still be there (a network drop): an answer
    awaited on it will not come, and what was sent without an answer may not have arrived. The next
    call over the same ``Endpoint`` opens a new authenticated connection."""


class AddressError(TransportError, OSError):
    """No address could be chosen or bound; the message names what was tried and the options that set it."""


class StreamError(TransportError, ConnectionError):
    """A stream could not be opened, or the peer refused it."""


class PeerLeftError(StreamError):
    """The peer closed its connection before its stream handshake was done (a process that ended then):
    counted as a refusal by the listener, but not warned of."""


class ServerGone(TransportError, ConnectionError):
    """The process that serves an object has ended or stopped answering."""


class AuthenticationError(TransportError, multiprocessing.AuthenticationError, ConnectionError):
    """A peer failed to prove that it knows the session secret (also ``roving.AuthenticationError``)."""


class IdentityError(TransportError, multiprocessing.AuthenticationError, ConnectionError):
    """A peer's certificate or proof is not valid for this session, names another node than the one
    meant, or was revoked (a ``roving.AuthenticationError``, as :class:`AuthenticationError` is)."""


class SerializationError(TransportError, TypeError):
    """An object could not be pickled; the message names the object.

    What roving raises is also of the type pickle itself raised (see
    ``roving.transport.serialize.serialization_error``): ``except TypeError``, ``except
    pickle.PicklingError`` or ``except RuntimeError`` catch it as they would under multiprocessing, and
    ``except SerializationError`` catches every kind."""


class MalformedMessage(TransportError, ValueError):
    """A message that does not follow the wire format; ``str()`` is a one-line reason, naming the part
    that was wrong."""
