"""An object that cannot be pickled raises the error pickle raised, as multiprocessing does (TypeError,
RuntimeError, PicklingError...), from every call that pickles user data; it is a SerializationError too,
naming the object. The Pool and Process calls run on the local backend and on the real Slurm."""
from __future__ import annotations

import pickle
import threading

import pytest

import roving
from roving.transport.serialize import SerializationError
from helpers_backends import require
from helpers_core import TIMEOUT
from helpers_pool import square


class RefusesPickling:
    def __reduce__(self):
        raise RuntimeError("this object refuses to be pickled")


class PicklingErrorOnPickle:
    def __reduce__(self):
        raise pickle.PicklingError("no pickles here")


# (what cannot be pickled, the type multiprocessing's caller sees)
CASES = [(threading.Lock, TypeError), (RefusesPickling, RuntimeError), (PicklingErrorOnPickle, pickle.PicklingError)]


@pytest.fixture(params=["local", "slurm"])
def backend(request):
    require(request.param)
    roving.init(backend=request.param)
    return request.param


@pytest.fixture(scope="module")
def pools():
    made = {}
    yield made
    for pool in made.values():
        pool.terminate()
        pool.join(TIMEOUT)


@pytest.fixture
def pool(backend, pools):
    if backend not in pools:
        pools[backend] = roving.Pool(2)
    return pools[backend]


@pytest.mark.parametrize("make, kind", CASES)
def test_pool_map_raises_the_pickling_error_itself(pool, make, kind):
    with pytest.raises(kind) as info:
        pool.map(square, [1, make(), 3])
    assert isinstance(info.value, SerializationError)
    assert type(info.value.__cause__) is kind
    assert pool.map(square, [2, 3]) == [4, 9]  # the pool goes on


@pytest.mark.parametrize("make, kind", CASES)
def test_pool_apply_async_starmap_and_imap_raise_the_pickling_error_itself(pool, make, kind):
    with pytest.raises(kind):
        pool.apply_async(square, (make(),)).get(TIMEOUT)
    with pytest.raises(kind):
        pool.starmap(pow, [(2, 3), (make(), 2)])
    with pytest.raises(kind):
        list(pool.imap(square, [1, make()]))
    with pytest.raises(kind):
        pool.map_async(square, [make()]).get(TIMEOUT)


def test_pool_map_of_an_unpicklable_function_raises_the_pickling_error(pool):
    class Func:
        def __reduce__(self):
            raise RuntimeError("function refuses")

        def __call__(self, x):
            return x

    with pytest.raises(RuntimeError) as info:
        pool.map(Func(), [1])
    assert isinstance(info.value, SerializationError)


@pytest.mark.parametrize("make, kind", CASES)
def test_process_start_raises_the_pickling_error_itself_and_names_the_argument(backend, make, kind):
    proc = roving.Process(target=square, args=(make(),))
    with pytest.raises(kind, match="argument 0") as info:
        proc.start()
    assert isinstance(info.value, SerializationError)
    assert proc.pid is None


@pytest.mark.parametrize("make, kind", CASES)
def test_queue_put_and_pipe_send_raise_the_pickling_error_itself(make, kind):
    q = roving.Queue()
    with pytest.raises(kind):
        q.put(make())
    q.put(1)
    assert q.get(timeout=TIMEOUT) == 1
    a, b = roving.Pipe()
    with pytest.raises(kind):
        a.send(make())
    a.send(2)
    assert b.recv() == 2
    sq = roving.SimpleQueue()
    with pytest.raises(kind):
        sq.put(make())


def test_the_error_is_a_serialization_error_naming_the_object_and_pickles_as_its_type():
    q = roving.Queue()
    with pytest.raises(SerializationError, match="RefusesPickling") as info:
        q.put(RefusesPickling())
    again = pickle.loads(pickle.dumps(info.value))
    assert isinstance(again, RuntimeError) and isinstance(again, SerializationError)
    assert str(again) == str(info.value)
    # the traceback reads as multiprocessing's would: the type's name is the original's
    assert type(info.value).__name__ == "RuntimeError"


def test_manager_proxy_call_raises_the_pickling_error_itself():
    with roving.Manager() as manager:
        shared = manager.list()
        with pytest.raises(TypeError) as info:
            shared.append(threading.Lock())
        assert isinstance(info.value, SerializationError)
        with pytest.raises(RuntimeError):
            shared.append(RefusesPickling())
        shared.append(1)
        assert list(shared) == [1]
