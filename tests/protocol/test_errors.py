"""Each kind of bad input raises its own ProtocolError subclass, with a message naming the fault."""

from __future__ import annotations

import copy
import math

import msgpack
import pytest

import protocol.codec
from protocol import PROTOCOL_VERSION, decode, encode
from protocol.errors import (
    FrameTooLarge,
    MalformedMessage,
    NonFiniteTensor,
    ProtocolError,
    ShapeMismatch,
    UnknownMessageType,
    UnsupportedVersion,
)
from protocol.messages import (
    ActivationMessage,
    GradientMessage,
    HopFailure,
    IterationDone,
    LinkReport,
    MembershipEvent,
    MicrobatchId,
    RpcRequest,
    RpcResponse,
    StageAdvert,
)
from protocol.tensor import TensorFrame

MB = MicrobatchId(run_id="run", epoch=0, iteration=1, data_node="d", index=2)
FRAME = TensorFrame("float32", (2, 2), bytes(16))
ACTIVATION = ActivationMessage(mb=MB, hop=1, route=("d", "p", "d"), tensor=FRAME)
ADVERT = StageAdvert(
    run_id="run",
    peer_id="p",
    gossip_peer_id="g",
    maddrs=("/ip4/1.2.3.4/tcp/1",),
    gossip_maddrs=(),
    stages=(1, 2),
    state="ONLINE",
    compute_s_per_sample_per_layer=0.01,
    memory_slots=4,
    free_slots=2,
    protocol_version=PROTOCOL_VERSION,
    rpc_port=None,
    location=None,
    timestamp=1.5,
)


def plain(msg: object) -> dict:
    return msgpack.unpackb(encode(msg), raw=False)


def pack(envelope: object) -> bytes:
    return msgpack.packb(envelope, use_bin_type=True)


def mutated(msg: object, *path_and_value: object) -> bytes:
    """Encode ``msg``, then set the body value at ``path`` (a sequence of keys) to ``value``."""
    *path, value = path_and_value
    envelope = plain(msg)
    node = envelope["b"]
    for key in path[:-1]:
        node = node[key]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return pack(envelope)


DELETE = object()


def raises(exc: type[ProtocolError], data: bytes, match: str | None = None, **kwargs: object) -> ProtocolError:
    with pytest.raises(exc, match=match) as info:
        decode(data, **kwargs)
    assert type(info.value) is exc  # exactly this class, not a sibling
    return info.value


def test_valid_baseline_decodes():
    assert decode(encode(ACTIVATION)) == ACTIVATION
    assert decode(encode(ADVERT)) == ADVERT


# --- UnsupportedVersion ---------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, PROTOCOL_VERSION + 100, -1])
def test_unsupported_version(version):
    envelope = plain(ACTIVATION)
    envelope["v"] = version
    raises(UnsupportedVersion, pack(envelope), match=str(version))


def test_future_version_with_other_envelope_keys_is_still_a_version_error():
    raises(UnsupportedVersion, pack({"v": PROTOCOL_VERSION + 1, "t": "x", "b": {}, "new": 1}))


@pytest.mark.parametrize("version", [True, 1.0, "1", None])
def test_non_int_version_is_malformed(version):
    envelope = plain(ACTIVATION)
    envelope["v"] = version
    raises(MalformedMessage, pack(envelope), match="version")


# --- UnknownMessageType ---------------------------------------------------------------------


def test_unknown_type():
    envelope = plain(ACTIVATION)
    envelope["t"] = "no_such_message"
    raises(UnknownMessageType, pack(envelope), match="no_such_message")


def test_unexpected_type_with_expect():
    wire = encode(ACTIVATION)
    assert decode(wire, expect=ActivationMessage) == ACTIVATION
    assert decode(wire, expect=(GradientMessage, ActivationMessage)) == ACTIVATION
    raises(UnknownMessageType, wire, match="gradient", expect=GradientMessage)
    raises(UnknownMessageType, wire, expect=(GradientMessage, HopFailure))


