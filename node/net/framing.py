"""Bounded reads of hivemind's raw frames (8-byte big-endian length + body) from a p2pd stream.

``hivemind.p2p.P2P.receive_raw_data`` trusts the length header: one claimed 2 GiB frame from any
libp2p peer makes the handler buffer 2 GiB (measured: a daemon went from 451 MB to 5.35 GB). Every
stream handler of ours reads through :func:`read_frame` instead: the header is checked against a
cap *before* any of the body is read, and the whole frame has a deadline, so a peer that sends a
huge length, or half a frame and then nothing, costs at most ``max_bytes`` and ``timeout_s``.
"""

from __future__ import annotations

import asyncio

__all__ = ["HEADER_LEN", "FrameTooLarge", "read_frame", "write_frame"]

#: hivemind's ``P2P.HEADER_LEN`` (8 bytes, big endian), spelled here so reading needs no hivemind import.
HEADER_LEN = 8


class FrameTooLarge(ValueError):
    """The length header announced more than the handler accepts (nothing of the body was read)."""

    def __init__(self, length: int, max_bytes: int):
        super().__init__(f"frame of {length} bytes exceeds the limit of {max_bytes}")
        self.length, self.max_bytes = length, max_bytes


async def read_frame(reader: asyncio.StreamReader, max_bytes: int, timeout_s: float | None) -> bytes:
    """One frame of at most ``max_bytes``, read within ``timeout_s`` (None = no deadline).

    Raises :class:`FrameTooLarge` (before reading the body), ``asyncio.TimeoutError``, or
    ``asyncio.IncompleteReadError`` when the stream ends inside a frame.
    """

    async def _read() -> bytes:
        header = await reader.readexactly(HEADER_LEN)
        length = int.from_bytes(header, "big")
        if length > max_bytes:
            raise FrameTooLarge(length, max_bytes)
        return await reader.readexactly(length)

    if timeout_s is None:
        return await _read()
    return await asyncio.wait_for(_read(), timeout_s)


async def write_frame(writer: asyncio.StreamWriter, data: bytes, *, chunk_size: int = 1 << 16) -> None:
    """Same wire format as ``P2P.send_raw_data``."""
    writer.write(len(data).to_bytes(HEADER_LEN, "big"))
    view = memoryview(data)
    for offset in range(0, len(view), chunk_size):
        writer.write(view[offset : offset + chunk_size])
    await writer.drain()
