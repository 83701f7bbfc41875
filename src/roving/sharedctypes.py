"""Value, Array, RawValue and RawArray shared between roving processes on any backend.

multiprocessing's are ctypes objects in shared memory, which processes on other machines cannot map.
roving's keep the ctypes object in the process that created it (its home: a homed object of
:mod:`roving._homed`, as the locks of :mod:`roving.synchronize` are) and every access is a round trip to it
(about 0.1 ms on one machine): reading
``.value`` or ``a[i]`` asks the home, writing sends the new value there. So a ``Value`` works the same
whether its users share a machine or not, at the price of a round trip per access: read a whole
``Array`` with ``a[:]`` (one round trip) rather than element by element. For large read-only data use
:func:`roving.shared`, which does map shared memory.

As in multiprocessing: ``Value``/``Array`` with ``lock=True`` (the default) come with a roving ``RLock``
(``get_lock()``, ``acquire()``, ``release()``, ``with v:``) that makes a read-modify-write like
``v.value += 1`` safe when done under it; ``lock=False`` gives the raw object, without a lock; a lock
object given as ``lock`` is used instead. ``get_obj()`` returns the raw object, which reads and writes
the same home.
"""
from __future__ import annotations

import ctypes
from multiprocessing.sharedctypes import typecode_to_type
from typing import Any, Iterator, Literal, Optional, Protocol, Sequence, Tuple, Union, overload

from .transport import rpc as _rpc
from . import synchronize as _sync
from ._homed import Answer, Home, Homed, State, Waiter, register_kind

__all__ = ["RawValue", "RawArray", "Value", "Array"]

TypeSpec = Union[str, type]


def _ctype(typecode_or_type: TypeSpec) -> type:
    if isinstance(typecode_or_type, str):
        try:
            return typecode_to_type[typecode_or_type]
        except KeyError:
            raise TypeError(f"unknown typecode {typecode_or_type!r}; use one of "
                            f"{''.join(sorted(typecode_to_type))} or a ctypes type") from None
    if isinstance(typecode_or_type, type) and issubclass(typecode_or_type, ctypes._SimpleCData):
        return typecode_or_type
    raise TypeError(f"expected a typecode or a simple ctypes type, not {typecode_or_type!r}")


def _remote(name: str) -> property:
    """An attribute of the ctypes object, read and written at its home (one round trip each)."""
    return property(lambda self: self._op("get", name), lambda self, v: self._op("set", name, v),
                    doc=f"The ctypes object's ``{name}``, read or written at its home.")


def _wrapped(name: str) -> property:
    """The same attribute of the wrapped raw object."""
    return property(lambda self: getattr(self._obj, name), lambda self, v: setattr(self._obj, name, v),
                    doc=f"The wrapped object's ``{name}``.")


