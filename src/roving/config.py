"""roving's configuration: one :class:`Config`, resolved from four layers.

Later layers win: built-in defaults < ``[tool.roving]`` in ``pyproject.toml`` or ``roving.toml`` in the
working directory < ``ROVING_<OPTION>`` environment variables < :func:`roving.init` keyword arguments.
A key no option has, or a value of the wrong kind, is a :class:`ConfigError` naming the key and the
layer it came from. Child processes receive the parent's resolved configuration.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Dict, Mapping, Optional, Tuple

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Config", "ConfigError", "load", "current", "init"]

_CHOICES = {
    "backend": ("local",),
    "child_output": ("prefix", "off", "files"),
}
# Environment variables that roving sets for its own children; not options.
_INTERNAL_ENV = {"ROVING_CHILD"}


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names it and where it came from."""


@dataclasses.dataclass(frozen=True)
class Config:
    #: Which backend starts processes as jobs.
    backend: str = "local"
    #: Address this process's transport endpoint binds to. Loopback unless the backend needs more.
    host: str = "127.0.0.1"
    #: Address other processes use to reach this one, when it differs from ``host`` (NAT, 0.0.0.0).
    advertise: Optional[str] = None
    #: Where a child's stdout/stderr go: "prefix" (parent's terminal, each line prefixed with the
    #: process name), "off" (discarded) or "files" (one log file per process in ``log_dir``).
    child_output: str = "prefix"
    log_dir: str = "roving-logs"
    #: Seconds between a child's liveness checks of its parent.
    heartbeat_interval: float = 1.0
    #: A child whose parent has not answered for this many seconds exits.
    parent_timeout: float = 5.0
    #: Seconds to wait for a new connection to authenticate, and for a child to fetch its work.
    connect_timeout: float = 30.0

    def replace(self, source: str, **changes: Any) -> "Config":
        return dataclasses.replace(self, **_coerce(changes, source))


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _coerce(values: Mapping[str, Any], source: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in values.items():
        if key not in _FIELDS:
            known = ", ".join(sorted(_FIELDS))
            raise ConfigError(f"unknown roving option {key!r} (from {source}); known options: {known}")
        default = _FIELDS[key].default
        try:
            if isinstance(default, bool):
                value = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
            elif isinstance(default, float):
                value = float(value)
                if value <= 0:
                    raise ValueError("must be positive")
            elif isinstance(default, int):
                value = int(value)
            elif value is not None:
                value = str(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"bad value {value!r} for roving option {key!r} (from {source}): {exc}") from None
        if key in _CHOICES and value not in _CHOICES[key]:
            raise ConfigError(f"bad value {value!r} for roving option {key!r} (from {source}); "
                              f"choose one of {', '.join(_CHOICES[key])}")
        out[key] = value
    return out


def _file_layer(cwd: str) -> Tuple[Dict[str, Any], str]:
    path = os.path.join(cwd, "roving.toml")
    if os.path.exists(path):
        with open(path, "rb") as f:
            try:
                return tomllib.load(f), path
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    path = os.path.join(cwd, "pyproject.toml")
    if os.path.exists(path):
        with open(path, "rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError:
                return {}, path  # someone else's broken file is not ours to reject
        return data.get("tool", {}).get("roving", {}), f"[tool.roving] in {path}"
    return {}, ""


def load(overrides: Optional[Mapping[str, Any]] = None, cwd: Optional[str] = None,
         environ: Optional[Mapping[str, str]] = None) -> Config:
    """Resolve the configuration from defaults, file, environment and ``overrides``, in that order."""
    config = Config()
    values, source = _file_layer(cwd or os.getcwd())
    if values:
        config = config.replace(source, **values)
    env = os.environ if environ is None else environ
    from_env = {k[len("ROVING_"):].lower(): v for k, v in env.items()
                if k.startswith("ROVING_") and k not in _INTERNAL_ENV}
    for key, value in from_env.items():
        config = config.replace(f"environment variable ROVING_{key.upper()}", **{key: value})
    if overrides:
        config = config.replace("roving.init()", **overrides)
    return config


_current: Optional[Config] = None


def current() -> Config:
    """The configuration in force in this process (resolved on first use)."""
    global _current
    if _current is None:
        _current = load()
    return _current


def init(**options: Any) -> Config:
    """Set roving options for this process and the processes it starts from now on.

    Raises :class:`ConfigError` for an unknown option or a bad value; the configuration in force is then
    unchanged.
    """
    global _current
    _current = load(options)
    return _current


def _adopt(config: Config) -> None:
    """Used by a child: take the parent's resolved configuration."""
    global _current
    _current = config