def test_encode_unregistered_class():
    with pytest.raises(UnknownMessageType):
        encode(MB)  # a dataclass, but not a message
    with pytest.raises(UnknownMessageType):
        encode({"v": 1})


# --- MalformedMessage -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\x83",  # map header with nothing after it
        b"\xa3ab",  # truncated str
        b"\xd9\x02\xff\xfe",  # str with invalid UTF-8
        b"\xc7\x01\x05\x00",  # ext type
        b"\xd6\xff\x00\x00\x00\x00",  # msgpack timestamp ext
        b"\x91" * 5000 + b"\xc0",  # nested deeper than msgpack's stack
        b"\xdd\xff\xff\xff\xff",  # array header claiming 4 billion items
        b"\xdf\xff\xff\xff\xff",  # map header claiming 4 billion entries
        b"\xc6\xff\xff\xff\xff",  # bin header claiming 4 GiB
    ],
)
def test_bad_msgpack(data):
    raises(MalformedMessage, data)


def test_truncated_and_trailing_bytes():
    wire = encode(ACTIVATION)
    raises(MalformedMessage, wire[:-1])
    raises(MalformedMessage, wire + b"\x00", match="trailing")


@pytest.mark.parametrize("data", [None, 12, "text", [1, 2]])
def test_non_bytes_input(data):
    raises(MalformedMessage, data, match="bytes-like")  # type: ignore[arg-type]


def test_bytearray_and_memoryview_inputs():
    wire = encode(ACTIVATION)
    assert decode(bytearray(wire)) == ACTIVATION
    assert decode(memoryview(wire)) == ACTIVATION


@pytest.mark.parametrize(
    "envelope",
    [
        [1, "activation", {}],
        {"v": PROTOCOL_VERSION, "t": "activation"},
        {"v": PROTOCOL_VERSION, "t": "activation", "b": {}, "x": 1},
        {"v": PROTOCOL_VERSION, "t": 7, "b": {}},
        {"v": PROTOCOL_VERSION, "t": b"activation", "b": {}},
        {1: 1},
        {"v": PROTOCOL_VERSION, "t": "activation", "b": []},
    ],
)
def test_bad_envelopes(envelope):
    raises(MalformedMessage, pack(envelope))


def test_non_string_map_key_in_msgpack():
    raises(MalformedMessage, pack({1: PROTOCOL_VERSION, "t": "activation", "b": {}}))
    raises(MalformedMessage, pack({b"v": PROTOCOL_VERSION, "t": "activation", "b": {}}))


def test_missing_and_extra_fields():
    raises(MalformedMessage, mutated(ACTIVATION, "hop", DELETE), match="missing.*hop")
    raises(MalformedMessage, mutated(ACTIVATION, "mb", "index", DELETE), match="missing.*index")
    raises(MalformedMessage, mutated(ACTIVATION, "extra", 1), match="unexpected.*extra")
    raises(MalformedMessage, mutated(ACTIVATION, "tensor", "extra", 1), match="unexpected")


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("hop",), True),  # bool is not int
        (("hop",), 1.0),
        (("hop",), "1"),
        (("hop",), None),
        (("mb", "run_id"), b"run"),  # bytes is not str
        (("mb", "epoch"), False),
        (("route",), "d,p,d"),
        (("route",), {"0": "d"}),
        (("route", 1), 5),
        (("tensor",), b"\x00" * 16),
        (("tensor", "data"), "\x00" * 16),
        (("tensor", "data"), [0] * 16),
        (("tensor", "shape"), [2.0, 2]),
        (("tensor", "shape"), [math.nan, 2]),  # NaN in a shape is a wrong type, never a dim
        (("tensor", "shape"), [True, 2]),
        (("tensor", "shape"), 4),
        (("tensor", "dtype"), 1),
        (("tensor", "compression"), None),
    ],
)
def test_wrong_typed_fields(path, value):
    error = raises(MalformedMessage, mutated(ACTIVATION, *path, value))
    assert str(path[0]) in str(error)  # the message names the offending field


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rpc_port", "80"),
        ("rpc_port", True),
        ("location", 3),
        ("timestamp", "now"),
        ("timestamp", None),
        ("compute_s_per_sample_per_layer", True),
        ("stages", [1, "2"]),
        ("maddrs", [None]),
    ],
)
def test_wrong_typed_advert_fields(field, value):
    raises(MalformedMessage, mutated(ADVERT, field, value), match=field)


