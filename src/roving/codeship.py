"""The program's own code, shipped to children that do not share this machine's filesystem.

A program's modules that are not installed — next to its script, under its working directory, or in any
``sys.path`` folder outside the interpreter's installation — are found by a child only where the
filesystem is shared. Where it is not (Kubernetes, a remote Docker engine, a container without the
working directory mounted; ``ship_code``), the parent packs those folders once per session into an
archive (:func:`pack`), and each child, before it unpickles anything, fetches it over the authenticated
transport unless its machine already holds that very archive, unpacks it into a private folder of its
own user (:func:`install`), and puts the unpacked folders on ``sys.path`` where the parent's were.

What goes in: what can be imported from each folder and the data of its packages, nothing else — the
modules at its top (``*.py``, extension modules), and the files of its packages (a top folder whose name
is a Python identifier and that holds a module, at any depth) and of its distributions' metadata
(``*.dist-info``, ``*.egg-info``). Left out: every dot-file and dot-folder at any depth (``.ssh``,
``.kube/config``, ``.env``, ``.roving``, ``.git``...), ``__pycache__``, compiled files, virtual environments
(a folder holding ``pyvenv.cfg``), what the folder's git repository ignores (``git ls-files``; without git,
the patterns of the folder's own ``.gitignore``, matched against each path and name), and the other files
at its top (notes, data, keys). A folder that is a user's home, or holds one (``/home``, ``/``), is
refused (CodeShipError): whatever else is there is not the program's to send. An archive larger than
``ship_code_limit`` is an error naming the biggest files, so that a data folder under the working
directory is seen at once rather than sent to every machine.

Guarantees: the archive is checked against its SHA-256 (which the child got with its start-up variables)
before it is unpacked; unpacking keeps to the target folder (tarfile's ``data`` filter: no absolute
paths, links out or device files); the folder it is unpacked into is this user's, mode 0700, and is not
followed through a link; a complete unpacked copy is marked, so an interrupted one is never used. When
the shared name (``$TMPDIR/roving-code-UID``) was taken first by someone else, the child unpacks into a
new folder of its own (``mkdtemp``, removed at its exit) and says so in a warning: it still runs.
"""
from __future__ import annotations

import atexit
import dataclasses
import fnmatch
import hashlib
import importlib.machinery
import io
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
from typing import Dict, List, Optional, Sequence, Set, Tuple

from .system.private import private_dir_or_own
from .errors import CodeShipError

__all__ = ["Archive", "CodeShipError", "pack", "install", "program_folders"]

_SKIP_DIRS = {"__pycache__"}  # and every folder whose name starts with a dot
_SKIP_SUFFIXES = (".pyc", ".pyo")
#: What a module's file is named: a source, or an extension module of this interpreter.
_MODULE_SUFFIXES = tuple(importlib.machinery.SOURCE_SUFFIXES + importlib.machinery.EXTENSION_SUFFIXES)
_METADATA_SUFFIXES = (".dist-info", ".egg-info")
_DONE = ".roving-complete"



@dataclasses.dataclass(frozen=True)
class Archive:
    """The packed folders: ``data`` (a gzipped tar, one top-level entry ``0``, ``1``, ... per outermost
    folder), its SHA-256, and where each of the program's folders (in ``sys.path`` order) is in it
    (``places``: ``"0"``, or ``"0/src"`` for a folder inside another)."""

    data: bytes
    sha256: str
    folders: Tuple[str, ...]
    places: Tuple[str, ...]


def _outermost(folders: Sequence[str]) -> Tuple[List[str], List[str]]:
    """The folders none of the others holds, and each folder's place under them (see Archive.places)."""
    roots = [f for f in folders if not any(f != o and (f + os.sep).startswith(o + os.sep) for o in folders)]
    places = []
    for f in folders:
        i, root = next((i, r) for i, r in enumerate(roots) if (f + os.sep).startswith(r + os.sep))
        rel = os.path.relpath(f, root)
        places.append(str(i) if rel == "." else f"{i}/{rel}")
    return roots, places


def program_folders(paths: Optional[Sequence[str]] = None) -> List[str]:
    """The folders of ``paths`` (default: ``sys.path``, with the working directory for ``""``) that are
    outside this interpreter's installation: where the program's own modules are found."""
    ours = {os.path.realpath(p) + os.sep for p in {sys.prefix, sys.base_prefix, sys.exec_prefix}}
    found: Dict[str, None] = {}
    for p in sys.path if paths is None else paths:
        folder = os.path.realpath(p or os.getcwd())
        if not os.path.isdir(folder) or any((folder + os.sep).startswith(o) for o in ours):
            continue
        found[folder] = None
    return list(found)


