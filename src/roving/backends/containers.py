"""What the container backends (:mod:`.docker`, :mod:`.kubernetes`) share: which of a job's environment a
container may see (:func:`container_env`), and the label that marks a container or pod as this user's
(:func:`owner_label`), which `roving cancel --all` matches."""
from __future__ import annotations

import functools
import hashlib
import hmac
import os
from typing import Dict, Iterable, Optional, Tuple

from ..system.private import private_key
from .base import JobSpec, user_name

__all__ = ["OWNER_KEY_FILE", "owner_label", "container_env"]

#: Where this user's key for :func:`owner_label` is kept (made on first use, 0600).
OWNER_KEY_FILE = "~/.roving/owner.key"


@functools.lru_cache(maxsize=None)
def _owner_key(path: str) -> bytes:
    return private_key(path)


def owner_label(user: Optional[str] = None) -> str:
    """The ``roving.owner`` label of the containers and pods that ``user`` (default: this user)
    starts: a keyed hash (HMAC-SHA256, 32 hex digits) of the user name with this user's own key
    (:data:`OWNER_KEY_FILE`). `roving cancel --all` matches it, not the ``roving.user`` label, which
    anyone can set to any name: a job started by someone else (another machine's "alice", a
    hand-made container) does not carry it, whatever its other labels say. Only a process with this
    user's key file makes it (the label is visible to whoever can list the jobs: copying it onto a
    job of one's own makes that job cancelled by this user's --all, nothing more)."""
    key = _owner_key(os.path.expanduser(OWNER_KEY_FILE))
    name = user_name() if user is None else user
    return hmac.new(key, b"roving-owner:" + name.encode(), hashlib.sha256).hexdigest()[:32]


def container_env(spec: JobSpec, forward: Iterable[str]) -> Tuple[Dict[str, str], str]:
    """What of a job's environment a container or pod may see, and the session secret (hex) apart.

    A container is another machine: it gets what roving needs (ROVING_CHILD, PYTHONPATH,
    PYTHONUNBUFFERED, the ROVING_<option> variables) and the variables ``forward`` names (the
    ``forward_env`` option), never the rest of the parent's environment, and never the secret's variables
    (``spec.session``), even when ``forward`` names them. The secret must reach it another way (a file, a
    Kubernetes Secret); it is "" when the environment holds none.
    """
    secret_vars = (spec.session.secret_env, spec.session.secret_file_env)
    wanted = set(forward)
    out = {k: v for k, v in spec.env.items()
           if k not in secret_vars and (k in wanted or k in ("PYTHONPATH", "PYTHONUNBUFFERED")
                                        or k.startswith("ROVING_"))}
    out.setdefault("PYTHONUNBUFFERED", "1")
    return out, spec.env.get(spec.session.secret_env, "")