def test_int_accepted_for_float_field():
    msg = decode(mutated(ADVERT, "timestamp", 7))
    assert msg.timestamp == 7.0 and type(msg.timestamp) is float


def test_dict_fields():
    done = IterationDone("run", 0, 1, "d", {"a": 1}, 0)
    assert decode(encode(done)) == done
    raises(MalformedMessage, mutated(done, "visits", {"a": "1"}), match="visits")
    raises(MalformedMessage, mutated(done, "visits", [["a", 1]]), match="visits")
    raises(MalformedMessage, mutated(done, "visits", {b"a": 1}), match="visits")
    raises(MalformedMessage, mutated(done, "visits", {"a": -1}), match="visits")


def test_object_fields_are_plain_values_only():
    deep: object = 0
    for _ in range(100):
        deep = [deep]
    raises(MalformedMessage, pack({"v": PROTOCOL_VERSION, "t": "rpc_request", "b": {"method": "m", "params": {"x": deep}}}), match="nested")
    raises(MalformedMessage, pack({"v": PROTOCOL_VERSION, "t": "rpc_response", "b": {"ok": True, "result": {b"k": 1}, "error": None}}))


def test_unknown_dtype_and_compression():
    raises(MalformedMessage, mutated(ACTIVATION, "tensor", "dtype", "float64"), match="dtype")
    raises(MalformedMessage, mutated(ACTIVATION, "tensor", "compression", "zstd"), match="compression")


@pytest.mark.parametrize(
    ("msg", "path", "value", "match"),
    [
        (ACTIVATION, ("hop",), 3, "hop"),
        (ACTIVATION, ("hop",), -1, "hop"),
        (ACTIVATION, ("route",), ["x", "p", "d"], "route"),
        (ACTIVATION, ("route",), [], "route"),
        (ACTIVATION, ("mb", "index"), -5, "index"),
        (ADVERT, ("state",), "online", "state"),
        (ADVERT, ("free_slots",), -1, "free_slots"),
        (ADVERT, ("rpc_port",), 70000, "rpc_port"),
        (ADVERT, ("compute_s_per_sample_per_layer",), -0.5, "compute"),
        (ADVERT, ("compute_s_per_sample_per_layer",), math.nan, "compute"),
        (MembershipEvent("run", "p", "join", (), 0.0), ("kind",), "joined", "kind"),
        (LinkReport("run", "a", 0.0, {"b": 1.0}, {}), ("rtt_ms", "b"), -1.0, "rtt_ms"),
    ],
)
def test_semantic_violations(msg, path, value, match):
    assert decode(encode(msg)) == msg
    raises(MalformedMessage, mutated(msg, *path, value), match=match)


def test_encode_rejects_invalid_messages():
    with pytest.raises(MalformedMessage, match="tuple"):
        encode(ActivationMessage(mb=MB, hop=1, route=["d", "p", "d"], tensor=FRAME))  # type: ignore[arg-type]
    with pytest.raises(MalformedMessage, match="hop"):
        encode(ActivationMessage(mb=MB, hop=True, route=("d", "p", "d"), tensor=FRAME))  # type: ignore[arg-type]
    with pytest.raises(MalformedMessage, match="range"):
        encode(HopFailure(mb=MB, hop=2**64, peer_id="p", reason=""))
    with pytest.raises(MalformedMessage, match="UTF-8"):
        encode(HopFailure(mb=MB, hop=0, peer_id="\ud800", reason=""))
    with pytest.raises(MalformedMessage):
        encode(RpcRequest(method="m", params={"s": {1, 2}}))
    with pytest.raises(MalformedMessage, match="key"):
        encode(RpcResponse(ok=True, result={1: "x"}, error=None))
    with pytest.raises(ShapeMismatch):
        encode(ActivationMessage(mb=MB, hop=1, route=("d", "p", "d"), tensor=TensorFrame("float32", (5,), bytes(16))))


