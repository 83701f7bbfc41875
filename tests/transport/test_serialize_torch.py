"""roving.transport.serialize with PyTorch: a CPU tensor travels out of band and comes back equal, dtype, shape
and requires_grad kept. Apart from test_serialize.py because torch's CPU build is there for the main
interpreter only (scripts/test-pythons.sh runs test_serialize.py on the other Pythons, not this file)."""
from __future__ import annotations

import pytest
import torch

from roving.transport.serialize import loads, dumps

BIG = 1 << 20  # well above OOB_THRESHOLD


def roundtrip(obj):
    frames = dumps(obj)
    # rebuild from copies, not from the sender's memory (received frames are writable, as zmq's are)
    return frames, loads([bytes(frames[0]), *(bytearray(f) for f in frames[1:])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool])
def test_torch_cpu_tensor_travels_out_of_band_and_keeps_dtype_and_shape(dtype):
    tensor = (torch.arange(BIG // 2) % 7).to(dtype).reshape(64, -1)
    frames, back = roundtrip(tensor)
    assert len(frames) == 2
    assert isinstance(back, torch.Tensor)
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_bfloat16_tensor_round_trip_is_bit_exact():
    tensor = torch.randn(512, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    _, back = roundtrip(tensor)
    assert back.dtype == torch.bfloat16
    assert torch.equal(back.view(torch.int16), tensor.view(torch.int16))


def test_non_contiguous_tensor_and_requires_grad_round_trip():
    tensor = torch.randn(256, 512).t()
    assert not tensor.is_contiguous()
    _, back = roundtrip(tensor)
    assert torch.equal(back, tensor)
    param = torch.randn(256, 256, requires_grad=True)
    _, back = roundtrip(param)
    assert back.requires_grad and torch.equal(back.detach(), param.detach())
