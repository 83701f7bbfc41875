"""The coordinator's one reader of its control inbox (``pipeline.dispatch``): every message read goes to
its type's handler whoever is waiting, so an answer for the verifier read while the trainer waits for
its own messages reaches the verifier, and the other way round; each type has one handler."""

import collections

import pytest

from roving.pipeline import protocol as m
from roving.pipeline.dispatch import Dispatch
from roving.pipeline.errors import NoMessage


class Queue:
    """A source that gives its messages in order, of the kinds and round asked for (as the roster does,
    which drops the rest), and NoMessage when none is left."""

    def __init__(self, *msgs: m.Message) -> None:
        self.msgs = collections.deque(msgs)
        self.asked: list[tuple] = []

    def recv(self, kind, timeout=None, rnd=None):
        self.asked.append(kind)
        while self.msgs:
            msg = self.msgs.popleft()
            if isinstance(msg, kind) and (rnd is None or msg.round == rnd):
                return msg
        raise NoMessage("nothing left")


def test_a_message_read_while_another_handler_waits_reaches_its_own_handler_and_none_is_dropped():
    source = Queue(m.Rechecked(3, "b", 1, 0.0), m.Done(3, "a", 0, 1.5), m.Norm(3, "c", 1, 2.0),
                   m.WeightsShown(3, "d", 1, {}), m.Done(3, "a", 1, 1.25))
    d = Dispatch(source)
    trainer: list[m.Message] = []
    verifier: list[m.Message] = []
    d.on((m.Done, m.Norm), trainer.append)
    d.on((m.Rechecked, m.WeightsShown), verifier.append)
    d.until(lambda: sum(isinstance(x, m.Done) for x in trainer) == 2, rnd=3)
    assert [type(x) for x in trainer] == [m.Done, m.Norm, m.Done]
    assert [type(x) for x in verifier] == [m.Rechecked, m.WeightsShown], "the verifier's answers reached it"
    assert all(set(kinds) == {m.Done, m.Norm, m.Rechecked, m.WeightsShown} for kinds in source.asked)


def test_until_reads_nothing_when_its_condition_holds_and_raises_what_its_source_raises():
    source = Queue(m.Done(0, "a", 0, 1.0))
    d = Dispatch(source)
    got: list[m.Message] = []
    d.on(m.Done, got.append)
    d.until(lambda: True)
    assert source.asked == [] and got == []
    d.until(lambda: bool(got))
    with pytest.raises(NoMessage):
        d.until(lambda: False)


def test_a_type_given_a_second_handler_is_refused_naming_it():
    d = Dispatch(Queue())
    d.on(m.Done, lambda msg: None)
    with pytest.raises(ValueError, match="Done messages are handled already"):
        d.on((m.Norm, m.Done), lambda msg: None)
    assert d.kinds == (m.Done,), "nothing of a refused registration is kept"
