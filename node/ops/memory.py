"""Process-level memory tuning for a node that moves large activation frames.

glibc serves every allocation above its dynamic mmap threshold (at most 32 MiB) with a fresh ``mmap``
that is page-faulted and zeroed again on each use. A 32 MiB activation frame is copied a few times on its
way through the data plane (tensor -> frame -> wire -> frame -> tensor), and measured here each such copy
cost 18-360 ms under load instead of ~5.5 ms; the data plane reached 0.24-0.64x of a raw hivemind stream at
32 MiB by default and 0.85x with the thresholds raised (bench/dataplane.py). Keeping big buffers on the heap
costs memory that is returned to the OS less eagerly, which a training node re-uses every microbatch anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["tune_malloc", "MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES"]

logger = logging.getLogger(__name__)

#: Allocations below this stay on the heap: above the largest frame we expect to copy (500M-model
#: microbatch of 8 x 1024 x 1024 fp32 = 32 MiB, with headroom for larger batches).
MMAP_THRESHOLD_BYTES = 1 << 30
#: Free heap memory beyond this is returned to the OS; twice the mmap threshold so that a freed frame is
#: not trimmed and page-faulted back in on the next microbatch.
TRIM_THRESHOLD_BYTES = 1 << 31

_M_TRIM_THRESHOLD = -1  # glibc <malloc.h> constants
_M_MMAP_THRESHOLD = -3
_applied = False


def tune_malloc() -> bool:
    """Raise glibc's mmap/trim thresholds once per process; returns whether it took effect.

    A no-op (returning False) on a libc without ``mallopt`` (musl, macOS).
    """
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        logger.debug("mallopt not available; leaving malloc defaults")
        return False
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    return _applied
