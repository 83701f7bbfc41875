"""roving's one error family: every error roving raises is a :class:`RovingError`, itself a
:class:`multiprocessing.ProcessError`, as each of multiprocessing's own errors is. So ``except
RovingError`` catches whatever roving raises of its own, and ``except multiprocessing.ProcessError``
catches it as it catches multiprocessing's.

Each package has one error module and one base under :class:`RovingError` (``roving.backends.errors``:
``BackendError``; ``roving.transport.errors``: ``TransportError``; ``roving.pool.errors``: ``PoolError``);
this module holds the base and the errors of roving's top-level modules. Every class keeps the built-in
kind it had before it joined the family (a :class:`ConfigError` is still a ``ValueError``, a
:class:`ProcessStartError` an ``OSError``), so no ``except`` clause written against roving changes, and each
is importable from the module that raises it too (``roving.config.ConfigError``), as before.
"""
from __future__ import annotations

from multiprocessing import ProcessError
from typing import Tuple

__all__ = ["RovingError", "ConfigError", "ProcessStartError", "EnvironmentMismatchError", "CodeShipError",
           "CrashLogError", "NotPrivateError", "RemoteError"]


class RovingError(ProcessError):
    """The base of every error roving raises of its own (a :class:`multiprocessing.ProcessError`)."""


class ConfigError(RovingError, ValueError):
    """A configuration key or value is wrong; the message names it and where it came from."""


class ProcessStartError(RovingError, OSError):
    """A started process ended before it reached this process to fetch its work (an unreachable
    address, or a machine where Python or roving cannot start); the message names the address."""


class EnvironmentMismatchError(RovingError):
    """A child's environment differs from its parent's where ``env_check`` does not allow it: the child
    did not run. The message names the child, its host and each difference; :attr:`differences` has them
    (each a :class:`roving.environment.Difference`, a module above this one)."""

    def __init__(self, message: str, differences: Tuple[object, ...] = ()) -> None:
        super().__init__(message)
        self.differences = differences


class CodeShipError(RovingError, ValueError):
    """The program's code cannot be shipped: the archive would be over ``ship_code_limit`` (the message
    names the biggest files), a folder to ship is a user's home (or holds one), or a folder cannot be read."""


class CrashLogError(RovingError, OSError):
    """The folder of failure records is not private to this user (a link, another user's, open to others)."""


class NotPrivateError(RovingError, PermissionError):
    """A file or folder that roving would use for private data is a link, not this user's, or open to
    others; the message names it and says what to do. Also a :class:`PermissionError`; raised by
    :mod:`roving.system.private`, which every package that keeps private files (the backends' secret
    files, the crash log, the pipeline's control folder, code shipping) uses. Importable from
    ``roving.backends.errors`` too, where it was a ``BackendError`` before the system helpers left the
    backends."""


class RemoteError(RovingError):
    """An exception raised in the manager's server that could not be sent back as itself."""

    def __str__(self) -> str:
        return "\n" + "-" * 75 + "\n" + str(self.args[0]) + "-" * 75
