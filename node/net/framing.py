"""Bounded reads of hivemind's raw frames (8-byte big-endian length + body) from a p2pd stream.

``hivemind.p2p.P2P.receive_raw_data`` trusts the length header: one claimed 2 GiB frame from any
libp2p peer makes the handler buffer 2 GiB (measured: a daemon went from 451 MB to 5.35 GB). Every
stream handler of ours reads through :func:`read_frame` instead: the header is checked against a
cap *before* any of the body is read, and the whole frame has a deadline, so a peer that sends a
huge length, or half a frame and then nothing, costs at most ``max_bytes`` and ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

__all__ = ["HEADER_LEN", "FrameTooLarge", "read_frame", "write_frame", "stream_caller", "peer_stream_guard"]

logger = logging.getLogger(__name__)

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


def stream_caller(stream_info) -> str:
    """The base58 peer id a stream came from, ``"?"`` when its info names none (logs only)."""
    try:
        return stream_info.peer_id.to_base58()
    except Exception:  # noqa: BLE001 - a malformed stream info must not end the handler before its guard
        return "?"


@asynccontextmanager
async def peer_stream_guard(what: str, caller: str, writer: asyncio.StreamWriter, on_refused: Callable[[], None],
                            refusals: tuple = (FrameTooLarge, asyncio.TimeoutError)) -> AsyncIterator[None]:
    """The body of a stream handler, so that nothing a peer sends escapes it: a broken limit (``refusals``)
    counts through ``on_refused`` and is logged; a peer hanging up mid-frame is no news; cancellation
    (the daemon closing) goes through; anything else is logged; the stream is closed in every case."""
    try:
        yield
    except refusals as e:
        on_refused()
        logger.debug("%s from %s refused: %r", what, caller[-8:], e)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - nothing a peer sends may escape the handler
        logger.debug("%s from %s failed", what, caller[-8:], exc_info=True)
    finally:
        writer.close()
