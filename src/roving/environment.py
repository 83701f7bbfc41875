"""What a process's Python environment is, and how a child's differs from its parent's.

A worker on another node image or in another venv fails in obscure ways when its environment differs from
the parent's: an unpickling error, a missing attribute, other numerics. So every child compares its
environment with its parent's when it starts, *before* it unpickles anything the parent sent, and says
what differs by name (``env_check``):

* the parent describes itself (:func:`here`): the Python version and implementation, the platform, and
  the version of each installed distribution it has imported that matters: roving, cloudpickle, pyzmq,
  and every distribution behind a top-level module of the program's (numpy, torch, the user's imports).
  Modules of the program that are not installed (its own files) have no version and are not compared.
* the child describes itself for the same distributions and compares (:func:`compare`):

  ============  ==============================================  =======================================
  env_check     an error (the child does not run)              a warning (it runs)
  ============  ==============================================  =======================================
  ``auto``      Python major.minor or implementation, roving    everything else (a patch release, the
                                                                platform, another distribution)
  ``strict``    every difference                                 —
  ``warn``      —                                                every difference
  ``off``       nothing is compared                              —
  ============  ==============================================  =======================================

The description is plain JSON (it crosses to the child in its start-up variables and back in a mailbox),
never pickled: it is read before the child trusts anything.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import platform
import sys
from importlib import metadata
from typing import Dict, FrozenSet, Iterable, List, Mapping, Optional, Tuple

from .errors import EnvironmentMismatchError

__all__ = ["Fingerprint", "Difference", "Report", "EnvironmentMismatchError", "here", "compare", "describe",
           "POLICIES"]

POLICIES = ("auto", "strict", "warn", "off")
#: Always described when installed: what roving's own wire depends on.
_ALWAYS = ("roving", "cloudpickle", "pyzmq")
#: Differences that ``auto`` makes errors: a child with another Python minor or roving cannot read what
#: the parent sends.
_FATAL_IN_AUTO = ("python", "implementation", "roving")



@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """A process's environment as far as its peers care."""

    python: str  #: e.g. "3.11.7"
    implementation: str  #: e.g. "cpython"
    platform: str  #: e.g. "Linux-x86_64"
    packages: Mapping[str, str]  #: distribution name -> version, of those that matter (see the module)

    def to_json(self) -> Dict[str, object]:
        return {"python": self.python, "implementation": self.implementation, "platform": self.platform,
                "packages": dict(self.packages)}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> "Fingerprint":
        """Raises ValueError when ``data`` is not a fingerprint (a field missing or of the wrong kind)."""
        try:
            packages = data["packages"]
            python, implementation, platform = data["python"], data["implementation"], data["platform"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not an environment description: {exc!r} missing") from None
        if not (isinstance(python, str) and isinstance(implementation, str) and isinstance(platform, str)) \
                or not isinstance(packages, dict) \
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in packages.items()):
            raise ValueError("not an environment description: a field of the wrong kind")
        return cls(python, implementation, platform, packages=dict(packages))


