"""Files and folders that only this user can reach: log files, checkpoints being written, a training
run's control folder, a child's secret file.

Guarantees, for every file these open:

* No symbolic link is followed at the file or at the folder that holds it: the folder is opened
  with ``O_NOFOLLOW | O_DIRECTORY`` and the file relative to it, so what is checked is what is used.
* What they create is private: folders 0700, files 0600 (whatever the umask).
* What exists already is checked before use, and refused with :class:`NotPrivateError` (saying which
  path, what is wrong and what to do): a file that is not this user's, not a regular file, or that
  group or others may read or write; a folder that is not this user's, not a folder, or that group
  or others may write (they could plant a file or a link in it; one they may only read is accepted).

Only the last folder is checked: the folders above it (a home, /tmp) are the system's business.
"""
from __future__ import annotations

import logging
import os
import stat
import tempfile
import threading
from typing import IO, Any, Dict, Literal, Union, overload

from ..errors import NotPrivateError

__all__ = ["NotPrivateError", "private_dir", "private_dir_or_own", "open_private", "create_private", "take_private",
           "private_key"]

log = logging.getLogger(__name__)

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def _refuse(path: str, what: str, fix: str) -> NotPrivateError:
    return NotPrivateError(f"roving refuses {path}: {what}; {fix}")


def _refuse_link(path: str, folder: bool = False) -> NotPrivateError:
    """The refusal of ``path`` found to be a symbolic link (a ``folder``, or a file)."""
    if folder:
        return _refuse(path, "the folder is a symbolic link", "use the folder it points to, or another")
    return _refuse(path, "it is a symbolic link (roving never writes through one: someone else may have planted "
                   "it)", "remove the link")


def _check_dir(path: str, st: os.stat_result) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "it is not a folder", "remove it or choose another path")
    if st.st_uid != os.getuid():
        raise _refuse(path, f"the folder belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})",
                      "choose a folder of your own")
    if st.st_mode & 0o022:
        raise _refuse(path, f"others may write to the folder (mode {stat.S_IMODE(st.st_mode):04o})",
                      f"run `chmod go-w {path}` or choose another folder")


def _check_file(path: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, "it is not a regular file", "remove it or choose another path")
    if st.st_uid != os.getuid():
        raise _refuse(path, f"the file belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})",
                      "remove it or choose another path")
    if st.st_mode & 0o077:
        raise _refuse(path, f"group or others may read or write it (mode {stat.S_IMODE(st.st_mode):04o})",
                      f"run `chmod 600 {path}` or remove it")