# --- FrameTooLarge --------------------------------------------------------------------------


def test_frame_too_large_is_checked_before_parsing(monkeypatch):
    wire = encode(ACTIVATION)
    assert decode(wire, max_bytes=len(wire)) == ACTIVATION

    def explode(*args, **kwargs):
        raise AssertionError("msgpack must not see an oversized frame")

    monkeypatch.setattr(protocol.codec.msgpack, "unpackb", explode)
    raises(FrameTooLarge, wire, match="max_bytes", max_bytes=len(wire) - 1)


def test_tensor_shape_larger_than_limit():
    frame = TensorFrame.from_bytes(FRAME.to_bytes(), max_bytes=64)
    assert frame == FRAME
    with pytest.raises(FrameTooLarge):
        TensorFrame.from_bytes(pack({"dtype": "float32", "shape": [2**40], "data": b"", "compression": "none"}))


def test_invalid_max_bytes_argument():
    with pytest.raises(ValueError):
        decode(encode(ACTIVATION), max_bytes=-1)


# --- ShapeMismatch --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "data_len"),
    [([2, 2], 15), ([2, 2], 17), ([], 0), ([0], 4), ([3], 16), ([2**62, 2**62], 16)],
)
def test_shape_vs_data_length(shape, data_len):
    envelope = plain(ACTIVATION)
    envelope["b"]["tensor"]["shape"] = shape
    envelope["b"]["tensor"]["data"] = bytes(data_len)
    exc = FrameTooLarge if math.prod(shape) * 4 > protocol.codec.DEFAULT_MAX_BYTES else ShapeMismatch
    raises(exc, pack(envelope))


def test_negative_and_too_many_dims():
    raises(ShapeMismatch, mutated(ACTIVATION, "tensor", "shape", [-2, -2]), match="negative")
    raises(ShapeMismatch, mutated(ACTIVATION, "tensor", "shape", [1] * 33 + [4]), match="dims")


# --- NonFiniteTensor ------------------------------------------------------------------------

NON_FINITE = {
    "float32": [b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xff"],  # NaN, +inf, -inf
    "float16": [b"\x00\x7e", b"\x00\x7c", b"\x00\xfc"],
    "bfloat16": [b"\xc0\x7f", b"\x80\x7f", b"\x80\xff"],
}


@pytest.mark.parametrize("dtype", sorted(NON_FINITE))
@pytest.mark.parametrize("which", range(3))
def test_non_finite_tensor(dtype, which):
    bad = NON_FINITE[dtype][which]
    frame = TensorFrame(dtype, (3,), bytes(len(bad)) + bad + bytes(len(bad)))
    msg = ActivationMessage(mb=MB, hop=1, route=("d", "p", "d"), tensor=frame)
    assert decode(encode(msg)) == msg  # allowed unless the caller asks
    raises(NonFiniteTensor, encode(msg), match=dtype, require_finite=True)
    with pytest.raises(NonFiniteTensor):
        TensorFrame.from_bytes(frame.to_bytes(), require_finite=True)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32", "int64"])
def test_finite_tensor_passes_require_finite(dtype):
    frame = TensorFrame(dtype, (4,), b"\x3c" * (4 * TensorFrame(dtype, (1,), b"").nbytes))
    # 0x3c3c... is a finite float (exponent not all ones) in every float format, and any int.
    msg = ActivationMessage(mb=MB, hop=1, route=("d", "p", "d"), tensor=frame)
    assert decode(encode(msg), require_finite=True) == msg


def test_non_finite_float_fields():
    for value in (math.nan, math.inf):
        wire = encode(LinkReport("run", "a", value, {}, {}))
        decode(wire)
        raises(NonFiniteTensor, wire, match="timestamp", require_finite=True)
    wire = encode(RpcResponse(ok=True, result=[1.0, {"x": math.inf}], error=None))
    decode(wire)
    raises(NonFiniteTensor, wire, require_finite=True)