def _git_files(folder: str) -> Optional[List[str]]:
    """The files of ``folder`` that git does not ignore, relative to it; None when it is not in a git
    repository (or git is missing)."""
    try:
        done = subprocess.run(["git", "-C", folder, "ls-files", "-z", "--cached", "--others", "--exclude-standard",
                               "--", "."], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return [f for f in done.stdout.decode(errors="surrogateescape").split("\0") if f]


def _ignored_by(folder: str) -> List[str]:
    try:
        with open(os.path.join(folder, ".gitignore"), encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f]
    except OSError:
        return []
    return [line.rstrip("/").lstrip("/") for line in lines if line and not line.startswith(("#", "!"))]


def _walk(folder: str) -> List[str]:
    """Without git: every file, less the patterns of the folder's own .gitignore."""
    patterns = _ignored_by(folder)

    def ignored(rel: str) -> bool:
        return any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(os.path.basename(rel), p) for p in patterns)

    files = []
    for root, dirs, names in os.walk(folder):
        rel_root = os.path.relpath(root, folder)
        dirs[:] = [d for d in dirs if not _skipped_dir(d) and not ignored(os.path.normpath(os.path.join(rel_root, d)))
                   and not os.path.exists(os.path.join(root, d, "pyvenv.cfg"))]
        files += [os.path.normpath(os.path.join(rel_root, n)) for n in names if not n.startswith(".")]
    return [f for f in files if not ignored(f)]


def _skipped_dir(name: str) -> bool:
    return name.startswith(".") or name in _SKIP_DIRS


def _importable(files: Sequence[str], inner: Sequence[str]) -> List[str]:
    """Those of ``files`` (paths relative to an outermost folder) that are the program's code or its
    packages' data, as seen from any of the program's folders under it (``inner``: their paths relative to
    it, "." for itself): a module at the top of one, or a file inside a package at its top (a folder whose
    name is an identifier and that holds a module, at any depth), or inside a distribution's metadata."""
    def split(rel: str, prefix: str) -> Optional[List[str]]:
        if prefix == ".":
            return rel.split(os.sep)
        return rel[len(prefix) + 1:].split(os.sep) if rel.startswith(prefix + os.sep) else None

    packages = set()  # (program folder, top folder) pairs that hold a module
    for rel in files:
        if rel.endswith(_MODULE_SUFFIXES):
            for prefix in inner:
                parts = split(rel, prefix)
                if parts is not None and len(parts) > 1 and parts[0].isidentifier():
                    packages.add((prefix, parts[0]))

    def wanted(rel: str) -> bool:
        for prefix in inner:
            parts = split(rel, prefix)
            if parts is None:
                continue
            if len(parts) == 1 and rel.endswith(_MODULE_SUFFIXES):
                return True
            if len(parts) > 1 and ((prefix, parts[0]) in packages or parts[0].endswith(_METADATA_SUFFIXES)):
                return True
        return False

    return [rel for rel in files if wanted(rel)]


def _files(folder: str, inner: Sequence[str] = (".",)) -> List[Tuple[str, int]]:
    """(path relative to ``folder``, size) of each regular file to ship; ``inner``: the program's folders
    under ``folder``, relative to it ("." for ``folder`` itself)."""
    listed = _git_files(folder)
    chosen = []
    for rel in _importable(listed if listed is not None else _walk(folder), inner):
        parts = rel.split(os.sep)
        if any(_skipped_dir(p) for p in parts[:-1]) or parts[-1].startswith(".") or rel.endswith(_SKIP_SUFFIXES):
            continue
        try:
            st = os.lstat(os.path.join(folder, rel))
        except OSError:  # listed by git, deleted since
            continue
        if stat.S_ISREG(st.st_mode):
            chosen.append((rel, st.st_size))
    if listed is not None:  # git does not know of venvs it was not told to ignore
        venvs = {os.path.dirname(rel) for rel, _ in chosen if os.path.basename(rel) == "pyvenv.cfg"}
        chosen = [(rel, size) for rel, size in chosen
                  if not any(rel == v or rel.startswith(v + os.sep) for v in venvs if v)]
    return chosen


def _homes() -> Dict[str, str]:
    """Every user's home folder (real path) -> whose it is: this process's ``$HOME`` and each account's."""
    found: Dict[str, str] = {}
    try:
        for account in pwd.getpwall():
            if account.pw_dir:
                found.setdefault(os.path.realpath(account.pw_dir), f"user {account.pw_name}")
    except OSError:  # an account database that cannot be read: $HOME still counts
        pass
    home = os.environ.get("HOME") or os.path.expanduser("~")
    if home and home != "~":
        found[os.path.realpath(home)] = "this user ($HOME)"
    return found


def _refuse_homes(roots: Sequence[str]) -> None:
    """CodeShipError when a folder to ship is a user's home, or holds one."""
    homes = _homes()
    for root in roots:
        held = sorted(h for h in homes if h == root or (h + os.sep).startswith(root.rstrip(os.sep) + os.sep))
        if held:
            what = (f"the home folder of {homes[root]}" if root in homes
                    else f"a folder that holds the home folder of {homes[held[0]]} ({held[0]})")
            raise CodeShipError(
                f"roving refuses to ship {root} to the workers: it is {what}, where keys and credentials live "
                "(.ssh, .kube, .env, .roving, a cloud's credentials). Run the program from a folder of its own "
                "(its script and modules in, say, ~/myproject), or set ship_code=\"off\" where the workers "
                "see this machine's files")


