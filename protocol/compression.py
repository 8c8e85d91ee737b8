"""Pluggable compression of tensor frame payloads, and the run's wire formats.

A frame carries its codec's name (``TensorFrame.compression``), so codecs are added without
changing the frame's wire layout. Registered here:

* ``"none"``: ``data`` holds the raw little-endian tensor bytes;
* ``"bf16"``: float32 elements rounded (to nearest even) to bfloat16, 2 bytes each;
* ``"fp16"``: float32 elements cast to IEEE float16, 2 bytes each (beyond +-65504 becomes inf,
  which a receiver's finiteness check refuses);
* ``"int8"``: blockwise 8-bit quantization: per block of :data:`INT8_BLOCK` elements one float32
  scale (``absmax / 127``), then one int8 per element (``rint(x / scale)``); payload =
  ``[scales: n_blocks x <f4][values: n x i1]``, ``n + 4 * ceil(n / 64)`` bytes. 64, not 256: on the
  tiny convergence bench 256-element blocks cost +3.2 % validation loss against the fp32 wire, 64 +0.9 %
  (docs/training.md).

The lossy codecs compress **float32** tensors only (the boundary dtype of a stage: activations and
gradients leave a stage as float32 whatever its compute precision; see ``node/train/runtime.py``).
They are written over numpy and raw bytes, so ``protocol`` stays importable without torch or
hivemind. Decoding a peer's payload validates everything before producing a byte: the payload's
exact length for the declared raw size (so the output can never be larger than the declared raw
size: no decompression bomb), and for ``int8`` that every scale is finite and non-negative.

A *wire format* (``--wire fp32|bf16|fp16|int8``) names the codec a run sends activations and
gradients with (:data:`WIRE_TABLE`); :func:`wire_bytes_per_element` is its real size per element,
which the scheduler's cost model and the link emulation use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from .errors import MalformedMessage, NonFiniteTensor, ShapeMismatch

__all__ = ["NO_COMPRESSION", "Compressor", "register_compressor", "get_compressor", "compressor_names",
           "WIRE_FORMATS", "WIRE_TABLE", "WireFormat", "wire_format", "INT8_BLOCK", "wire_compression", "wire_bytes_per_element"]

#: Name of the identity codec: ``data`` holds the raw little-endian tensor bytes.
NO_COMPRESSION: str = "none"
#: Elements per int8 block (one float32 scale each): 1.0625 bytes per element on the wire.
INT8_BLOCK: int = 64


class Compressor(Protocol):
    """Turns raw little-endian tensor bytes into a payload and back.

    Optional attributes a codec may have (the lossy ones here all do):
    ``dtypes`` (the frame dtypes it can compress), ``payload_nbytes(raw_nbytes)`` (the exact payload
    length, checked before decoding) and ``payload_finite(payload, raw_nbytes)`` (finiteness without decoding).
    """

    name: str

    def compress(self, raw: bytes) -> bytes:
        """Return the payload for ``raw``."""
        ...

    def decompress(self, payload: bytes, raw_nbytes: int) -> bytes | bytearray:
        """Return the raw bytes; must never produce more than ``raw_nbytes`` (a peer controls ``payload``)."""
        ...


class _Identity:
    """The ``"none"`` codec."""

    name = NO_COMPRESSION

    def compress(self, raw: bytes) -> bytes:
        return raw

    def decompress(self, payload: bytes, raw_nbytes: int) -> bytes | bytearray:
        return payload


def _f32_count(raw_nbytes: int, name: str) -> int:
    if raw_nbytes < 0 or raw_nbytes % 4:
        raise ShapeMismatch(f"{name} compresses float32 tensors; {raw_nbytes} raw bytes is not a whole number of them")
    return raw_nbytes // 4


def _check_payload(codec, payload: bytes, raw_nbytes: int) -> None:
    want = codec.payload_nbytes(raw_nbytes)
    if len(payload) != want:
        raise ShapeMismatch(f"{codec.name} payload of {len(payload)} bytes; {raw_nbytes} raw bytes need {want}")


class _BFloat16:
    """float32 -> bfloat16 (round to nearest even, NaN kept NaN) -> float32."""

    name = "bf16"
    dtypes = frozenset({"float32"})

    def payload_nbytes(self, raw_nbytes: int) -> int:
        return 2 * _f32_count(raw_nbytes, self.name)

    def compress(self, raw: bytes) -> bytes:
        import numpy as np

        _f32_count(len(raw), self.name)
        bits = np.frombuffer(raw, dtype="<u4").astype(np.uint32)
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        out = np.where(nan, np.uint32(0x7FC0), rounded).astype("<u2")
        return out.tobytes()

    def decompress(self, payload: bytes, raw_nbytes: int) -> bytearray:
        import numpy as np

        _check_payload(self, payload, raw_nbytes)
        out = bytearray(raw_nbytes)
        view = np.frombuffer(out, dtype="<u4")
        view[:] = np.frombuffer(payload, dtype="<u2").astype(np.uint32) << np.uint32(16)
        return out

    def payload_finite(self, payload: bytes, raw_nbytes: int) -> bool:
        import numpy as np

        _check_payload(self, payload, raw_nbytes)
        bits = np.frombuffer(payload, dtype="<u2")
        return not bool(((bits & 0x7F80) == 0x7F80).any())


class _Float16:
    """float32 -> IEEE float16 -> float32 (out of range becomes inf)."""

    name = "fp16"
    dtypes = frozenset({"float32"})

    def payload_nbytes(self, raw_nbytes: int) -> int:
        return 2 * _f32_count(raw_nbytes, self.name)

    def compress(self, raw: bytes) -> bytes:
        import numpy as np

        _f32_count(len(raw), self.name)
        with np.errstate(over="ignore", invalid="ignore"):
            return np.frombuffer(raw, dtype="<f4").astype("<f2").tobytes()

    def decompress(self, payload: bytes, raw_nbytes: int) -> bytearray:
        import numpy as np

        _check_payload(self, payload, raw_nbytes)
        out = bytearray(raw_nbytes)
        np.frombuffer(out, dtype="<f4")[:] = np.frombuffer(payload, dtype="<f2")
        return out

    def payload_finite(self, payload: bytes, raw_nbytes: int) -> bool:
        import numpy as np

        _check_payload(self, payload, raw_nbytes)
        return bool(np.isfinite(np.frombuffer(payload, dtype="<f2")).all())


class _Int8Blockwise:
    """Blockwise absmax int8 quantization with one float32 scale per :data:`INT8_BLOCK` elements."""

    name = "int8"
    dtypes = frozenset({"float32"})
    block = INT8_BLOCK

    def payload_nbytes(self, raw_nbytes: int) -> int:
        n = _f32_count(raw_nbytes, self.name)
        return n + 4 * (-(-n // self.block))

    def compress(self, raw: bytes) -> bytes:
        import numpy as np

        n = _f32_count(len(raw), self.name)
        if n == 0:
            return b""
        x = np.frombuffer(raw, dtype="<f4").astype(np.float32)
        n_blocks = -(-n // self.block)
        padded = np.zeros(n_blocks * self.block, dtype=np.float32)
        padded[:n] = x
        blocks = padded.reshape(n_blocks, self.block)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            absmax = np.abs(blocks).max(axis=1)
            # a block holding NaN or inf gets a NaN scale: the receiver refuses it as non-finite
            bad = ~np.isfinite(blocks).all(axis=1)
            scales = np.where(bad, np.float32(np.nan), absmax / np.float32(127.0)).astype(np.float32)
            safe = np.where((scales > 0) & np.isfinite(scales), scales, np.float32(1.0))
            q = np.clip(np.rint(np.nan_to_num(blocks / safe[:, None])), -127, 127).astype(np.int8)
        return scales.astype("<f4").tobytes() + q.reshape(-1)[:n].tobytes()

    def _split(self, payload: bytes, raw_nbytes: int):
        import numpy as np

        _check_payload(self, payload, raw_nbytes)
        n = raw_nbytes // 4
        n_blocks = -(-n // self.block)
        scales = np.frombuffer(payload, dtype="<f4", count=n_blocks)
        q = np.frombuffer(payload, dtype=np.int8, offset=4 * n_blocks, count=n)
        return n, n_blocks, scales, q

    def decompress(self, payload: bytes, raw_nbytes: int) -> bytearray:
        import numpy as np

        n, n_blocks, scales, q = self._split(payload, raw_nbytes)
        if n and not self._scales_ok(scales):
            if not np.isfinite(scales).all():
                raise NonFiniteTensor(f"int8 payload has a non-finite block scale ({n_blocks} blocks)")
            raise MalformedMessage("int8 payload has a negative block scale")
        out = bytearray(raw_nbytes)
        if n:
            dst = np.frombuffer(out, dtype="<f4")
            full = (n // self.block) * self.block
            if full:
                dst[:full] = (q[:full].reshape(-1, self.block).astype(np.float32)
                              * scales[: full // self.block, None]).reshape(-1)
            if full < n:
                dst[full:] = q[full:].astype(np.float32) * scales[-1]
        return out

    @staticmethod
    def _scales_ok(scales) -> bool:
        import numpy as np

        return bool(np.isfinite(scales).all() and (scales >= 0).all())

    def payload_finite(self, payload: bytes, raw_nbytes: int) -> bool:
        import numpy as np

        # int8 values are always finite: only the scales can carry NaN or inf
        _, _, scales, _ = self._split(payload, raw_nbytes)
        return bool(np.isfinite(scales).all())


_COMPRESSORS: dict[str, Compressor] = {NO_COMPRESSION: _Identity()}
for _codec in (_BFloat16(), _Float16(), _Int8Blockwise()):
    _COMPRESSORS[_codec.name] = _codec

@dataclass(frozen=True)
class WireFormat:
    """One ``--wire`` value, in the one table every user reads: the frame codec activations and gradients
    are sent with (the data plane, and the guard accepts exactly it), and the compression the replicas'
    gradient averaging uses (a name of ``node.train.averaging.AVERAGING_COMPRESSIONS``). fp32 stays exact;
    every narrower wire averages in fp16 (int8 too: hivemind's 8-bit averaging codecs do not decode here)."""

    name: str
    frame_codec: str
    averaging: str


#: ``--wire`` value -> its :class:`WireFormat`
WIRE_TABLE: dict[str, WireFormat] = {w.name: w for w in (
    WireFormat("fp32", NO_COMPRESSION, "none"),
    WireFormat("bf16", "bf16", "fp16"),
    WireFormat("fp16", "fp16", "fp16"),
    WireFormat("int8", "int8", "fp16"),
)}
#: ``--wire`` value -> the frame codec activations and gradients are sent with.
WIRE_FORMATS: dict[str, str] = {name: w.frame_codec for name, w in WIRE_TABLE.items()}


def register_compressor(compressor: Compressor) -> None:
    """Make ``compressor`` available under ``compressor.name``; names cannot be reused."""
    if compressor.name in _COMPRESSORS:
        raise ValueError(f"compressor {compressor.name!r} is already registered")
    _COMPRESSORS[compressor.name] = compressor


def get_compressor(name: str) -> Compressor:
    """Return the compressor called ``name``; raise :class:`MalformedMessage` for unknown names."""
    compressor = _COMPRESSORS.get(name)
    if compressor is None:
        raise MalformedMessage(f"unknown tensor compression {name[:100]!r}")
    return compressor


def compressor_names() -> frozenset[str]:
    """Names of all registered compressors."""
    return frozenset(_COMPRESSORS)


def wire_format(wire: str) -> WireFormat:
    """The :class:`WireFormat` of ``--wire`` value ``wire``; ``ValueError`` for an unknown one."""
    try:
        return WIRE_TABLE[wire]
    except KeyError:
        raise ValueError(f"unknown wire format {wire!r}; expected one of {sorted(WIRE_TABLE)}") from None


def wire_compression(wire: str) -> str:
    """The codec name of wire format ``wire``; ``ValueError`` for an unknown one."""
    return wire_format(wire).frame_codec


def wire_bytes_per_element(wire: str, numel: Optional[int] = None) -> float:
    """Real bytes per float32 element on the wire for ``wire`` (int8 includes its block scales).

    With ``numel`` the exact payload size of a tensor of that many elements, divided by it."""
    codec = get_compressor(wire_compression(wire))
    if numel is None:
        numel = INT8_BLOCK * 1024  # a whole number of int8 blocks: the asymptotic figure
    if numel <= 0:
        return 4.0
    if codec.name == NO_COMPRESSION:
        return 4.0
    return codec.payload_nbytes(4 * numel) / numel  # type: ignore[attr-defined]
