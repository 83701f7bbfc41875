"""The packed layouts of ``Forward``, ``Backward``, ``Gradients`` (``runtime/packed_tensors.py``) and ``Ready``
(``runtime/packed_ready.py``): read back as the JSON form reads them, every check of the JSON form made,
and a header that does not fit refused, naming what, its writer caught."""
from __future__ import annotations

import queue
import struct

import pytest
import torch

import roving
from helpers_core import TIMEOUT
import helpers_untrusted as hu
from roving.pipeline import protocol as m
from roving.pipeline.planning.plan import Route
from roving.pipeline.runtime import codec, mail
from roving.pipeline.runtime.packed import MARK
from roving.pipeline.verify.receipts import Receipt
from roving.pipeline.verify.tensor_id import TensorId
from roving.transport.postbox import PostboxAddress

_ROUTE = Route("n0", ("n1", "n2", "n3"), (1, 2, 3))
_REST = ("dtype", "dims", "hops", "receipt", "digest", "mac", "text")
_FIELDS = {3: ("mark", "tag", "round", "mb", "hop", *_REST), 2: ("mark", "tag", "round", "count", *_REST)}
_FIXED = {3: struct.Struct("<BBqqqBBHBHHI"), 2: struct.Struct("<BBqqBBHBHHI")}


def _receipt(sender: str = "n1", what: str = "activation") -> Receipt:
    return Receipt(TensorId(4, what, 2, 1, sender), b"d" * 32, b"m" * 32)


def _forward(**kw) -> m.Forward:
    args = dict(round=4, sender="n1", mb=2, hop=1, tensor=torch.randn(2, 3, 5), route=_ROUTE, receipt=_receipt())
    return m.Forward(**{**args, **kw})


def _samples() -> list[m.Message]:
    return [_forward(), _forward(tensor=torch.randn(2, 3, dtype=torch.bfloat16), receipt=None),
            _forward(tensor=torch.zeros(0, 4)), _forward(route=Route("n0", (), ())),
            m.Backward(4, "n1", 2, 0, torch.ones(3, 4, dtype=torch.float16), _ROUTE, _receipt(what="gradient")),
            m.Backward(4, "n1", 2, -1, torch.tensor([True, False]), Route("ü", ("n1",), (1,)), None),
            m.Gradients(4, "n1", torch.randn(10), 3, _receipt(what="share")), m.Gradients(4, "n1", torch.ones(5))]


def _same(a: m.Message, b: m.Message) -> bool:
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, torch.Tensor):
            if not (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)):
                return False
        elif repr(x) != repr(y):
            return False
    return type(a) is type(b)


def test_forward_backward_and_gradients_are_written_packed_and_read_back_as_the_json_form_reads_them():
    for msg in _samples():
        frames = codec.encode(msg)
        assert len(frames) == 2 and frames[0][0] == MARK, msg
        back, as_json = codec.decode(frames, "n1"), codec.decode(codec.encode(msg, json_only=True), "n1")
        assert _same(back, msg) and _same(back, as_json), (back, msg)
        assert type(back.receipt) is type(msg.receipt) and back.receipt == msg.receipt


@pytest.mark.parametrize("msg", [
    _forward(route=Route("n0", ("n\0x",), (1,))),                  # a NUL in a name
    _forward(route=Route("n0", ["n1"], [1])),                       # a route of lists
    _forward(mb=1 << 70),                                           # beyond int64
    _forward(receipt={"id": 1}),                                     # a receipt that is not one
    _forward(tensor=[1.0, 2.0]),                                     # a tensor that is not one
    m.Gradients(4, "n1", torch.ones(2), True),                       # a bool where a count goes
])
def test_a_message_of_a_shape_the_packed_layout_does_not_carry_goes_as_json_and_is_judged_as_before(msg):
    frames = codec.encode(msg)
    assert bytes(frames[0][:1]) == b"["
    assert bytes(frames[0]) == bytes(codec.encode(msg, json_only=True)[0])


def _forged(msg: m.Message, tail: dict | None = None, swap: tuple[bytes, bytes] = (b"", b""), **fixed) -> list:
    """``msg``'s packed frames, its fixed fields (``_FIELDS``' names) and its shape-and-stages numbers (``tail``, by
    place) changed, ``swap[0]`` replaced by ``swap[1]`` in the rest of its header."""
    head, buf = codec.encode(msg)
    ints = 3 if isinstance(msg, (m.Forward, m.Backward)) else 2
    layout, names = _FIXED[ints], _FIELDS[ints]
    values = dict(zip(names, layout.unpack_from(head)))
    count = values["dims"] + values["hops"] + 3 * values["receipt"]
    numbers = list(struct.unpack_from(f"<{count}q", head, layout.size))
    rest = head[layout.size:]
    for i, v in (tail or {}).items():
        numbers[i] = v
    rest = struct.pack(f"<{len(numbers)}q", *numbers) + rest[8 * len(numbers):] if tail else rest
    values.update(fixed)
    return [layout.pack(*values.values()) + rest.replace(*swap), buf]


