"""The link-probe handler (``skippipe/ping/1``), with the limits every stream handler needs.

A probe (``Daemon.probe_link``) opens one stream, sends a few tiny frames (echoed: RTT) and one
payload of ``link_probe_payload_bytes`` (64 KiB by default; answered with one byte: bandwidth).
The handler bounds what a hostile peer can make it do:

* size: a frame announcing more than :data:`MAX_PING_FRAME_BYTES` closes the stream before any
  of its body is read (:func:`node.net.framing.read_frame`);
* time: each frame must arrive within :data:`PING_FRAME_TIMEOUT_S`, and a stream carries at most
  :data:`MAX_PING_FRAMES` frames;
* callers: with ``allow`` (``Daemon.is_peer_allowed``: with a swarm key, members only) anybody
  else's stream is closed unanswered.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Callable, Optional

from node.net.framing import peer_stream_guard, read_frame, stream_caller, write_frame

__all__ = ["PING_PROTOCOL", "PING_ECHO_MAX_BYTES", "MAX_PING_FRAME_BYTES", "MAX_PING_FRAMES", "PING_FRAME_TIMEOUT_S",
           "PingHandler", "probe_link"]

logger = logging.getLogger(__name__)

#: libp2p protocol id of the link probe.
PING_PROTOCOL = "skippipe/ping/1"
#: Frames up to this size are echoed (RTT probes); larger ones are acknowledged with one byte.
PING_ECHO_MAX_BYTES = 64
#: Largest probe payload accepted (16 x the default 64 KiB bandwidth probe).
MAX_PING_FRAME_BYTES = 1 << 20
#: Frames one probe stream may carry (a probe sends 3 + 1).
MAX_PING_FRAMES = 16
#: Seconds each frame may take to arrive.
PING_FRAME_TIMEOUT_S = 10.0


class PingHandler:
    """``await p2p.add_binary_stream_handler(PING_PROTOCOL, PingHandler(allow=daemon.is_peer_allowed))``."""

    def __init__(self, allow: Optional[Callable[[str], bool]] = None, *, max_frame_bytes: int = MAX_PING_FRAME_BYTES,
                 max_frames: int = MAX_PING_FRAMES, frame_timeout_s: float = PING_FRAME_TIMEOUT_S):
        self.allow, self.max_frame_bytes, self.max_frames = allow, max_frame_bytes, max_frames
        self.frame_timeout_s = frame_timeout_s
        self.refused = 0  # streams closed for a limit or the caller (tests, metrics)

    async def __call__(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        caller = stream_caller(stream_info)
        async with peer_stream_guard("ping stream", caller, writer, self._refuse):
            if self.allow is not None and not self.allow(caller):
                self._refuse()
                logger.debug("ping from %s refused: not a member", caller[-8:])
                return
            for _ in range(self.max_frames):
                data = await read_frame(reader, self.max_frame_bytes, self.frame_timeout_s)
                await write_frame(writer, data if len(data) <= PING_ECHO_MAX_BYTES else b"\x01")

    def _refuse(self) -> None:
        self.refused += 1


async def probe_link(p2p, peer_id, payload_bytes: int = 64 * 1024, samples: int = 3,
                     frame_timeout_s: float = PING_FRAME_TIMEOUT_S) -> tuple[float, float]:
    """(min RTT in ms, bandwidth in bytes/s) to ``peer_id`` (a hivemind ``PeerID``): ``samples`` echo pings, then
    one ``payload_bytes`` frame acknowledged with one byte. The answers are read bounded (a hostile peer
    answering with a huge frame costs nothing), each within ``frame_timeout_s``."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, PING_PROTOCOL)
    try:
        rtts = []
        for _ in range(samples):
            t0 = time.perf_counter()
            await write_frame(writer, b"p")
            await read_frame(reader, PING_ECHO_MAX_BYTES, frame_timeout_s)
            rtts.append(time.perf_counter() - t0)
        rtt = min(rtts)
        payload = os.urandom(payload_bytes)
        t0 = time.perf_counter()
        await write_frame(writer, payload)
        await read_frame(reader, PING_ECHO_MAX_BYTES, frame_timeout_s)
        elapsed = time.perf_counter() - t0
        return rtt * 1000.0, payload_bytes / max(elapsed - rtt, elapsed / 2, 1e-6)
    finally:
        writer.close()
