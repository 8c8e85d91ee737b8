"""Activation/gradient transport: protocol messages over persistent hivemind P2P raw streams.

Measured on this kind of machine (docs/training.md, shared notes): a binary stream handler with
8-byte length framing moves 120-210 MB/s, while protobuf tensor chunking manages 63-79 MB/s at
32 MB and unary calls are capped at 4 MiB. So each node registers one binary stream handler and
opens **one persistent outgoing stream per neighbour**; every frame is one encoded protocol
message (msgpack envelope whose tensor payload is the raw little-endian bytes of the tensor).
Ordering per neighbour is preserved (one writer lock per stream); a broken stream is reopened
once before the send fails. The receive side only decodes and hands the message to a callback
that must not block (the trainer enqueues it), so the sender is never stalled by our compute.

WAN emulation (off unless a :class:`node.link_emulation.LinkEmulator` is passed): before a frame
to a peer is written, the sender waits until the emulated link would have delivered it (latency +
bytes / bandwidth, concurrent sends to one peer serialised), so the receiver never sees it earlier.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Dict, Optional, Tuple

from node.compat import import_hivemind
from protocol import ProtocolError, decode, encode
from protocol.messages import ActivationMessage, GradientMessage, HopFailure, IterationDone

__all__ = ["DataPlane", "DataPlaneError", "MessageHandler", "DATA_MESSAGES", "handler_name"]

logger = logging.getLogger(__name__)

#: Message types that travel on the data plane.
DATA_MESSAGES = (ActivationMessage, GradientMessage, IterationDone, HopFailure)
#: Cap on one received frame; an fp32 activation of the 500m model with 8 x 1024 tokens is 32 MiB.
MAX_FRAME_BYTES = 512 * 1024 * 1024
#: How many times a send opens a fresh stream after the current one broke.
SEND_RETRIES = 1

MessageHandler = Callable[[object, str], Optional[Awaitable[None]]]


def handler_name(run_id: str) -> str:
    return f"skippipe/{run_id}/data/1"


class DataPlaneError(RuntimeError):
    """A message could not be delivered to a peer."""


@dataclass
class _Outgoing:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    writer: Optional[asyncio.StreamWriter] = None


class DataPlane:
    """Send/receive data-plane messages for one node over its hivemind ``P2P``."""

    def __init__(self, p2p, run_id: str, on_message: MessageHandler, emulator=None,
                 allow: Optional[Callable[[str], bool]] = None, metrics=None, guard=None):
        """``emulator``: optional :class:`node.link_emulation.LinkEmulator`; None (default) = no emulation.
        ``allow(peer)``: swarm access control; frames from a peer it refuses are dropped unread."""
        self.p2p = p2p
        self.emulator = emulator
        self.allow = allow
        self.metrics = metrics
        self.guard = guard
        self.name = handler_name(run_id)
        self.peer_id = str(p2p.peer_id)
        self._on_message = on_message
        self._out: Dict[str, _Outgoing] = {}
        self._handler_tasks: set = set()
        self._started = False
        self.bytes_sent = 0
        self.bytes_received = 0

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.name, self._handle_stream)
        self._started = True

    async def _deliver(self, msg: object, sender: str) -> None:
        result = self._on_message(msg, sender)
        if asyncio.iscoroutine(result):
            await result

    async def _handle_stream(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hivemind = import_hivemind()
        sender = str(stream_info.peer_id)
        if self.allow is not None and not self.allow(sender):
            logger.warning("data-plane stream from %s refused: peer not allowed", sender[-8:])
            writer.close()
            return
        task = asyncio.current_task()
        self._handler_tasks.add(task)
        try:
            while True:
                try:
                    data = await hivemind.p2p.P2P.receive_raw_data(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the peer closed its stream
                self.bytes_received += len(data)
                try:
                    msg = decode(data, max_bytes=MAX_FRAME_BYTES, expect=DATA_MESSAGES)
                except ProtocolError as e:
                    logger.warning("dropping undecodable frame from %s: %s", sender[-8:], e)
                    continue
                await self._deliver(msg, sender)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("data-plane stream from %s failed", sender[-8:])
        finally:
            self._handler_tasks.discard(task)
            writer.close()

    async def send(self, peer: str, msg: object) -> None:
        """Deliver one message; to ourselves it is handed over without touching the network."""
        if peer == self.peer_id:
            await self._deliver(msg, peer)
            return
        hivemind = import_hivemind()
        data = encode(msg)
        if self.emulator is not None:
            # reserve the emulated link now (in send order), wait out its delivery time, then write
            await self.emulator.transmit(peer, len(data))
        out = self._out.setdefault(peer, _Outgoing())
        async with out.lock:
            for attempt in range(SEND_RETRIES + 1):
                try:
                    if out.writer is None:
                        _, _, out.writer = await self.p2p.call_binary_stream_handler(
                            hivemind.p2p.PeerID.from_base58(peer), self.name)
                    await hivemind.p2p.P2P.send_raw_data(data, out.writer)
                    self.bytes_sent += len(data)
                    return
                except Exception as e:
                    if out.writer is not None:
                        out.writer.close()
                    out.writer = None
                    if attempt == SEND_RETRIES:
                        raise DataPlaneError(f"cannot send {type(msg).__name__} to {peer}: {e!r}") from e
                    logger.debug("stream to %s broke (%r); reopening", peer[-8:], e)

    async def close(self) -> None:
        for out in self._out.values():
            if out.writer is not None:
                out.writer.close()
                out.writer = None
        if self._started:
            try:
                await self.p2p.remove_binary_stream_handler(self.name)
            except Exception:
                pass
            self._started = False