@dataclasses.dataclass(frozen=True)
class Difference:
    """One way a child differs: ``what`` ("python", "implementation", "platform" or a distribution's
    name), the parent's and the child's value ("not installed" when one lacks it), and whether the policy
    makes it an error."""

    what: str
    parent: str
    child: str
    fatal: bool

    def __str__(self) -> str:
        name = "Python" if self.what == "python" else self.what
        return f"{name} {self.parent} in the parent, {self.child} in the child"

    def to_json(self) -> Dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> "Difference":
        """Raises ValueError when ``data`` is not a difference (a field missing or of the wrong kind)."""
        try:
            what, parent, child = data["what"], data["parent"], data["child"]
            fatal = data["fatal"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a difference: {exc!r} missing") from None
        if not (isinstance(what, str) and isinstance(parent, str) and isinstance(child, str)) \
                or not isinstance(fatal, bool):
            raise ValueError("not a difference: a field of the wrong kind")
        return cls(what, parent, child, fatal=fatal)


@functools.lru_cache(maxsize=None)
def _distributions_of_modules() -> Mapping[str, Tuple[str, ...]]:
    """Top-level module name -> the installed distributions providing it (read once: it scans them all)."""
    return {module: tuple(dict.fromkeys(dists)) for module, dists in metadata.packages_distributions().items()}


@functools.lru_cache(maxsize=None)
def _version(distribution: str) -> Optional[str]:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _imported_distributions(modules: Iterable[str]) -> List[str]:
    """The installed distributions behind the top-level modules among ``modules`` that are not the
    standard library's (the program's own files belong to none)."""
    stdlib: FrozenSet[str] = getattr(sys, "stdlib_module_names", frozenset())
    owners = _distributions_of_modules()
    found: Dict[str, None] = {}
    for name in modules:
        if "." in name or name in stdlib or name.startswith("_"):
            continue
        for dist in owners.get(name, ()):
            found[dist] = None
    return list(found)


def here(distributions: Optional[Iterable[str]] = None) -> Fingerprint:
    """This process's fingerprint: for the given ``distributions`` (a child describes itself for its
    parent's), else for those that matter here (roving's own dependencies, and those imported now)."""
    if distributions is None:
        names = [*_ALWAYS, *_imported_distributions(list(sys.modules))]
    else:
        names = list(distributions)
    packages = {}
    for name in dict.fromkeys(names):
        version = _version(name)
        if version is not None or distributions is not None:
            packages[name] = version if version is not None else "not installed"
    return Fingerprint(python=platform.python_version(), implementation=sys.implementation.name,
                       platform=f"{platform.system()}-{platform.machine()}", packages=packages)


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def compare(parent: Fingerprint, child: Fingerprint, policy: str = "auto") -> List[Difference]:
    """How ``child`` differs from ``parent``, each difference marked fatal or not by ``policy`` (one of
    :data:`POLICIES`; ValueError otherwise). ``off`` compares nothing."""
    if policy not in POLICIES:
        raise ValueError(f"env_check must be one of {', '.join(POLICIES)}, not {policy!r}")
    if policy == "off":
        return []

    def fatal(what: str, parent_value: str, child_value: str) -> bool:
        if policy == "strict":
            return True
        if policy == "warn":
            return False
        if what == "python":
            return _minor(parent_value) != _minor(child_value)
        return what in _FATAL_IN_AUTO

    found = []
    pairs = [("python", parent.python, child.python), ("implementation", parent.implementation,
                                                         child.implementation),
             ("platform", parent.platform, child.platform)]
    pairs += [(name, version, child.packages.get(name, "not installed"))
              for name, version in parent.packages.items()]
    for what, parent_value, child_value in pairs:
        if parent_value != child_value:
            found.append(Difference(what, parent_value, child_value, fatal(what, parent_value, child_value)))
    return found


def probe() -> None:
    """The target of ``roving info --workers``: a child that does nothing once it has checked its
    environment (which every child does at start)."""


def describe(differences: Iterable[Difference]) -> str:
    """The differences as one line: "Python 3.11.7 in the parent, 3.13.0 in the child; numpy ..."."""
    return "; ".join(str(d) for d in differences)


#: The largest environment report a parent reads (a real one is a few KiB).
MAX_REPORT = 1 << 20


@dataclasses.dataclass(frozen=True)
class Report:
    """What a child leaves for its parent when it starts: where it runs, its fingerprint, how it differs
    from the parent's (empty when it does not) under ``policy``."""

    host: str
    fingerprint: Fingerprint
    differences: Tuple[Difference, ...]
    policy: str

    def to_bytes(self) -> bytes:
        return json.dumps({"host": self.host, "fingerprint": self.fingerprint.to_json(), "policy": self.policy,
                           "differences": [d.to_json() for d in self.differences]}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Report":
        """Raises ValueError when ``raw`` is not a report: not JSON, over :data:`MAX_REPORT` bytes, nested
        too deeply for the JSON parser, or a field missing or of the wrong kind. Nothing else: it comes from a
        child not yet trusted, and must not raise into its parent's ``join()`` (RecursionError included)."""
        if len(raw) > MAX_REPORT:
            raise ValueError(f"not an environment report: {len(raw)} bytes, over {MAX_REPORT}")
        try:
            data = json.loads(raw)
        except RecursionError:  # json's parser recurses per level: a child sent lists in lists in lists...
            raise ValueError("not an environment report: its JSON is nested too deeply to be read (a report "
                             "nests 3 deep)") from None
        try:
            host, policy, differences = data["host"], data["policy"], data["differences"]
            fingerprint = Fingerprint.from_json(data["fingerprint"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not an environment report: {exc!r}") from None
        if not isinstance(host, str) or not isinstance(policy, str) or not isinstance(differences, list):
            raise ValueError("not an environment report: a field of the wrong kind")
        return cls(host, fingerprint, tuple(Difference.from_json(d) for d in differences), policy)

    def error(self, name: str) -> EnvironmentMismatchError:
        """The error for child ``name`` that its fatal differences make."""
        fatal = tuple(d for d in self.differences if d.fatal)
        return EnvironmentMismatchError(
            f"{name} (on {self.host}) did not run: its environment differs from this process's "
            f"(env_check={self.policy!r}): {describe(fatal)}. Install the same versions there (another node "
            "image or venv?), or set env_check=\"warn\" to run it anyway.", fatal)
