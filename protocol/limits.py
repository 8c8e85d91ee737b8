"""Size and nesting limits shared by the encoders and decoders.

They exist so that a hostile or buggy peer cannot make a decoder allocate unbounded memory or
recurse without bound; each value is a named constant with the reason for its size.
"""

from __future__ import annotations

__all__ = [
    "MIB",
    "DEFAULT_MAX_BYTES",
    "MAX_NESTING_DEPTH",
    "MAX_TENSOR_NDIM",
    "LARGE_BYTES_THRESHOLD",
    "MAX_MEASURED_COMPUTE_S",
]

#: One mebibyte, to write byte sizes legibly.
MIB: int = 1024 * 1024

#: Default cap on one encoded message. An activation of a ~500M-parameter model with a microbatch
#: of 8 sequences x 1024 tokens x 1024 hidden in fp32 is 32 MiB; 256 MiB leaves 8x headroom for
#: larger microbatches or hidden sizes while still refusing absurd frames before allocating them.
DEFAULT_MAX_BYTES: int = 256 * MIB

#: Deepest nesting of maps/arrays accepted inside free-form (``object``/``dict``) fields. Schedule
#: JSON and RPC params are at most ~5 levels deep; 32 is generous and stays far below Python's
#: recursion limit (1000), so validating a hostile deeply nested value cannot hit RecursionError.
MAX_NESTING_DEPTH: int = 32

#: Most dimensions a tensor frame may declare: numpy's historical NPY_MAXDIMS, far more than any
#: activation (3 dims) needs; it bounds the work of multiplying out a hostile shape.
MAX_TENSOR_NDIM: int = 32

#: Byte strings at least this long are spliced into the encoded output by reference instead of
#: being copied through msgpack's internal buffer: below 64 KiB the extra copy costs less than
#: the bookkeeping, above it the copy dominates encode time for activations.
LARGE_BYTES_THRESHOLD: int = 64 * 1024

#: Largest measured compute time (seconds per sample per layer) an advert may carry. The 500M reference
#: layer takes ~0.05 s per sample on a CPU core; an hour is slower than anything that still trains, and
#: the bound keeps a peer's value from overflowing the coordinator's cost products (x layers x samples).
MAX_MEASURED_COMPUTE_S: float = 3600.0
