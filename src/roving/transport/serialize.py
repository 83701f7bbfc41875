"""Turning Python objects into ZeroMQ frames and back.

A message is a list of frames: the pickle stream (protocol 5) followed by one frame per out-of-band
buffer. Large buffers — numpy arrays, bytearray, memoryview, large bytes, PyTorch CPU tensors — are
never copied into the pickle stream: their memory is handed to ZeroMQ as a frame of its own and, on the
receiving side, the object is rebuilt on top of the received frame.

Functions, lambdas and classes defined in ``__main__``, interactively or inside another function cannot be
pickled by reference; they are pickled by value with cloudpickle. Everything else goes through the
standard C pickler, which is several times faster.
"""
from __future__ import annotations

import io
import pickle
import threading
import types
from typing import Any, Dict, List, Sequence

import cloudpickle

from .errors import SerializationError

__all__ = ["dumps", "loads", "OOB_THRESHOLD", "SerializationError", "serialization_error"]

#: Buffers at least this large travel as frames of their own; smaller ones stay inside the pickle.
OOB_THRESHOLD = 64 * 1024


_error_types: Dict[type, type] = {}
_error_types_lock = threading.Lock()


def _error_type(kind: type) -> type:
    """A subclass of both SerializationError and ``kind``, named as ``kind`` (so a traceback reads as
    multiprocessing's would); SerializationError itself when no such class can be made."""
    if issubclass(kind, SerializationError):
        return kind
    with _error_types_lock:
        made = _error_types.get(kind)
        if made is None:
            try:
                made = type(kind.__name__, (SerializationError, kind),
                            {"__module__": kind.__module__, "__qualname__": kind.__qualname__,
                             "__reduce__": _reduce_error, "_original_type": kind})
            except TypeError:  # a layout that cannot be combined, a final type
                made = SerializationError
            _error_types[kind] = made
        return made


def _reduce_error(self: BaseException) -> Any:
    return _rebuild_error, (getattr(type(self), "_original_type"), self.args)  # noqa: B009  (set by _error_type)


def _rebuild_error(kind: type, args: tuple) -> BaseException:
    return _error_type(kind)(*args)


def serialization_error(message: str, original: BaseException) -> SerializationError:
    """The error for an object that could not be pickled: a SerializationError with ``message`` that is
    also an instance of ``type(original)`` (what pickle raised: TypeError, PicklingError, RuntimeError,
    ...), with ``original`` as its cause. Every call of roving that pickles user data raises this."""
    try:
        exc = _error_type(type(original))(message)
    except Exception:  # a type whose constructor wants other arguments
        exc = SerializationError(message)
    exc.__cause__ = original
    return exc


def _by_value(obj: Any) -> bool:
    """True for functions and classes that pickle-by-reference could not find again in another process."""
    module = getattr(obj, "__module__", None)
    if module == "__main__" or module is None and isinstance(obj, types.FunctionType):
        return True
    qualname = getattr(obj, "__qualname__", "")
    return "<locals>" in qualname or "<lambda>" in qualname


def _rebuild_bytes(buf: memoryview) -> bytes:
    return bytes(buf)


def _rebuild_bytearray(buf: memoryview) -> bytearray:
    return bytearray(buf)


class _Raw:
    """A top-level bytes or bytearray, so that its memory goes out of band.

    The C pickler writes bytes and bytearray objects in band without asking ``reducer_override``; only a
    top-level one can be given a frame of its own (nested ones are copied into the stream).
    """

    __slots__ = ("data",)

    def __init__(self, data: Any) -> None:
        self.data = data

    def __reduce__(self) -> Any:
        rebuild = _rebuild_bytes if type(self.data) is bytes else _rebuild_bytearray
        return rebuild, (pickle.PickleBuffer(self.data),)


def _rebuild_memoryview(buf: memoryview, fmt: str, shape: tuple) -> memoryview:
    view = memoryview(buf).cast("B")
    return view.cast(fmt, shape) if shape else view.cast(fmt)  # type: ignore[call-overload]  # any format


def _rebuild_ndarray(buf: Any, dtype: str, shape: tuple) -> Any:
    import numpy

    return numpy.frombuffer(buf, dtype=dtype).reshape(shape)


def _reduce_ndarray(array: Any) -> Any:
    """Plain-dtype arrays, reduced directly: faster than numpy's own path for small arrays, and the
    data goes out of band for large ones."""
    dtype = array.dtype
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None or type(array) is not _ndarray:
        return NotImplemented
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    return _rebuild_ndarray, (pickle.PickleBuffer(array), dtype.str, array.shape)


_ndarray: Any = None  # numpy.ndarray, once numpy has been imported by someone


