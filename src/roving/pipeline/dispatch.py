"""The coordinator's one reader of its control inbox: every message the stage processes send it is read
here and handed to the one handler registered for its type (the trainer's for ``Done``, ``Norm`` and
``Stepped``; the verifier's for the answers its audit asked for), whoever is waiting when it comes. So no
message of the round is dropped because the caller that read it was waiting for something else.

``Dispatch.until`` reads and dispatches until its caller's condition holds (which a handler makes true).
What the source drops is its own business (``roster.Roster.recv``: messages of other rounds, of processes
declared dead, and of types nobody registered, each dropped, never an end to the run).
"""

from __future__ import annotations

from typing import Callable, Protocol

from .protocol import Message

#: what a handler does with a message of its type.
Handler = Callable[[Message], None]


class Source(Protocol):
    """Where messages are read from (``roster.Roster``)."""

    def recv(self, kind: type | tuple[type, ...], timeout: float | None = None,
             rnd: int | None = None) -> Message: ...


class Dispatch:
    """Handlers by message type, and the reading that feeds them (the module doc)."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self._handlers: dict[type, Handler] = {}

    def on(self, kinds: type | tuple[type, ...], handler: Handler) -> None:
        """``handler`` takes every message of ``kinds`` read from now on. ValueError when a type has a
        handler already: each type has one owner."""
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        for kind in kinds:
            if kind in self._handlers:
                raise ValueError(f"{kind.__name__} messages are handled already (by {self._handlers[kind]!r})")
        self._handlers.update(dict.fromkeys(kinds, handler))

    @property
    def kinds(self) -> tuple[type, ...]:
        """The types a handler is registered for."""
        return tuple(self._handlers)

    def until(self, done: Callable[[], bool], rnd: int | None = None, timeout: float | None = None) -> None:
        """Read messages (of round ``rnd``, for round messages) and hand each to its type's handler until
        ``done()``; raises what the source raises (``NoMessage`` after ``timeout`` seconds without a
        message, ``NodesLost``), the messages read before handled."""
        while not done():
            msg = self.source.recv(self.kinds, timeout=timeout, rnd=rnd)
            self._handlers[type(msg)](msg)
