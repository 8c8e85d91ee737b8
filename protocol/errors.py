"""Exceptions raised by the protocol decoders (and by encoders given invalid messages).

Every decoder in this package raises only :class:`ProtocolError` subclasses, whatever bytes a
peer sends, so that network code can catch one base class, drop the offending message and keep
serving everyone else. Each subclass names one kind of fault so callers can count or log them.
"""

from __future__ import annotations

__all__ = [
    "ProtocolError",
    "UnsupportedVersion",
    "UnknownMessageType",
    "MalformedMessage",
    "FrameTooLarge",
    "ShapeMismatch",
    "NonFiniteTensor",
]


class ProtocolError(ValueError):
    """Base class: a message could not be encoded or decoded.

    It derives from :class:`ValueError` because a bad message is a bad value; catching
    ``ProtocolError`` is the intended use.
    """


class UnsupportedVersion(ProtocolError):
    """The envelope carries a protocol version this build does not speak."""


class UnknownMessageType(ProtocolError):
    """The envelope names a message type that is not registered, or not one the caller expects."""


class MalformedMessage(ProtocolError):
    """The bytes are not valid msgpack, or a field is missing, extra, or of the wrong type/value."""


class FrameTooLarge(ProtocolError):
    """The message (or a tensor it describes) exceeds the caller's size limit."""


class ShapeMismatch(ProtocolError):
    """A tensor frame's shape is invalid or disagrees with the length of its data."""


class NonFiniteTensor(ProtocolError):
    """A tensor (or float field) holds NaN or infinity while the caller required finite values."""