class _Cell(State):
    """A ctypes object at its home; its one operation, ``ctype``, is (what, *arguments) on it."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def serve(self, home: Home, method: str, w: Waiter, timeout: float, args: Tuple[Any, ...]) -> Answer:
        if method == "ctype":
            return _rpc.OK, _ctype_op(self.obj, *args)
        return super().serve(home, method, w, timeout, args)


def _ctype_op(obj: Any, op: str, *args: Any) -> Any:
    if op == "get":
        return getattr(obj, args[0])
    if op == "set":
        setattr(obj, args[0], args[1])
        return None
    if op == "getitem":
        return obj[args[0]]
    if op == "setitem":
        obj[args[0]] = args[1]
        return None
    if op == "len":
        return len(obj)
    if op == "copy":
        return bytes(memoryview(obj).cast("B")), type(obj)
    raise ValueError(f"unknown operation {op!r}")


register_kind("ctype", lambda home, obj: _Cell(obj))


class _Raw(Homed):
    """A ctypes object homed at the process that created it."""

    _kind = "ctype"

    def __init__(self, obj: Any) -> None:
        self._create(obj)
        self._type_name = type(obj).__name__

    def _op(self, *args: Any) -> Any:
        return self._call("ctype", *args)


class RawValue(_Raw):
    """A ctypes value without a lock; ``.value`` reads or writes it at its home."""

    def __init__(self, typecode_or_type: TypeSpec, *args: object) -> None:
        super().__init__(_ctype(typecode_or_type)(*args))

    value = _remote("value")

    def __repr__(self) -> str:
        return f"{self._type_name}({self.value!r})"


class RawArray(_Raw):
    """A ctypes array without a lock: indexing, slicing and ``len`` as a ctypes array."""

    def __init__(self, typecode_or_type: TypeSpec, size_or_initializer: Union[int, Sequence[object]]) -> None:
        ctype = _ctype(typecode_or_type)
        if isinstance(size_or_initializer, int):
            if size_or_initializer < 0:
                raise ValueError("array size must be >= 0")
            obj = (ctype * size_or_initializer)()
        else:
            values = list(size_or_initializer)
            obj = (ctype * len(values))(*values)
        self._length = len(obj)
        super().__init__(obj)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, key: Union[int, slice]) -> Any:
        return self._op("getitem", key)

    def __setitem__(self, key: Union[int, slice], value: Any) -> None:
        self._op("setitem", key, value)

    def __iter__(self) -> Iterator[Any]:
        return iter(self[:])

    # c_char arrays: .value and .raw as in ctypes
    value = _remote("value")

    raw = _remote("raw")

    def __repr__(self) -> str:
        return f"<RawArray {self._type_name} {self[:]!r}>"


class _Synchronized:
    """A raw object with a lock, as multiprocessing's Synchronized wrappers."""

    def __init__(self, obj: _Raw, lock: Any) -> None:
        self._obj, self._lock = obj, lock
        self.acquire, self.release = lock.acquire, lock.release

    def __getstate__(self) -> tuple:
        return self._obj, self._lock

    def __setstate__(self, state: tuple) -> None:
        self.__init__(*state)

    def __enter__(self) -> bool:
        return self._lock.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._lock.__exit__(*exc)

    def get_obj(self) -> _Raw:
        return self._obj

    def get_lock(self) -> Any:
        return self._lock

    def __repr__(self) -> str:
        return f"<{type(self).__name__} wrapper for {self._obj!r}>"


class Synchronized(_Synchronized):
    value = _wrapped("value")


class SynchronizedArray(_Synchronized):
    def __len__(self) -> int:
        return len(self._obj)

    def __getitem__(self, key: Union[int, slice]) -> Any:
        return self._obj[key]

    def __setitem__(self, key: Union[int, slice], value: Any) -> None:
        self._obj[key] = value

    def __iter__(self) -> Iterator[Any]:
        return iter(self._obj[:])

    value = _wrapped("value")

    raw = _wrapped("raw")


def _lock_for(lock: Any) -> Optional[Any]:
    if lock is False:
        return None
    if lock in (True, None):
        return _sync.RLock()
    if not hasattr(lock, "acquire"):
        raise AttributeError(f"{lock!r} has no method 'acquire'")
    return lock


class LockLike(Protocol):
    """What ``Value`` and ``Array`` take as their ``lock``: anything with ``acquire`` and ``release``."""

    def acquire(self, block: bool = True, timeout: float = -1) -> bool: ...

    def release(self) -> None: ...


@overload
def Value(typecode_or_type: TypeSpec, *args: object, lock: Literal[False], ctx: object = None) -> RawValue: ...


@overload
def Value(typecode_or_type: TypeSpec, *args: object, lock: Union[Literal[True], None, LockLike] = True,
          ctx: object = None) -> Synchronized: ...


def Value(typecode_or_type: TypeSpec, *args: object, lock: object = True,
          ctx: object = None) -> Union[RawValue, Synchronized]:
    """A shared ctypes value, with a lock unless ``lock=False``; see :func:`multiprocessing.Value`."""
    obj = RawValue(typecode_or_type, *args)
    lock = _lock_for(lock)
    return obj if lock is None else Synchronized(obj, lock)


@overload
def Array(typecode_or_type: TypeSpec, size_or_initializer: Union[int, Sequence[object]], *,
          lock: Literal[False], ctx: object = None) -> RawArray: ...


@overload
def Array(typecode_or_type: TypeSpec, size_or_initializer: Union[int, Sequence[object]], *,
          lock: Union[Literal[True], None, LockLike] = True, ctx: object = None) -> SynchronizedArray: ...


def Array(typecode_or_type: TypeSpec, size_or_initializer: Union[int, Sequence[object]], *,
          lock: object = True, ctx: object = None) -> Union[RawArray, SynchronizedArray]:
    """A shared ctypes array, with a lock unless ``lock=False``; see :func:`multiprocessing.Array`."""
    obj = RawArray(typecode_or_type, size_or_initializer)
    lock = _lock_for(lock)
    return obj if lock is None else SynchronizedArray(obj, lock)
