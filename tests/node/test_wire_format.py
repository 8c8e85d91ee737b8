"""``--wire``: the data plane sends hop tensors under the run's codec, the guard accepts only that codec,
the frames really shrink (what the link emulation and cost model count), and the run configuration
that members compare includes precision and wire format."""

from __future__ import annotations

import asyncio
import types

import pytest
import torch

import node.compat  # noqa: F401  (before hivemind)
from node.dataplane.guard import WRONG_COMPRESSION, MicrobatchGuard, compressions_for_wire
from node.dataplane.transport import DataPlane
from protocol import decode, encode
from protocol.compression import wire_bytes_per_element
from protocol.tensor import TensorFrame
from tests.node.hostile_peer import activation, gradient

RUN = "wire-test"
SHAPE = (2, 4, 300)
ME, PREV, NEXT, DATA = "me", "prev", "next", "data"
ROUTE = (DATA, PREV, ME, NEXT, DATA)


def _guard(wire: str) -> MicrobatchGuard:
    return MicrobatchGuard(run_id=RUN, hidden_shape=SHAPE, position=lambda: (0, 0), self_id=ME,
                           compressions=compressions_for_wire(wire))


def _frame(codec: str) -> TensorFrame:
    return TensorFrame.from_tensor(torch.randn(SHAPE), compression=codec)


@pytest.mark.parametrize("wire,codec", [("fp32", "none"), ("bf16", "bf16"), ("fp16", "fp16"), ("int8", "int8")])
def test_guard_accepts_exactly_the_runs_codec(wire, codec):
    guard = _guard(wire)
    assert guard.check(activation(RUN, ROUTE, 2, _frame(codec)), PREV) is None
    for other in {"none", "bf16", "fp16", "int8"} - {codec}:
        rej = _guard(wire).inspect(gradient(RUN, ROUTE, 2, _frame(other)), NEXT)
        assert rej is not None and rej.reason == WRONG_COMPRESSION


def test_guard_refuses_non_finite_compressed_frames():
    x = torch.randn(SHAPE)
    x[0, 0, 0] = float("inf")
    for wire in ("bf16", "fp16", "int8"):
        bad = TensorFrame.from_tensor(x, compression=compressions_for_wire(wire)[0])
        assert _guard(wire).inspect(activation(RUN, ROUTE, 2, bad), PREV).reason == "non_finite"


def _plane(wire: str) -> DataPlane:
    return DataPlane(types.SimpleNamespace(peer_id="me"), RUN, lambda msg, sender: None, wire=wire)


@pytest.mark.parametrize("wire", ["fp32", "bf16", "fp16", "int8"])
def test_data_plane_sends_under_the_wire_codec_and_the_bytes_shrink(wire):
    plane = _plane(wire)
    msg = activation(RUN, ROUTE, 2, _frame("none"))
    out = plane._compress(msg)
    assert out.tensor.compression == compressions_for_wire(wire)[0]
    raw, sent = len(encode(msg)), len(encode(out))
    overhead = raw - 4 * torch.Size(SHAPE).numel()
    # what the link emulation plans (len of the encoded frame) is the wire format's real size
    assert sent - overhead == pytest.approx(wire_bytes_per_element(wire, torch.Size(SHAPE).numel())
                                            * torch.Size(SHAPE).numel(), abs=8)
    back = decode(encode(out)).tensor.to_tensor()
    assert float((back - msg.tensor.to_tensor()).abs().max()) <= 0.05 * float(msg.tensor.to_tensor().abs().max())


def test_a_message_to_ourselves_is_quantized_too():
    got = []
    plane = DataPlane(types.SimpleNamespace(peer_id="me"), RUN, lambda msg, sender: got.append(msg), wire="int8")
    asyncio.run(plane.send("me", activation(RUN, ROUTE, 2, _frame("none"))))
    assert got and got[0].tensor.compression == "int8"


def test_unknown_wire_is_refused():
    with pytest.raises(ValueError):
        _plane("int4")


def test_members_compare_precision_and_wire():
    from node.train.trainer import TrainerConfig, summary_differences, training_summary

    a = training_summary(TrainerConfig(), 10)
    b = training_summary(TrainerConfig(precision="bf16", wire="int8"), 10)
    diffs = summary_differences(a, b)
    assert any(d.startswith("precision:") for d in diffs) and any(d.startswith("wire:") for d in diffs)
    from node.train.averaging import AveragingConfig

    c = training_summary(TrainerConfig(averaging=AveragingConfig(compression="fp16")), 10)
    assert summary_differences(a, c) == ["averaging.compression: 'none' here, 'fp16' there"]


def test_averaging_compression_maps_to_hivemind():
    from node.train.averaging import averaging_compression_for_wire, hivemind_compression

    assert [averaging_compression_for_wire(w) for w in ("fp32", "bf16", "fp16", "int8")] == \
        ["none", "fp16", "fp16", "fp16"]
    names = {type(hivemind_compression(n)).__name__ for n in ("none", "fp16", "scaled-fp16")}
    assert names == {"NoCompression", "Float16Compression", "ScaledFloat16Compression"}
    with pytest.raises(ValueError):
        hivemind_compression("uint8")
    from hivemind.compression import CompressionInfo

    t = torch.randn(1000)
    for name, tol in (("none", 0.0), ("fp16", 1e-2), ("scaled-fp16", 1e-2)):
        c = hivemind_compression(name)
        back = c.extract(c.compress(t, CompressionInfo.from_tensor(t)))
        assert float((back - t).abs().max()) <= tol


def test_cost_model_uses_the_wire_bytes():
    from scheduler.cost import ModelShape, activation_bytes

    fp32 = activation_bytes(ModelShape())
    assert activation_bytes(ModelShape(bytes_per_element=wire_bytes_per_element("bf16"))) == fp32 // 2
    int8 = activation_bytes(ModelShape(bytes_per_element=wire_bytes_per_element("int8")))
    assert fp32 // 4 < int8 < fp32 // 3
