"""Tensor frames: a tensor as dtype, shape and raw little-endian bytes.

Activations and gradients are the bulk of the swarm's traffic, so the frame is deliberately
dumb: no pickling (peers are untrusted), no framework-specific format, just bytes that any
peer can validate against the declared shape before touching them. torch is imported lazily
inside the conversion methods so that ``import protocol`` stays light for the scheduler and CLI.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from .codec import pack_value, unpack_value
from .compression import NO_COMPRESSION, get_compressor
from .errors import FrameTooLarge, MalformedMessage, NonFiniteTensor, ShapeMismatch
from .limits import DEFAULT_MAX_BYTES, MAX_TENSOR_NDIM
from .options import DecodeOptions

if TYPE_CHECKING:
    import torch

__all__ = ["TensorFrame", "DtypeInfo", "DTYPES"]


class DtypeInfo(NamedTuple):
    """How one wire dtype is stored: element size, and the integer type with the same bits.

    Conversions go through the same-sized integer view (``bits``), which torch and numpy both
    support for every dtype including bfloat16 (numpy has no bfloat16 of its own).
    """

    itemsize: int
    is_float: bool
    torch_name: str
    bits_torch_name: str
    bits_numpy: str  # little-endian numpy dtype string of the bit pattern
    float_numpy: str | None  # little-endian numpy float dtype, when numpy has one


#: Wire dtypes; the names match torch's dtype attribute names.
DTYPES: dict[str, DtypeInfo] = {
    "float32": DtypeInfo(4, True, "float32", "int32", "<i4", "<f4"),
    "float16": DtypeInfo(2, True, "float16", "int16", "<i2", "<f2"),
    "bfloat16": DtypeInfo(2, True, "bfloat16", "int16", "<i2", None),
    "int64": DtypeInfo(8, False, "int64", "int64", "<i8", None),
    "int32": DtypeInfo(4, False, "int32", "int32", "<i4", None),
}

#: bfloat16 is the top half of a float32: 1 sign, 8 exponent, 7 mantissa bits. An all-ones
#: exponent means inf or NaN, which is how bf16 finiteness is checked without torch.
_BF16_EXPONENT_MASK: int = 0x7F80

_LITTLE_ENDIAN: bool = sys.byteorder == "little"


@dataclass(frozen=True, repr=False)
class TensorFrame:
    """A tensor on the wire. ``data`` is ``shape``'s elements in C order, little-endian.

    ``compression`` names the codec applied to ``data`` (see :mod:`protocol.compression`);
    it is ``"none"`` unless a sender opts in, and then ``data`` is exactly ``nbytes`` long.
    """

    dtype: str
    shape: tuple[int, ...]
    data: bytes
    compression: str = NO_COMPRESSION

    def __repr__(self) -> str:  # the default repr would print megabytes of data into logs
        extra = "" if self.compression == NO_COMPRESSION else f", compression={self.compression!r}"
        return f"TensorFrame(dtype={self.dtype!r}, shape={self.shape!r}, data=<{len(self.data)} bytes>{extra})"

    @property
    def numel(self) -> int:
        """Number of elements the shape declares."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size of the tensor's raw bytes (equal to ``len(data)`` when uncompressed)."""
        return self.numel * DTYPES[self.dtype].itemsize

    def validate(self, options: DecodeOptions | None = None) -> None:
        """Check dtype, shape, data length and (if ``options.require_finite``) finiteness.

        The decoder calls this after the field types are verified; :meth:`to_tensor` calls it too.
        """
        options = options or DecodeOptions()
        info = DTYPES.get(self.dtype) if isinstance(self.dtype, str) else None
        if info is None:
            raise MalformedMessage(f"unsupported tensor dtype {str(self.dtype)[:100]!r}; expected one of {sorted(DTYPES)}")
        if not isinstance(self.data, bytes):
            raise MalformedMessage(f"tensor data must be bytes, got {type(self.data).__name__}")
        compressor = get_compressor(self.compression) if isinstance(self.compression, str) else None
        if compressor is None:
            raise MalformedMessage(f"tensor compression must be a str, got {type(self.compression).__name__}")
        if not isinstance(self.shape, tuple):
            raise ShapeMismatch(f"tensor shape must be a tuple, got {type(self.shape).__name__}")
        if len(self.shape) > MAX_TENSOR_NDIM:
            raise ShapeMismatch(f"tensor has {len(self.shape)} dims, at most {MAX_TENSOR_NDIM} are allowed")
        for dim in self.shape:
            if isinstance(dim, bool) or not isinstance(dim, int):
                raise ShapeMismatch(f"tensor dims must be ints, got {type(dim).__name__} in shape")
            if dim < 0:
                raise ShapeMismatch(f"negative dimension {dim} in shape {self.shape}")
        nbytes = self.numel * info.itemsize
        if nbytes > options.max_bytes:
            raise FrameTooLarge(f"tensor of shape {self.shape} ({nbytes} bytes) exceeds max_bytes={options.max_bytes}")
        if self.compression == NO_COMPRESSION and len(self.data) != nbytes:
            raise ShapeMismatch(
                f"{self.dtype} tensor of shape {self.shape} needs {nbytes} bytes, data has {len(self.data)}"
            )
        if self.compression != NO_COMPRESSION:
            accepted = getattr(compressor, "dtypes", None)
            if accepted is not None and self.dtype not in accepted:
                raise MalformedMessage(f"compression {self.compression!r} does not apply to {self.dtype} tensors")
            payload_nbytes = getattr(compressor, "payload_nbytes", None)
            if payload_nbytes is not None and len(self.data) != payload_nbytes(nbytes):
                raise ShapeMismatch(f"{self.compression} payload of {len(self.data)} bytes does not fit a {self.dtype} "
                                    f"tensor of shape {self.shape} ({payload_nbytes(nbytes)} bytes expected)")
        if options.require_finite:
            self.check_finite()

    def raw_bytes(self) -> bytes | bytearray:
        """The uncompressed little-endian element bytes (``data`` itself when uncompressed)."""
        if self.compression == NO_COMPRESSION:
            return self.data
        raw = get_compressor(self.compression).decompress(self.data, self.nbytes)
        if len(raw) != self.nbytes:
            raise ShapeMismatch(f"decompressed {len(raw)} bytes, shape {self.shape} needs {self.nbytes}")
        return raw

    def check_finite(self) -> None:
        """Raise :class:`NonFiniteTensor` if a float tensor holds NaN or infinity."""
        info = DTYPES[self.dtype]
        if not info.is_float or self.numel == 0:
            return
        import numpy as np

        if self.compression != NO_COMPRESSION:
            payload_finite = getattr(get_compressor(self.compression), "payload_finite", None)
            if payload_finite is not None:  # checked on the payload itself: no decompression
                if not payload_finite(self.data, self.nbytes):
                    raise NonFiniteTensor(f"{self.dtype} tensor of shape {self.shape} contains NaN or inf "
                                          f"({self.compression} payload)")
                return
        raw = self.raw_bytes()
        if info.float_numpy is not None:
            finite = bool(np.isfinite(np.frombuffer(raw, dtype=info.float_numpy)).all())
        else:
            bits = np.frombuffer(raw, dtype="<u2")
            finite = not bool(((bits & _BF16_EXPONENT_MASK) == _BF16_EXPONENT_MASK).any())
        if not finite:
            raise NonFiniteTensor(f"{self.dtype} tensor of shape {self.shape} contains NaN or inf")

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, *, compression: str = NO_COMPRESSION) -> TensorFrame:
        """Snapshot any torch tensor (any device, strides or byte order) into a frame.

        The tensor is detached, moved to CPU and made contiguous (each a no-op when already so),
        then its bytes are copied once into the frame. Unsupported dtypes raise ``TypeError``.
        """
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        name = str(tensor.dtype).removeprefix("torch.")
        info = DTYPES.get(name)
        if info is None:
            raise TypeError(f"unsupported tensor dtype {tensor.dtype}; supported: {sorted(DTYPES)}")
        if tensor.layout != torch.strided:
            raise TypeError(f"only dense (strided) tensors can be framed, got {tensor.layout}")
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        tensor = tensor.resolve_conj().resolve_neg().contiguous()
        bits = tensor.view(getattr(torch, info.bits_torch_name)).numpy()
        if not _LITTLE_ENDIAN:
            bits = bits.astype(info.bits_numpy)
        raw = bits.tobytes()
        payload = raw if compression == NO_COMPRESSION else get_compressor(compression).compress(raw)
        return cls(dtype=name, shape=tuple(tensor.shape), data=payload, compression=compression)

    def to_tensor(self) -> torch.Tensor:
        """Return a new writable CPU tensor with this frame's contents.

        ``bytes`` are immutable, so the data is copied once into a ``bytearray`` that the
        tensor then uses without a further copy (a decompressor's ``bytearray`` is used as is).
        """
        import torch

        self.validate(DecodeOptions(max_bytes=sys.maxsize))
        info = DTYPES[self.dtype]
        dtype = getattr(torch, info.torch_name)
        if self.numel == 0:
            return torch.empty(self.shape, dtype=dtype)
        raw = self.raw_bytes()
        if not _LITTLE_ENDIAN:
            import numpy as np

            native = np.frombuffer(raw, dtype=info.bits_numpy).astype(info.bits_numpy[1:])
            return torch.from_numpy(native).view(dtype).reshape(self.shape)
        buffer = raw if isinstance(raw, bytearray) else bytearray(raw)
        return torch.frombuffer(buffer, dtype=dtype).reshape(self.shape)

    def to_bytes(self) -> bytes:
        """Encode this frame alone as a msgpack map (no envelope), e.g. to stream it separately."""
        return pack_value(self)

    @classmethod
    def from_bytes(
        cls, data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES, require_finite: bool = False
    ) -> TensorFrame:
        """Decode :meth:`to_bytes` output; like :func:`protocol.messages.decode`, raises only ProtocolError."""
        return unpack_value(cls, data, max_bytes=max_bytes, require_finite=require_finite)
