"""The base of homed objects (roving._homed): a kind registered with register_kind is made at this
process's home and served there through its handle; unknown kinds and operations are clear errors."""
from __future__ import annotations

import pytest

from roving import _homed


class _CounterState(_homed.State):
    def __init__(self, start: int) -> None:
        self.n = start

    def serve(self, home, method, w, timeout, args):
        if method == "add":
            self.n += args[0]
            return 0, self.n  # _rpc.OK
        return super().serve(home, method, w, timeout, args)


_homed.register_kind("test-counter", lambda home, start: _CounterState(start))


class Counter(_homed.Homed):
    _kind = "test-counter"

    def __init__(self, start: int) -> None:
        self._create(start)

    def add(self, n: int) -> int:
        return self._call("add", n)


def test_a_registered_kind_lives_at_this_processs_home_and_serves_its_operations():
    c = Counter(5)
    home = _homed.home()
    assert c._address == home.node.address
    assert isinstance(home.objects[c._id], _CounterState)
    assert c.add(2) == 7 and c.add(-10) == -3
    assert home.objects[c._id].n == -3


def test_an_unknown_operation_raises_at_the_caller_naming_it():
    c = Counter(0)
    with pytest.raises(ValueError, match="unknown operation 'nope'"):
        c._call("nope")
    assert c.add(1) == 1  # the object is still served


def test_an_unknown_kind_is_refused_by_the_home():
    class Stray(_homed.Homed):
        _kind = "no-such-kind"

    with pytest.raises(ValueError, match="unknown kind 'no-such-kind'"):
        Stray()._create()
    with pytest.raises(ValueError, match="unknown kind 'no-such-kind'"):  # also when made remotely
        Stray()._create(at=_homed.home().node.address)
