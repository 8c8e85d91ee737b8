"""The encoder's large-bytes fast path produces exactly the bytes plain msgpack would."""

from __future__ import annotations

import msgpack
import pytest

from protocol import PROTOCOL_VERSION, decode, encode
from protocol.limits import LARGE_BYTES_THRESHOLD
from protocol.messages import ActivationMessage, MicrobatchId, RpcResponse, ScheduleEpoch
from protocol.tensor import TensorFrame

MB = MicrobatchId(run_id="run", epoch=0, iteration=1, data_node="d", index=2)


def _reference(msg: ActivationMessage) -> bytes:
    frame = msg.tensor
    body = {
        "mb": {"run_id": "run", "epoch": 0, "iteration": 1, "data_node": "d", "index": 2, "attempt": 0},
        "hop": msg.hop,
        "route": list(msg.route),
        "tensor": {"dtype": frame.dtype, "shape": list(frame.shape), "data": frame.data, "compression": "none"},
        "deliver_at_unix": msg.deliver_at_unix,
    }
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": "activation", "b": body}, use_bin_type=True)


@pytest.mark.parametrize(
    "n_int32", [0, 1, LARGE_BYTES_THRESHOLD // 4 - 1, LARGE_BYTES_THRESHOLD // 4, LARGE_BYTES_THRESHOLD // 4 + 1, 300_000]
)
def test_encode_matches_plain_msgpack(n_int32):
    data = bytes(range(256)) * (n_int32 * 4 // 256) + bytes(n_int32 * 4 % 256)
    msg = ActivationMessage(mb=MB, hop=1, route=("d", "p", "d"), tensor=TensorFrame("int32", (n_int32,), data))
    wire = encode(msg)
    assert wire == _reference(msg)
    assert decode(wire) == msg


def test_emulated_delivery_time_round_trips_and_must_be_a_time():
    from protocol.errors import MalformedMessage

    frame = TensorFrame("int32", (1,), bytes(4))
    stamped = ActivationMessage(mb=MB, hop=1, route=("d", "p", "d"), tensor=frame, deliver_at_unix=1.7e9)
    assert decode(encode(stamped)).deliver_at_unix == 1.7e9
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(MalformedMessage, match="deliver_at_unix"):
            decode(encode(ActivationMessage(mb=MB, hop=1, route=("d", "p", "d"), tensor=frame, deliver_at_unix=bad)))


def test_two_large_fields_in_one_message():
    big = bytes(LARGE_BYTES_THRESHOLD * 2)
    msg = ScheduleEpoch("run", 0, "c", 0.0, ("a",), {"blob": "x"}, big)
    assert decode(encode(msg)) == msg
    frames = RpcResponse(ok=True, result=[big, {"k": big}], error=None)
    assert decode(encode(frames)) == frames


def test_signing_payload_ignores_only_the_signature():
    msg = ScheduleEpoch("run", 3, "c", 1.0, ("a", "b"), {"stages": [[0], [1]]}, b"sig")
    payload = msg.signing_payload()
    assert payload == ScheduleEpoch("run", 3, "c", 1.0, ("a", "b"), {"stages": [[0], [1]]}, b"other").signing_payload()
    assert payload != ScheduleEpoch("run", 4, "c", 1.0, ("a", "b"), {"stages": [[0], [1]]}, b"sig").signing_payload()
    assert decode(payload).signature == b""
