"""TensorFrame conversions: layouts, dtypes, writability, copies, and torch staying lazy."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

from protocol.errors import FrameTooLarge, MalformedMessage, ShapeMismatch
from protocol.tensor import DTYPES, TensorFrame

DTYPE_NAMES = sorted(DTYPES)


def _sample(dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return (torch.randn(shape) * 1000).to(getattr(torch, dtype))


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_from_tensor_fields(dtype):
    tensor = _sample(dtype, (3, 5))
    frame = TensorFrame.from_tensor(tensor)
    assert frame.dtype == dtype
    assert frame.shape == (3, 5)
    assert frame.compression == "none"
    assert frame.nbytes == len(frame.data) == tensor.numel() * tensor.element_size()
    assert frame.data == tensor.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_non_contiguous_and_grad_tensors(dtype):
    base = _sample(dtype, (4, 6))
    strided = base.t()[::2]  # transposed and sliced: not contiguous
    assert not strided.is_contiguous()
    assert torch.equal(TensorFrame.from_tensor(strided).to_tensor(), strided)
    if dtype.startswith(("float", "bfloat")):
        leaf = base.clone().requires_grad_(True)
        back = TensorFrame.from_tensor(leaf * 2).to_tensor()
        assert not back.requires_grad and torch.equal(back, base * 2)


def test_little_endian_layout():
    frame = TensorFrame.from_tensor(torch.tensor([1], dtype=torch.int32))
    assert frame.data == b"\x01\x00\x00\x00"
    frame = TensorFrame.from_tensor(torch.tensor([1.0], dtype=torch.bfloat16))
    assert frame.data == b"\x80\x3f"  # bf16 1.0 = 0x3F80


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1, 1, 1, 1)])
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_scalar_and_empty_shapes(dtype, shape):
    tensor = _sample(dtype, shape)
    frame = TensorFrame.from_tensor(tensor)
    assert frame.shape == shape
    back = frame.to_tensor()
    assert back.shape == tensor.shape and back.dtype == tensor.dtype
    assert torch.equal(back, tensor)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_to_tensor_is_writable_and_independent(dtype):
    frame = TensorFrame.from_tensor(_sample(dtype, (8,)))
    original = frame.data
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when wrapping a read-only buffer
        tensor = frame.to_tensor()
        tensor.add_(1)
    assert frame.data == original
    assert frame.to_tensor().add(1).equal(tensor)


def test_unsupported_tensors_are_type_errors():
    with pytest.raises(TypeError):
        TensorFrame.from_tensor(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TypeError):
        TensorFrame.from_tensor(torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(TypeError):
        TensorFrame.from_tensor([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        TensorFrame.from_tensor(torch.zeros(2, 2).to_sparse())


def test_to_tensor_validates_first():
    with pytest.raises(ShapeMismatch):
        TensorFrame("float32", (2,), b"\x00" * 4).to_tensor()
    with pytest.raises(MalformedMessage):
        TensorFrame("float64", (1,), b"\x00" * 8).to_tensor()
    with pytest.raises(ShapeMismatch):
        TensorFrame("int32", (-1,), b"").to_tensor()


def test_validate_checks_size_limit_from_shape():
    frame = TensorFrame("float32", (4, 4), b"\x00" * 64)
    frame.validate()
    from protocol.options import DecodeOptions

    with pytest.raises(FrameTooLarge):
        frame.validate(DecodeOptions(max_bytes=63))


def test_repr_does_not_dump_data():
    frame = TensorFrame.from_tensor(torch.zeros(1000))
    assert len(repr(frame)) < 120 and "4000 bytes" in repr(frame)


def test_import_protocol_does_not_import_torch():
    code = "import sys, protocol, protocol.messages; print('torch' in sys.modules, 'numpy' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]
