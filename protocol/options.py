"""Options a decoder passes down to the values it validates.

They travel as one small frozen object so that validation hooks of message classes (see
:func:`protocol.registry.register_message`) can read the caller's limits without growing a new
parameter each time a limit is added.
"""

from __future__ import annotations

from dataclasses import dataclass

from .limits import DEFAULT_MAX_BYTES

__all__ = ["DecodeOptions", "ENCODE_OPTIONS"]


@dataclass(frozen=True)
class DecodeOptions:
    """Limits of one decode call.

    ``max_bytes`` bounds the encoded message and every tensor size it declares;
    ``require_finite`` makes NaN/inf in tensors and float fields an error.
    """

    max_bytes: int = DEFAULT_MAX_BYTES
    require_finite: bool = False


#: Options used when validating a message before encoding it: the sender enforces types and
#: consistency, but not the receiver's size or finiteness policy (the receiver does that).
ENCODE_OPTIONS = DecodeOptions(max_bytes=2**63 - 1, require_finite=False)
