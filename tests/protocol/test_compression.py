"""Wire codecs of protocol/compression.py: round trips, error bounds, and refusal of bad payloads."""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocol import compression
from protocol.compression import INT8_BLOCK, WIRE_FORMATS, get_compressor, wire_bytes_per_element, wire_compression
from protocol.errors import MalformedMessage, NonFiniteTensor, ProtocolError, ShapeMismatch
from protocol.tensor import TensorFrame

CODECS = ("bf16", "fp16", "int8")


def _raw(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def _back(codec: str, raw: bytes) -> np.ndarray:
    c = get_compressor(codec)
    payload = c.compress(raw)
    assert len(payload) == c.payload_nbytes(len(raw))
    return np.frombuffer(bytes(c.decompress(payload, len(raw))), dtype="<f4")


@pytest.mark.parametrize("n", [0, 1, 5, INT8_BLOCK - 1, INT8_BLOCK, INT8_BLOCK + 1, 3 * INT8_BLOCK + 17])
@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_error_bounds(codec, n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 50.0], n)).astype(np.float32)
    y = _back(codec, _raw(x))
    assert y.shape == x.shape and np.isfinite(y).all()
    if n == 0:
        return
    if codec == "bf16":  # 7 stored mantissa bits, round to nearest: relative error <= 2^-8
        assert np.all(np.abs(y - x) <= np.abs(x) * 2.0**-8 + 1e-38)
    elif codec == "fp16":  # 11 mantissa bits (normal range): relative error <= 2^-11, plus subnormal floor
        assert np.all(np.abs(y - x) <= np.abs(x) * 2.0**-11 + 2.0**-25)
    else:  # int8: error <= half a step of the block's scale (absmax / 127)
        for start in range(0, n, INT8_BLOCK):
            blk = slice(start, start + INT8_BLOCK)
            step = np.abs(x[blk]).max() / 127
            assert np.all(np.abs(y[blk] - x[blk]) <= 0.5 * step * (1 + 1e-5) + 1e-12)


def test_bf16_rounds_to_nearest_even_and_keeps_specials():
    x = np.array([1.0, -2.5, 0.0, -0.0, np.inf, -np.inf, np.nan, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8], dtype=np.float32)
    y = _back("bf16", _raw(x))
    assert list(y[:6]) == [1.0, -2.5, 0.0, -0.0, np.inf, -np.inf] and math.isnan(y[6])
    assert y[7] == 1.0  # a tie rounds to the even mantissa
    assert y[8] == 1.0 + 2.0**-6


def test_int8_zero_block_and_exact_extremes():
    x = np.zeros(2 * INT8_BLOCK, dtype=np.float32)
    x[INT8_BLOCK] = -3.0
    y = _back("int8", _raw(x))
    assert (y[:INT8_BLOCK] == 0).all() and y[INT8_BLOCK] == -3.0


@pytest.mark.parametrize("codec", CODECS)
def test_wrong_payload_sizes_are_refused(codec):
    c = get_compressor(codec)
    payload = c.compress(_raw(np.ones(10)))
    for bad in (payload[:-1], payload + b"\0", b""):
        with pytest.raises(ShapeMismatch):
            c.decompress(bad, 40)
    with pytest.raises(ShapeMismatch):  # not a whole number of float32 elements
        c.decompress(payload, 41)
    # a tiny payload can never claim a huge output (no decompression bomb)
    with pytest.raises(ShapeMismatch):
        c.decompress(payload, 4 * 2**30)


def test_int8_scales_must_be_finite_and_non_negative():
    c = get_compressor("int8")
    payload = bytearray(c.compress(_raw(np.ones(10))))
    payload[:4] = np.float32(np.nan).tobytes()
    with pytest.raises(NonFiniteTensor):
        c.decompress(bytes(payload), 40)
    payload[:4] = np.float32(np.inf).tobytes()
    with pytest.raises(NonFiniteTensor):
        c.decompress(bytes(payload), 40)
    payload[:4] = np.float32(-1.0).tobytes()
    with pytest.raises(MalformedMessage):
        c.decompress(bytes(payload), 40)


@pytest.mark.parametrize("codec", CODECS)
def test_frames_with_codecs(codec):
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 3, 300)
    frame = TensorFrame.from_tensor(x, compression=codec)
    assert frame.compression == codec and len(frame.data) < frame.nbytes
    back = TensorFrame.from_bytes(frame.to_bytes(), require_finite=True).to_tensor()
    assert back.dtype == torch.float32 and back.shape == x.shape
    assert float((back - x).abs().max()) < 0.05 * float(x.abs().max())
    # non-finite values are refused by the finiteness check, without decompressing
    x[0, 0, 0] = float("nan")
    bad = TensorFrame.from_tensor(x, compression=codec)
    with pytest.raises(NonFiniteTensor):
        TensorFrame.from_bytes(bad.to_bytes(), require_finite=True)
    # the lossy codecs apply to float32 frames only; a wrong payload length fails validation
    with pytest.raises(MalformedMessage):
        TensorFrame("bfloat16", (4,), b"\0" * 8, codec).validate()
    with pytest.raises(ShapeMismatch):
        TensorFrame("float32", (4,), frame.data[:3], codec).validate()


def test_wire_formats():
    assert WIRE_FORMATS == {"fp32": "none", "bf16": "bf16", "fp16": "fp16", "int8": "int8"}
    assert wire_compression("fp32") == compression.NO_COMPRESSION
    assert wire_bytes_per_element("fp32") == 4.0
    assert wire_bytes_per_element("bf16") == wire_bytes_per_element("fp16") == 2.0
    assert wire_bytes_per_element("int8") == pytest.approx(1 + 4 / INT8_BLOCK)
    assert wire_bytes_per_element("int8", numel=10) == pytest.approx((10 + 4) / 10)
    with pytest.raises(ValueError):
        wire_compression("int4")


def test_errors_are_protocol_errors():
    assert issubclass(NonFiniteTensor, ProtocolError) and issubclass(ShapeMismatch, ProtocolError)