def _open_dir(path: str) -> int:
    """A descriptor of the folder ``path`` (made with its missing parents, 0700), checked."""
    private_dir(path)
    try:
        fd = os.open(path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
    except OSError:
        if os.path.islink(path):  # made a link since private_dir looked
            raise _refuse_link(path, folder=True) from None
        raise
    try:
        _check_dir(path, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_dir(path: str) -> None:
    """Make folder ``path`` and its missing parents, each 0700; if ``path`` exists, check it (not a link,
    this user's, not writable by others: else NotPrivateError)."""
    path = os.path.abspath(path)
    missing = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            continue
        os.chmod(folder, 0o700, follow_symlinks=False)  # mkdir's mode is cut by the umask
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise _refuse_link(path, folder=True)
    _check_dir(path, st)


_own_dirs: Dict[str, str] = {}
_own_dirs_lock = threading.Lock()


def private_dir_or_own(path: str) -> str:
    """``path`` when :func:`private_dir` makes or accepts it; when someone else took that name first (a
    folder of another user, a link, a folder others may write to: NotPrivateError), a new folder of this
    process's own instead, made by ``mkdtemp`` beside it (else in the temporary folder): 0700, under a random
    name that did not exist (so never one planted as a link), the same one for every later call with
    ``path``; a warning names both. Other errors (no permission to make it) are raised."""
    path = os.path.abspath(path)
    try:
        private_dir(path)
        return path
    except NotPrivateError as exc:
        why = exc
    with _own_dirs_lock:
        own = _own_dirs.get(path)
        if own is None or not os.path.isdir(own):
            prefix = os.path.basename(path.rstrip(os.sep)) + "-"
            try:
                own = tempfile.mkdtemp(prefix=prefix, dir=os.path.dirname(path))
            except OSError:
                own = tempfile.mkdtemp(prefix=prefix)
            _own_dirs[path] = own
            log.warning("%s; this process uses a folder of its own instead: %s", why, own)
        return own


def _open(path: str, flags: int, mode: str) -> IO[Any]:
    path = os.path.abspath(path)
    folder, name = os.path.split(path)
    dfd = _open_dir(folder)
    try:
        try:
            fd = os.open(name, flags | _NOFOLLOW | _CLOEXEC, 0o600, dir_fd=dfd)
        except OSError as exc:
            try:
                st = os.lstat(name, dir_fd=dfd)
            except OSError:
                raise exc from None
            if stat.S_ISLNK(st.st_mode):
                raise _refuse_link(path) from None
            raise
    finally:
        os.close(dfd)
    try:
        _check_file(path, os.fstat(fd))
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


@overload
def open_private(path: str, mode: Literal["ab"] = "ab") -> IO[bytes]: ...


@overload
def open_private(path: str, mode: Literal["a"]) -> IO[str]: ...


def open_private(path: str, mode: str = "ab") -> Union[IO[bytes], IO[str]]:
    """Open ``path`` for appending (binary with ``"ab"``, text with ``"a"``): created 0600 in a folder
    made by :func:`private_dir`, or, when it exists, checked first (see the module). NotPrivateError
    when it or its folder is not private."""
    return _open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode)


@overload
def create_private(path: str, mode: Literal["wb"] = "wb") -> IO[bytes]: ...


@overload
def create_private(path: str, mode: Literal["w"]) -> IO[str]: ...


def create_private(path: str, mode: str = "wb") -> Union[IO[bytes], IO[str]]:
    """Create ``path`` anew, 0600, for writing (binary with ``"wb"``, text with ``"w"``): the temporary
    name of a file that is then renamed into place. A file of this user's left there (a write cut
    short) is replaced; anything else there (a link, another user's file) is refused
    (NotPrivateError)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        return _open(path, flags, mode)
    except FileExistsError:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise _refuse_link(path) from None
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            _check_file(path, st)  # raises, saying which
        os.unlink(path)  # ours, left by a write that did not finish
        return _open(path, flags, mode)


def take_private(path: str) -> str:
    """The text of the private file ``path``, which is then removed (where it can be: a read-only
    mount keeps it). Not followed if it is a link; refused (NotPrivateError) if it is not a regular
    file or group or others may read or write it. For a secret handed over once."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            raise _refuse(path, f"it is not a regular file that only its owner may read (mode "
                          f"{stat.S_IMODE(st.st_mode):04o})", "it was not made by roving: start the process again")
        with os.fdopen(fd, "r") as f:
            fd = -1
            text = f.read()
    finally:
        if fd >= 0:
            os.close(fd)
    try:
        os.unlink(path)
    except OSError:  # a read-only mount (a container's), or gone already
        pass
    return text


def private_key(path: str) -> bytes:
    """This user's key kept in the private file ``path`` (32 random bytes, hex), made on first use (0600,
    in a 0700 folder; two processes making it at once agree on one). NotPrivateError when the file or
    its folder is not private (a key others could read is no key)."""
    try:
        with _open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "w") as f:
            f.write(os.urandom(32).hex())
    except FileExistsError:
        pass
    with _open(path, os.O_RDONLY, "r") as f:
        text = f.read().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise _refuse(path, "it does not hold a key roving made", "remove it: roving makes a new one")
    return key