def _rebuild_tensor(array: Any, dtype_name: str, shape: tuple, requires_grad: bool) -> Any:
    import torch

    dtype = getattr(torch, dtype_name)
    tensor = torch.from_numpy(array)
    if tensor.dtype != dtype:  # bfloat16 and friends travel as raw bytes
        tensor = tensor.view(dtype)
    tensor = tensor.reshape(shape)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def _reduce_tensor(tensor: Any) -> Any:
    """A dense CPU tensor as a numpy array over the same memory, so its data goes out of band."""
    if tensor.device.type != "cpu" or tensor.layout.__repr__() != "torch.strided" or tensor.is_quantized:
        return NotImplemented
    data = tensor.detach()
    if not data.is_contiguous():
        data = data.contiguous()
    try:
        array = data.numpy()
    except (TypeError, RuntimeError):  # dtypes numpy lacks (bfloat16, float8): ship raw bytes
        import torch

        array = data.reshape(-1).view(torch.uint8).numpy()
    dtype_name = str(tensor.dtype).rsplit(".", 1)[1]
    return _rebuild_tensor, (array, dtype_name, tuple(tensor.shape), tensor.requires_grad)


# The globals that every function of the parent's ``__main__`` shares in this process. multiprocessing's
# spawned children re-import the main script, so all its functions see one module namespace: what a
# Pool initializer sets is what the task function reads. Functions that arrive by value get the same.
_main_globals: Dict[str, Any] = {"__name__": "__main__"}


def _load_main_function(data: bytes) -> types.FunctionType:
    """Rebuild a ``__main__`` function so that it shares this process's one ``__main__`` namespace.

    A name already in that namespace keeps its value here (the first value to arrive, or whatever code in
    this process set it since); new names are added. The function and the ``__main__`` functions that
    came with it are rebound to the shared namespace.
    """
    func = cloudpickle.loads(data)
    arrived = func.__globals__
    if arrived is _main_globals:
        return func
    rebound: Dict[int, types.FunctionType] = {}

    def rebind(f: types.FunctionType) -> types.FunctionType:
        if f.__globals__ is not arrived:
            return f
        if id(f) not in rebound:
            new = types.FunctionType(f.__code__, _main_globals, f.__name__, f.__defaults__, f.__closure__)
            new.__kwdefaults__ = f.__kwdefaults__
            new.__qualname__ = f.__qualname__
            new.__module__ = f.__module__
            new.__dict__.update(f.__dict__)
            new.__annotations__ = f.__annotations__
            rebound[id(f)] = new
        return rebound[id(f)]

    for name, value in arrived.items():
        if isinstance(value, types.FunctionType):
            value = rebind(value)
        current = _main_globals.get(name)
        if name not in _main_globals or (isinstance(current, types.FunctionType)
                                         and current.__globals__ is not _main_globals):
            _main_globals[name] = value
    return rebind(func)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        global _ndarray
        kind = type(obj)
        if kind is _ndarray:
            return _reduce_ndarray(obj)
        if _ndarray is None and kind.__name__ == "ndarray" and kind.__module__ == "numpy":
            _ndarray = kind
            return _reduce_ndarray(obj)
        if kind is memoryview:
            if not obj.contiguous:
                obj = memoryview(obj.tobytes())
            return _rebuild_memoryview, (pickle.PickleBuffer(obj), obj.format, obj.shape)
        if isinstance(obj, (types.FunctionType, type)) and _by_value(obj):
            if kind is types.FunctionType and getattr(obj, "__module__", None) == "__main__":
                return _load_main_function, (cloudpickle.dumps(obj, protocol=5),)
            return cloudpickle.loads, (cloudpickle.dumps(obj, protocol=5),)
        if kind.__module__ == "torch" and kind.__name__ in ("Tensor", "Parameter"):
            return _reduce_tensor(obj)
        return NotImplemented


def dumps(obj: Any) -> List[Any]:
    """Serialize ``obj`` into frames: ``[pickle_stream, buffer, buffer, ...]``.

    Buffers smaller than :data:`OOB_THRESHOLD` are folded back into the stream. The returned buffers
    share memory with ``obj``: do not mutate ``obj`` until the frames have been sent.

    Raises :class:`SerializationError` naming the object when it cannot be pickled.
    """
    buffers: List[pickle.PickleBuffer] = []

    def keep(buf: pickle.PickleBuffer) -> bool:
        view = buf.raw()
        if view.nbytes < OOB_THRESHOLD:
            return True  # serialize in band
        buffers.append(buf)
        return False

    if type(obj) in (bytes, bytearray) and len(obj) >= OOB_THRESHOLD:
        obj = _Raw(obj)
    stream = io.BytesIO()
    try:
        _Pickler(stream, protocol=5, buffer_callback=keep).dump(obj)
    except Exception as exc:  # pickle raises TypeError, AttributeError, PicklingError...
        raise serialization_error(f"cannot pickle {_describe(obj)}: {exc}", exc) from exc
    # getvalue(), not getbuffer(): the same bytes without a copy, and no view of the BytesIO left to
    # outlive it. The garbage collector freeing such a view in a reference cycle crashed CPython 3.12.0 and
    # 3.12.1 (gh-111049) and, from 3.12.2, reports "BufferError: Existing exports of data" from the BytesIO.
    return [stream.getvalue(), *(b.raw() for b in buffers)]


def loads(frames: Sequence[Any]) -> Any:
    """Rebuild an object from frames made by :func:`dumps`. Out-of-band data is not copied."""
    return pickle.loads(frames[0], buffers=frames[1:])  # noqa: S301  (frames of authenticated peers only: the node drops the others)


def _describe(obj: Any) -> str:
    text = repr(obj)
    if len(text) > 200:
        text = text[:200] + "..."
    return f"{type(obj).__qualname__} object {text}"