def pack(folders: Sequence[str], limit: int) -> Archive:
    """Pack ``folders`` (see the module for what goes in and what is left out). CodeShipError when a folder
    is a user's home or holds one, or when the files come to more than ``limit`` bytes, naming the
    biggest."""
    real = [os.path.realpath(f) for f in folders]
    roots, places = _outermost(real)
    _refuse_homes(roots)
    inner = [[os.path.relpath(f, root) for f in real if f == root or (f + os.sep).startswith(root + os.sep)]
             for root in roots]
    listing = [(i, folder, _files(folder, inner[i])) for i, folder in enumerate(roots)]
    total = sum(size for _, _, files in listing for _, size in files)
    if total > limit:
        biggest = sorted(((size, os.path.join(folder, rel)) for _, folder, files in listing for rel, size in files),
                         reverse=True)[:5]
        raise CodeShipError(
            f"the program's code to ship to the workers comes to {total / 2**20:.1f} MiB, over "
            f"ship_code_limit={limit / 2**20:.1f} MiB; the biggest files: "
            + ", ".join(f"{path} ({size / 2**20:.1f} MiB)" for size, path in biggest)
            + ". Move data out of the program's folders (" + ", ".join(roots) + "), list it in .gitignore, "
            "or raise ship_code_limit")
    buffer = io.BytesIO()
    # mtime 0 and sorted names: the same files make the same archive (and digest) on every run
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as tar:
        for i, folder, files in listing:
            for rel, _ in sorted(files):
                path = os.path.join(folder, rel)
                info = tar.gettarinfo(path, arcname=f"{i}/{rel}")
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                with open(path, "rb") as f:
                    tar.addfile(info, f)
    data = buffer.getvalue()
    return Archive(data, hashlib.sha256(data).hexdigest(), tuple(folders), tuple(places))


_packed: Dict[Tuple[Tuple[str, ...], int], Archive] = {}
_packed_lock = threading.Lock()


def packed(folders: Sequence[str], limit: int) -> Archive:
    """:func:`pack`, once per session for the same folders (later children get the same archive)."""
    key = (tuple(folders), limit)
    with _packed_lock:
        found = _packed.get(key)
        if found is None:
            found = _packed[key] = pack(folders, limit)
        return found


def _private_root() -> str:
    """This user's folder for unpacked code: ``$TMPDIR/roving-code-UID``, shared by this user's children on
    the machine (made 0700, not through a link). Where someone else took that name first (a folder of
    another user, a link, a folder others may write to), a folder of this process's own instead, removed at
    its exit (:func:`roving.system.private.private_dir_or_own`): a name in a shared temporary folder must
    not keep every child from running. CodeShipError when this user's own folder there is open to others."""
    shared = os.path.join(tempfile.gettempdir(), f"roving-code-{os.getuid()}")
    root = private_dir_or_own(shared)
    if root != shared:
        with _own_roots_lock:
            if root not in _own_roots:
                _own_roots.add(root)
                atexit.register(shutil.rmtree, root, True)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise CodeShipError(f"{root} is not a private folder of this user (open to others): shipped code is not "
                            f"unpacked there; run `chmod 700 {root}` or remove it")
    return root


_own_roots: Set[str] = set()
_own_roots_lock = threading.Lock()


def cached(sha256: str) -> Optional[str]:
    """The folder where the archive ``sha256`` is already unpacked on this machine, or None."""
    target = os.path.join(_private_root(), sha256)
    return target if os.path.exists(os.path.join(target, _DONE)) else None


def install(data: bytes, sha256: str) -> str:
    """Unpack ``data`` (checked against ``sha256``) into this user's private folder, once per machine;
    returns the folder, whose ``0``, ``1``... are the parent's outermost program folders."""
    if hashlib.sha256(data).hexdigest() != sha256:
        raise CodeShipError("the shipped code does not match its digest: nothing was unpacked")
    root = _private_root()
    target = os.path.join(root, sha256)
    if os.path.exists(os.path.join(target, _DONE)):
        return target
    partial = tempfile.mkdtemp(prefix=f".{sha256[:12]}-", dir=root)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(partial, filter="data")
            else:  # pragma: no cover - every supported Python has the filter since its 2023 releases
                raise CodeShipError("this Python's tarfile has no 'data' filter: update it to unpack shipped code")
        open(os.path.join(partial, _DONE), "w").close()
        try:
            os.rename(partial, target)
        except OSError:  # another child on this machine was first: theirs is the same archive
            if not os.path.exists(os.path.join(target, _DONE)):
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def paths_in(target: str, places: Sequence[str]) -> List[str]:
    """The unpacked copy of each of the parent's folders, by its place (Archive.places) under ``target``;
    a place that would leave ``target`` is refused (CodeShipError)."""
    found = []
    for place in places:
        path = os.path.normpath(os.path.join(target, place))
        if not (path + os.sep).startswith(os.path.normpath(target) + os.sep):
            raise CodeShipError(f"a shipped folder's place {place!r} is outside the unpacked code")
        found.append(path)
    return found
