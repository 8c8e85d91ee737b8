"""Pluggable compression of tensor frame payloads.

Only ``"none"`` exists today. The hook is here so that a later release can add e.g. 8-bit
activation compression (useful on slow home links) by registering a :class:`Compressor`, without
changing :class:`~protocol.tensor.TensorFrame`'s wire layout: the frame already carries the name.
"""

from __future__ import annotations

from typing import Protocol

from .errors import MalformedMessage

__all__ = ["NO_COMPRESSION", "Compressor", "register_compressor", "get_compressor", "compressor_names"]

#: Name of the identity codec: ``data`` holds the raw little-endian tensor bytes.
NO_COMPRESSION: str = "none"


class Compressor(Protocol):
    """Turns raw little-endian tensor bytes into a payload and back."""

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


_COMPRESSORS: dict[str, Compressor] = {NO_COMPRESSION: _Identity()}


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