def _letters() -> dict[str, tuple[list, str]]:
    good = codec.encode(_forward())
    return {
        "a dtype of no place": (_forged(_forward(), dtype=200), "dtype 200"),
        "more dimensions than the wire allows": (_forged(_forward(), dims=9), "9 dimensions"),
        "a negative size": (_forged(_forward(tensor=torch.ones(2, 3)), tail={0: -1, 1: -6}), "negative"),
        "a shape over the bytes it carries": (_forged(_forward(), tail={0: 1 << 40, 1: 1 << 40}), "it takes"),
        "a dtype that does not fit the bytes": (_forged(_forward(), dtype=3), "float64 tensor"),
        "a truncated tensor buffer": ([good[0], bytes(good[1])[:-4]], "it takes"),
        "a truncated header": ([good[0][:-1], good[1]], "whose parts take"),
        "a header shorter than its fixed part": ([good[0][:20], good[1]], "at least"),
        "a header claiming more text than it carries": (_forged(_forward(), text=400), "whose parts take"),
        "a header claiming a longer digest": (_forged(_forward(), digest=64), "whose parts take"),
        "a round below -1": (_forged(_forward(), round=-5), "round: -5"),
        "a hop beyond the bound": (_forged(_forward(), hop=1 << 41), "hop"),
        "a stage below -1": (_forged(_forward(), tail={3: -7}), "not a whole number"),
        "a receipt's kind of no name": (_forged(_forward(), swap=(b"activation", b"activatioX")), "not what a tensor"),
        "a receipt of another node": (codec.encode(_forward(receipt=_receipt("n2"))), "receipt of 'n2'"),
        "a name that is not UTF-8": (_forged(_forward(), swap=(b"n0\0", b"\xff0\0")), "UTF-8"),
        "a NUL more than its names": (_forged(_forward(), swap=(b"n0\0", b"\0\0\0")), "names for a route"),
        "a receipt flag of 2": (_forged(_forward(), receipt=2), "receipt 2"),
        "a route on a Gradients": (_forged(m.Gradients(4, "n1", torch.ones(2), 1), hops=1), "it has none"),
        "a count below -1": (_forged(m.Gradients(4, "n1", torch.ones(2), 1), count=-9), "count: -9"),
        "a tag of no kind": (_forged(_forward(), tag=250), "no kind"),
        "a buffer more": ([*good, b"x"], "2 buffer"),
        "no buffer": ([good[0]], "0 buffer"),
    }


@pytest.mark.parametrize("why", list(_letters()))
def test_a_packed_header_that_does_not_fit_is_refused_naming_what(why):
    letter, says = _letters()[why]
    with pytest.raises(codec.Malformed, match=says):
        codec.decode(letter, "n1")


def _from_untrusted(letters: list) -> tuple[list, dict]:
    """Have an untrusted child send ``letters``; what an inbox that knows it as ``n1`` makes of them."""
    directory = mail.Directory()
    inbox = mail.Inbox(directory)
    p = roving.Process(target=hu.send_letters, args=(inbox.address, letters), trusted=False, daemon=True)
    p.start()
    directory.add(p.node_id, "n1")
    p.join(TIMEOUT)
    assert p.exitcode == 0
    got = []
    while True:
        try:
            got.append(inbox.get(timeout=0))
        except queue.Empty:
            break
    return got, inbox.refused()


def test_an_untrusted_node_that_sends_forged_packed_headers_is_caught_for_each_and_its_good_one_read():
    """Forged Forward, Backward, Gradients and Ready headers, then an honest Forward, from a real untrusted
    child: the honest one read in its name, each forged one counted against it."""
    letters = [[bytes(f) for f in letter] for letter, _ in _letters().values()]
    letters += [_ready(claim=100), _ready(box=1 << 41)]
    honest = _forward()
    got, refused = _from_untrusted([*letters, [bytes(f) for f in codec.encode(honest)]])
    assert len(got) == 1 and _same(got[0], honest), got
    assert refused["n1"][0] == len(letters), refused


_READY = struct.Struct("<BBqqI")


def _ready(incarnation: int = 0, box: int = 3, node: bytes = b"tcp://127.0.0.1:5000", claim: int = -1) -> list:
    tag = codec.encode(m.Ready("n1", 0, PostboxAddress("x", 0)))[0][1]
    return [_READY.pack(MARK, tag, incarnation, box, len(node) if claim < 0 else claim) + node]


def test_a_ready_is_written_packed_and_reads_back_as_sent_and_of_another_shape_goes_as_json():
    msg = m.Ready("n1", 2, PostboxAddress("tcp://127.0.0.1:5000", 7))
    frames = codec.encode(msg)
    assert len(frames) == 1 and frames[0][0] == MARK
    back = codec.decode(frames, "n1")
    assert back == msg and back == codec.decode(codec.encode(msg, json_only=True), "n1")
    for other in (m.Ready("n1", 2, ("tcp://x", 7)), m.Ready("n1", 2, PostboxAddress("x", True)),
                  m.Ready("n1", 1 << 70, PostboxAddress("x", 1))):
        assert bytes(codec.encode(other)[0][:1]) == b"["


@pytest.mark.parametrize("frames, says", [
    (_ready(incarnation=-2), "incarnation -2"),
    (_ready(box=1 << 41), "mailbox"),
    (_ready(claim=100), "whose parts take"),
    ([_ready()[0][:-1]], "whose parts take"),
    ([_ready()[0][:10]], "at least"),
    (_ready(node=b"\xff\xfe"), "not UTF-8"),
    (_ready(node=b"x" * 4097), "more than 4096"),
])
def test_a_packed_ready_that_does_not_fit_is_refused_naming_what(frames, says):
    with pytest.raises(codec.Malformed, match=says):
        codec.decode(frames, "n1")
