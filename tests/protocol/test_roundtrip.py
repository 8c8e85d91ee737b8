"""Property tests: every message type and every dtype survives encode -> decode unchanged."""

from __future__ import annotations

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import PROTOCOL_VERSION, decode, encode
from protocol.messages import ActivationMessage, MicrobatchId
from protocol.registry import registered_messages
from protocol.tensor import DTYPES, TensorFrame

from .strategies import MESSAGE_STRATEGIES, tensor_frames

#: Enough examples to hit empty/zero-size/nested corners, few enough for two shared slow cores;
#: no deadline because timing on a loaded CI box is not what these tests check.
ROUNDTRIP = settings(max_examples=60, deadline=None)

CORE_MESSAGES = sorted(MESSAGE_STRATEGIES, key=lambda cls: cls.TYPE)


def test_every_core_message_type_has_a_strategy():
    core = {cls for cls in registered_messages().values() if cls.__module__ == "protocol.messages"}
    assert core == set(MESSAGE_STRATEGIES)


@pytest.mark.parametrize("cls", CORE_MESSAGES, ids=lambda cls: cls.TYPE)
@ROUNDTRIP
@given(data=st.data())
def test_message_roundtrip(cls, data):
    msg = data.draw(MESSAGE_STRATEGIES[cls])
    wire = encode(msg)
    back = decode(wire, expect=cls)
    assert type(back) is cls
    assert back == msg
    assert encode(back) == wire  # deterministic: re-encoding gives the same bytes


@ROUNDTRIP
@given(msg=st.one_of(*MESSAGE_STRATEGIES.values()))
def test_envelope_layout(msg):
    envelope = msgpack.unpackb(encode(msg), raw=False)
    assert set(envelope) == {"v", "t", "b"}
    assert envelope["v"] == PROTOCOL_VERSION
    assert envelope["t"] == type(msg).TYPE


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@ROUNDTRIP
@given(data=st.data())
def test_frame_bytes_roundtrip_through_torch(dtype, data):
    """Any bit pattern (NaN payloads, subnormals, -0.0) survives frame -> tensor -> frame exactly."""
    frame = data.draw(tensor_frames(dtype))
    tensor = frame.to_tensor()
    assert tuple(tensor.shape) == frame.shape
    assert str(tensor.dtype) == f"torch.{dtype}"
    assert TensorFrame.from_tensor(tensor) == frame
    assert TensorFrame.from_bytes(frame.to_bytes()) == frame


_TORCH_VALUES = {
    "float32": st.floats(width=32, allow_nan=False),
    "float16": st.floats(width=16, allow_nan=False),
    "bfloat16": st.floats(-1e30, 1e30, allow_nan=False),  # rounded to bf16 by torch below
    "int64": st.integers(-(2**63), 2**63 - 1),
    "int32": st.integers(-(2**31), 2**31 - 1),
}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@ROUNDTRIP
@given(data=st.data())
def test_tensor_roundtrip_inside_activation(dtype, data):
    values = data.draw(st.lists(_TORCH_VALUES[dtype], max_size=24))
    cols = data.draw(st.sampled_from([1, 2, 3]))
    values = values[: len(values) // cols * cols]
    tensor = torch.tensor(values, dtype=getattr(torch, dtype)).reshape(-1, cols)
    mb = MicrobatchId(run_id="run", epoch=1, iteration=2, data_node="d", index=3)
    msg = ActivationMessage(mb=mb, hop=1, route=("d", "p", "d"), tensor=TensorFrame.from_tensor(tensor))
    back = decode(encode(msg)).tensor.to_tensor()
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)
