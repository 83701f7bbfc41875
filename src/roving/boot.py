"""What a child is told, and what it checks and fetches, before it unpickles anything of its parent's.

* In the parent (:meth:`roving.Process.start`), :func:`prepare` adds to the child's start-up information
  the parent's environment fingerprint and a mailbox for the child's report (``env_check``), and, where
  the program's code must travel (``ship_code``), the digest of its archive and a mailbox holding it; it
  also says which Python the child runs and with which ``sys.path`` (:func:`paths_for`).
* In the child (:mod:`roving._child`), :func:`before_work` compares its environment with the parent's and
  leaves its report, then fetches and unpacks the program's code unless this machine already has it; it
  says why the child must not run, or nothing.
* Back in the parent, :func:`report` reads what the child left (plain JSON, never pickled).
"""
from __future__ import annotations

import dataclasses
import os
import socket
import sys
from typing import Any, Dict, List, Optional

from . import codeship
from . import config as _config
from . import environment
from .transport import node as _node
from .transport.endpoint import Endpoint

__all__ = ["Prepared", "prepare", "report", "drop", "before_work", "paths_for", "ships_code"]


@dataclasses.dataclass
class Prepared:
    """What :func:`prepare` made for one child: its start-up information (JSON, in its variables), the
    Python it runs with its ``sys.path``, and the mailboxes to drop once it has ended."""

    info: Dict[str, Any]
    python: str
    paths: List[str]
    env_box: Optional[int] = None
    code_box: Optional[int] = None

    def boxes(self) -> List[int]:
        return [b for b in (self.env_box, self.code_box) if b is not None]


def ships_code(cfg: _config.Config, shares_filesystem: bool) -> bool:
    """Whether children get the program's code through roving (``ship_code``): ``always``; ``auto`` where
    the backend's jobs do not see this machine's files; never with ``off``."""
    return cfg.ship_code == "always" or (cfg.ship_code == "auto" and not shares_filesystem)


def paths_for(python: str) -> List[str]:
    """The ``sys.path`` a child running ``python`` gets: all of ours for our own interpreter; for another,
    only the entries outside our installation (the program's folders, roving's source in a checkout), so
    that it never loads our standard library or compiled packages."""
    paths = [p for p in sys.path if p]
    if os.path.abspath(python) == os.path.abspath(sys.executable):  # (a venv's python may link to ours)
        return paths
    ours = {os.path.realpath(p) + os.sep for p in {sys.prefix, sys.base_prefix, sys.exec_prefix}}
    return [p for p in paths if not any((os.path.realpath(p) + os.sep).startswith(o) for o in ours)
            and not p.endswith(".zip")]


def prepare(node: _node.Node, cfg: _config.Config, shares_filesystem: bool, uid: str, work_box: int) -> Prepared:
    """The start-up information and mailboxes for the child ``uid`` of ``node``, whose work waits in
    ``work_box`` (see the module). CodeShipError when the program's code is to be shipped and cannot be
    (over ``ship_code_limit``)."""
    python = cfg.python or sys.executable
    prepared = Prepared({
        "uid": uid, "parent": node.address, "box": work_box,
        "parent_pid": os.getpid(), "local": cfg.backend == "local", "parent_why": node.why,
        "connect_timeout": cfg.connect_timeout,
        "encrypt": cfg.encrypt,  # needed before the child has fetched its configuration
    }, python, paths_for(python))
    try:
        if cfg.env_check != "off":
            prepared.env_box = node.mailboxes.new_box(access=_node.Access(owner=uid))
            prepared.info.update(env=environment.here().to_json(), env_check=cfg.env_check,
                                 env_box=prepared.env_box)
        if ships_code(cfg, shares_filesystem):
            folders = codeship.program_folders()
            archive = codeship.packed(folders, _config.parse_memory(cfg.ship_code_limit))
            prepared.code_box = node.mailboxes.new_box(access=_node.Access(owner=uid))
            node.mailboxes.call_local(_node.PUT, prepared.code_box, 0, [archive.data])
            prepared.info["code"] = {"sha256": archive.sha256, "box": prepared.code_box,
                                     "places": list(archive.places)}
    except BaseException:
        drop(node, prepared)
        raise
    return prepared


def report(node: Optional[_node.Node], prepared: Optional[Prepared]) -> Optional[environment.Report]:
    """What the child said of its environment, once it has (None before, or with env_check off).
    ValueError when what it left is not a report."""
    if node is None or prepared is None or prepared.env_box is None:
        return None
    status, frames = node.mailboxes.call_local(_node.GET, prepared.env_box, 0)
    if status != _node.OK or not frames:
        return None
    return environment.Report.from_bytes(bytes(frames[0]))


def drop(node: _node.Node, prepared: Prepared) -> None:
    """Let go of the child's mailboxes (it has ended, or was never started)."""
    for box in prepared.boxes():
        node.mailboxes.drop_box(box)
    prepared.env_box = prepared.code_box = None


# -- in the child ------------------------------------------------------------------------------------

def before_work(endpoint: Endpoint, info: Dict[str, Any], timeout: float) -> Optional[str]:
    """In a child, before it fetches its work: the environment check, then the program's code. Returns
    what to say on stderr when the child must not run (a difference the policy makes an error, code that
    cannot be fetched), else None; a warning for differences that are allowed is written here. OSError
    when the parent cannot be reached."""
    if "env" in info:
        refused = _check_environment(endpoint, info, timeout)
        if refused:
            return refused
    if "code" in info:
        return _fetch_code(endpoint, info["code"], timeout)
    return None


def _check_environment(endpoint: Any, info: Dict[str, Any], timeout: float) -> Optional[str]:
    try:
        parent = environment.Fingerprint.from_json(info["env"])
        policy = str(info.get("env_check", "auto"))
        mine = environment.here(parent.packages)
        differences = tuple(environment.compare(parent, mine, policy))
    except ValueError as exc:
        return f"roving: this child cannot check its environment against its parent's: {exc}\n"
    found = environment.Report(socket.gethostname(), mine, differences, policy)
    endpoint.call(_node.PUT, int(info["env_box"]), timeout, [found.to_bytes()])
    if any(d.fatal for d in differences):
        return f"roving: {found.error('this child')}\n"
    if differences:
        sys.stderr.write(f"roving: warning: this child's environment (on {found.host}) differs from its "
                         f"parent's: {environment.describe(differences)}\n")
    return None


def _fetch_code(endpoint: Any, code: Dict[str, Any], timeout: float) -> Optional[str]:
    sha256, places = str(code["sha256"]), [str(p) for p in code["places"]]
    try:
        target = codeship.cached(sha256)
        if target is None:
            status, frames = endpoint.call(_node.GET, int(code["box"]), timeout)
            if status != _node.OK or not frames:
                return "roving: this child could not fetch the program's code from its parent\n"
            target = codeship.install(bytes(frames[0]), sha256)
        copies = codeship.paths_in(target, places)
    except codeship.CodeShipError as exc:
        return f"roving: {exc}\n"
    # the copies take the place of the parent's folders, ahead of anything of the same name here
    sys.path[:0] = copies
    os.environ["ROVING_CODE_DIR"] = target
    return None
