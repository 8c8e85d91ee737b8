"""Activation/gradient transport: protocol messages over persistent hivemind P2P raw streams.

Measured on this kind of machine (docs/training.md, shared notes): a binary stream handler with
8-byte length framing moves 120-210 MB/s, while protobuf tensor chunking manages 63-79 MB/s at
32 MB and unary calls are capped at 4 MiB. So each node registers one binary stream handler and
opens **one persistent outgoing stream per neighbour**; every frame is one encoded protocol
message (msgpack envelope whose tensor payload is the raw little-endian bytes of the tensor).
Ordering per neighbour is preserved (one writer lock per stream); a broken stream is reopened
once before the send fails. With a wire format other than ``fp32`` (``wire=``, the run's ``--wire``),
each activation and gradient tensor is compressed with that codec (:mod:`protocol.compression`) in a
worker thread before it is encoded, so the event loop never runs the codec; the receiving stage
decompresses it in its compute thread (``TensorFrame.to_tensor``). The receive side only decodes and hands the message to a callback
that must not block (the trainer enqueues it), so the sender is never stalled by our compute.

Nothing proportional to a large tensor runs on the event loop in one stretch (the loop also serves
the DHT, RPCs, heartbeats and every other stream): a frame over :data:`OFF_LOOP_BYTES` is written
from its parts (:func:`protocol.encode_parts`: the tensor by reference, never joined) and read a
piece of at most that size at a time, yielding in between, and it is decoded and its tensor checked
(dtype, codec, shape, finiteness: :meth:`MicrobatchGuard.check_tensor`) in a worker thread; only the
guard's cheap rules on the envelope (route, window, replays) run on the loop. What remains is the
decoder's one copy of the payload, in that thread, under the GIL.

WAN emulation (off unless a :class:`node.dataplane.emulation.LinkEmulator` is passed): every frame is
planned on its emulated link (latency + bytes / bandwidth, concurrent sends to one peer serialised).
Activations and gradients are stamped with the planned delivery time and sent at once; the
receiver holds them until that time, so the real transport runs inside the emulated delay (see
:mod:`node.dataplane.emulation`) and the receiver never sees them earlier. Control messages are sent
after the sender has waited out the plan. A stamp is honoured only by a node that emulates too
(emulation is a swarm-wide setting: a production node never holds a frame for a peer's say-so),
and never for longer than :data:`MAX_EMULATED_HOLD_S`. A stamped frame that arrives after its
delivery time counts in :attr:`DataPlane.late_frames` / :attr:`DataPlane.late_s`: the host was too
slow to keep up with the emulated link.

Hostile input (any peer may open a stream to our handler): a frame passes, in this order,

1. the swarm allowlist (``allow(peer)``; checked when the stream opens and again per frame, so a
   peer removed mid-run loses its persistent stream),
2. a size cap read from the 8-byte length header *before* the body is read (``guard.max_frame_bytes``,
   else :data:`MAX_FRAME_BYTES`); an oversized frame closes that stream, because the rest of it
   cannot be skipped without reading it (an honest sender just reopens a stream on its next send),
3. a per-peer frame-rate token bucket (:class:`node.net.ratelimit.PeerRateLimiter`, the RPC's limiter),
   checked before decoding, so a flood costs us a read and a dictionary lookup per frame,
4. the wire decoder (only data-plane message types),
5. the guard's semantic checks (:class:`node.dataplane.guard.MicrobatchGuard`).

A frame relayed for a peer behind NAT (:mod:`node.dataplane.relay`) passes the same steps with its origin
as the sender (:meth:`DataPlane.accept_frame`: the allowlist per frame for the origin); the relay itself
must pass the allowlist when its stream is opened.

A refused frame is counted in :attr:`DataPlane.rejected` (and ``metrics.count_rejected``), logged
with its peer and reason (the first time per peer and reason, then every
:data:`REJECT_LOG_EVERY`-th time, so a flood cannot flood the log) and never reaches
``on_message``. Every stream has its own handler task and nothing a frame holds can escape it, so
one peer's garbage never disturbs another peer's stream. Messages to ourselves skip all of this.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Dict, List, Optional, Tuple

from node.compat import import_hivemind
from node.net.ratelimit import PeerRateLimiter
from node.dataplane.guard import Rejection
from protocol import ProtocolError, decode, encode_parts
from protocol.compression import NO_COMPRESSION, get_compressor, wire_compression
from protocol.tensor import TensorFrame
from protocol.messages import ActivationMessage, GradientMessage, HopFailure, IterationDone, NormReport

__all__ = [
    "DataPlane",
    "DataPlaneError",
    "MessageHandler",
    "DATA_MESSAGES",
    "handler_name",
    "MAX_FRAME_BYTES",
    "DEFAULT_FRAME_RATE_PER_S",
    "DEFAULT_FRAME_BURST",
    "REJECT_LOG_EVERY",
    "MAX_STREAMS_PER_PEER",
    "MAX_EMULATED_HOLD_S",
    "OFF_LOOP_BYTES",
]

logger = logging.getLogger(__name__)

#: Message types that travel on the data plane.
DATA_MESSAGES = (ActivationMessage, GradientMessage, IterationDone, HopFailure, NormReport)
#: Cap on one received frame; an fp32 activation of the 500m model with 8 x 1024 tokens is 32 MiB.
MAX_FRAME_BYTES = 512 * 1024 * 1024
#: How many times a send opens a fresh stream after the current one broke.
SEND_RETRIES = 1
#: Frames per second one peer may send us, sustained. An honest neighbour sends one activation and
#: one gradient per microbatch it passes us, plus a few control messages per iteration; even a
#: tiny model on a fast GPU with dozens of microbatches per iteration stays far below this.
DEFAULT_FRAME_RATE_PER_S = 200.0
#: Frames one peer may send at once: a whole iteration's worth of a neighbour's microbatches can
#: arrive back to back (memory slots of a few microbatches, several data nodes) without a drop.
DEFAULT_FRAME_BURST = 256.0
#: A refused frame is logged the first time per (peer, reason), then every this many times.
REJECT_LOG_EVERY = 100
#: Open incoming streams one peer may hold at once. An honest neighbour keeps one persistent
#: stream to us (briefly two while it replaces a broken one); each stream may buffer a frame of up
#: to the size cap, so the count bounds the memory one peer can tie up.
MAX_STREAMS_PER_PEER = 8
#: Longest a receiver holds a frame for its emulated delivery time. The slowest link of the
#: geo-distributed profile moves a paper-sized activation in ~26 s (scaled), a queue of a few of
#: them takes minutes at most; a stamp further out is a clock problem and is cut to this.
MAX_EMULATED_HOLD_S = 120.0
#: A received frame, or a sent hop's tensor payload, larger than this is decoded, checked and
#: encoded in a worker thread instead of on the event loop. Each of those passes costs about a
#: millisecond per MiB (25 ms each for a 32 MiB activation of the 500m model), time in which the
#: loop would answer no heartbeat, RPC or other stream; below 1 MiB the hand-over to a thread
#: (tens of microseconds) would cost more than it saves.
OFF_LOOP_BYTES = 1 << 20
#: (peer, reason) pairs whose counts are kept for log throttling; the table is reset beyond it.
_MAX_LOG_KEYS = 4096
#: Rejection reasons decided here (the guard adds its own, see node.dataplane.guard.REASONS).
NOT_ALLOWED = "not_allowed"
OVERSIZED = "oversized"
RATE_LIMITED = "rate_limited"
UNDECODABLE = "undecodable"
GUARD_ERROR = "guard_error"
TOO_MANY_STREAMS = "too_many_streams"

MessageHandler = Callable[[object, str], Optional[Awaitable[None]]]


async def _write_frame(writer: asyncio.StreamWriter, parts: List[bytes], header_len: int, byteorder: str) -> int:
    """Write one length-prefixed frame made of ``parts`` (what ``P2P.send_raw_data`` writes for their
    concatenation) at most :data:`OFF_LOOP_BYTES` at a time, waiting for the stream to drain in
    between: a 32 MiB tensor is never copied in one stretch, nor joined into one ``bytes`` first."""
    size = sum(len(p) for p in parts)
    writer.write(size.to_bytes(header_len, byteorder))
    for part in parts:
        view = memoryview(part)
        for offset in range(0, len(view), OFF_LOOP_BYTES):
            writer.write(view[offset:offset + OFF_LOOP_BYTES])
            await writer.drain()
    await writer.drain()
    return size


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
                 allow: Optional[Callable[[str], bool]] = None, metrics=None, guard=None,
                 frame_rate_per_s: Optional[float] = DEFAULT_FRAME_RATE_PER_S,
                 frame_burst: float = DEFAULT_FRAME_BURST, max_streams_per_peer: int = MAX_STREAMS_PER_PEER,
                 wire: str = "fp32", on_rejected: Optional[Callable[[object, str, str, str], None]] = None,
                 relay=None):
        """``emulator``: optional :class:`node.dataplane.emulation.LinkEmulator`; None (default) = no emulation.
        ``allow(peer)``: swarm access control; frames from a peer it refuses are dropped unread.
        ``metrics``: optional :class:`node.ops.metrics.NodeMetrics` (hops, bytes and rejections are counted).
        ``guard``: optional :class:`node.dataplane.guard.MicrobatchGuard` (its ``max_frame_bytes``
        replaces :data:`MAX_FRAME_BYTES`). ``frame_rate_per_s``/``frame_burst``: per-peer token
        bucket on received frames; ``frame_rate_per_s=None`` turns it off. ``max_streams_per_peer``:
        incoming streams one peer may hold open at once (more are refused). ``wire``: the run's wire
        format (fp32, bf16, fp16, int8): the codec activations and gradients are sent with.
        ``on_rejected(msg, sender, reason, detail)``: told of every decoded message the guard refused
        (must not block). ``relay``: a :class:`node.dataplane.relay.Relay` (frames to a peer nobody can dial
        from here go through a relay member; frames relayed to us pass :meth:`accept_frame`); None = direct only."""
        self.on_rejected, self.relay = on_rejected, relay
        self.p2p = p2p
        self.compression = wire_compression(wire)
        self.emulator = emulator
        self.allow = allow
        self.metrics = metrics
        self.guard = guard
        self.name = handler_name(run_id)
        self.peer_id = str(p2p.peer_id)
        self._on_message = on_message
        self._out: Dict[str, _Outgoing] = {}
        self._handler_tasks: set = set()
        self._closed_streams: "weakref.WeakSet[asyncio.Task]" = weakref.WeakSet()  # handlers close() ended
        self._started = False
        self.bytes_sent = 0
        self.bytes_received = 0
        #: activation and gradient frames sent: their tensors' payload bytes (codec scales included,
        #: envelope not) and elements; the ratio is the wire format's real cost per element
        self.hop_payload_bytes_sent = 0
        self.hop_elements_sent = 0
        self.limiter: Optional[PeerRateLimiter] = (
            None if frame_rate_per_s is None else PeerRateLimiter(frame_rate_per_s, frame_burst))
        guard_cap = getattr(guard, "max_frame_bytes", None)
        self.max_frame_bytes = int(guard_cap) if guard_cap else MAX_FRAME_BYTES
        #: refused frames (and refused streams, for ``not_allowed``) by reason
        self.rejected: collections.Counter = collections.Counter()
        self._reject_counts: Dict[Tuple[str, str], int] = {}
        self.max_streams_per_peer = max_streams_per_peer
        self._streams: collections.Counter = collections.Counter()  # open incoming streams per peer
        self._held: set = set()  # tasks holding frames until their emulated delivery time
        #: stamped frames that arrived after their emulated delivery time, and by how much in total
        self.late_frames = 0
        self.late_s = 0.0

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.name, self._handle_stream)
        self._started = True
        if self.relay is not None:
            await self.relay.start(self.accept_frame, self.max_frame_bytes)

    async def _deliver(self, msg: object, sender: str) -> None:
        result = self._on_message(msg, sender)
        if asyncio.iscoroutine(result):
            await result

    def _reject(self, sender: str, reason: str, detail: str) -> None:
        """Count one refused frame, and log it unless this peer already said the same many times."""
        self.rejected[reason] += 1
        if self.metrics is not None:
            try:
                self.metrics.count_rejected(reason)
            except Exception:  # noqa: BLE001 - metrics must never break the data plane
                logger.debug("count_rejected failed", exc_info=True)
        n = self._occurrence(sender, reason)
        if n is not None:
            logger.warning("data plane: refused frame from %s: %s (%s)%s", sender[-8:], reason, detail,
                           f" [{n} so far]" if n > 1 else "")

    def _tell_rejected(self, msg: object, sender: str, reason: str, detail: str) -> None:
        """Hand a decoded message the guard refused to ``on_rejected`` (the trainer blames a member
        that sent poison and fails its microbatch at once instead of letting it time out)."""
        if self.on_rejected is None:
            return
        try:
            self.on_rejected(msg, sender, reason, detail)
        except Exception:  # noqa: BLE001 - the stream goes on whatever the callback does
            logger.debug("on_rejected failed", exc_info=True)

    def _occurrence(self, sender: str, what: str) -> Optional[int]:
        """How often ``sender`` did ``what`` so far, when that is worth a log line (first, every Nth), else None."""
        key = (sender, what)
        if key not in self._reject_counts and len(self._reject_counts) >= _MAX_LOG_KEYS:
            self._reject_counts.clear()
        n = self._reject_counts[key] = self._reject_counts.get(key, 0) + 1
        return n if n == 1 or n % REJECT_LOG_EVERY == 0 else None

    def _record_hop(self, peer: str, msg: object, nbytes: int, direction: str, seconds: Optional[float]) -> None:
        if self.metrics is None or not isinstance(msg, (ActivationMessage, GradientMessage)):
            return
        try:
            self.metrics.record_hop(peer, seconds, nbytes, direction)
        except Exception:  # noqa: BLE001
            logger.debug("record_hop failed", exc_info=True)

    def _inspect(self, msg: object, sender: str, tensor_checked: bool = False,
                 measured: object = None) -> Tuple[Optional[str], str]:
        """(reason, detail) from the guard; (None, "") = accepted. A guard that raises refuses the frame.
        ``tensor_checked``: :meth:`_decode` already ran the guard's tensor checks (a large frame), and
        ``measured`` is the magnitude it took there."""
        try:
            inspect = getattr(self.guard, "inspect", None)
            if inspect is None:
                return self.guard.check(msg, sender), type(msg).__name__
            rejection = (inspect(msg, sender, tensor_checked=True, measured=measured) if tensor_checked
                         else inspect(msg, sender))
            return (None, "") if rejection is None else (rejection.reason, rejection.detail)
        except Exception as e:  # noqa: BLE001 - a guard bug must not end the stream (nor let the frame in)
            logger.debug("data-plane guard failed", exc_info=True)
            return GUARD_ERROR, f"guard raised {e!r}"[:200]

    def _decode(self, data: bytes | List[bytes],
                check_tensor: bool) -> Tuple[Optional[object], Optional[str], str, object]:
        """(message, None, "", measured) or (None, reason, detail, None). With ``check_tensor`` (a large
        frame, in a worker thread) the guard's checks of the tensor itself (dtype, codec, shape, every
        element finite) and its magnitude (``measured``) are taken here too; they read nothing but the
        frame, unlike its other rules (replays, the iteration window, the recent magnitudes), which stay
        on the loop."""
        if not isinstance(data, bytes):
            data = b"".join(data)
        try:
            msg = decode(data, max_bytes=self.max_frame_bytes, expect=DATA_MESSAGES)
        except ProtocolError as e:
            return None, UNDECODABLE, str(e)[:200], None
        measured = None
        if check_tensor and isinstance(msg, (ActivationMessage, GradientMessage)):
            try:
                rejection = self.guard.check_tensor(msg.tensor)
                if rejection is None:
                    measured = self.guard.measure(msg.tensor)
                    if isinstance(measured, Rejection):
                        rejection, measured = measured, None
            except Exception as e:  # noqa: BLE001 - a guard bug must not end the stream (nor let the frame in)
                return None, GUARD_ERROR, f"guard raised {e!r}"[:200], None
            if rejection is not None:
                return None, rejection.reason, rejection.detail, None
        return msg, None, "", measured

    async def _read_frame(self, reader: asyncio.StreamReader, header_len: int, byteorder: str,
                          sender: str) -> Optional[bytes | List[bytes]]:
        """The next frame's body, or None when the stream ended or was refused (caller closes it). A body
        over :data:`OFF_LOOP_BYTES` comes as its chunks, joined by the worker thread that decodes it: one
        growing buffer would be copied whole on the loop each time it is reallocated."""
        try:
            header = await reader.readexactly(header_len)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None  # the peer closed its stream
        length = int.from_bytes(header, byteorder)
        if length > self.max_frame_bytes:
            self._reject(sender, OVERSIZED, f"{length} bytes > cap {self.max_frame_bytes}; closing the stream")
            return None
        try:
            if length <= OFF_LOOP_BYTES:
                return await reader.readexactly(length)
            chunks: List[bytes] = []  # as the bytes arrive: a length claimed but never sent costs nothing
            got = 0
            while got < length:
                chunks.append(await reader.readexactly(min(OFF_LOOP_BYTES, length - got)))
                got += len(chunks[-1])
                await asyncio.sleep(0)  # a frame that arrived whole is still copied a piece at a time
            return chunks
        except (asyncio.IncompleteReadError, ConnectionError):
            return None

    async def accept_frame(self, sender: str, data: bytes | List[bytes]) -> bool:
        """Check, decode and deliver one received frame from ``sender`` (on its own stream, or relayed for it:
        :mod:`node.dataplane.relay`); False when the stream it came on is to be closed."""
        size = len(data) if isinstance(data, bytes) else sum(map(len, data))
        self.bytes_received += size
        if self.allow is not None and not self.allow(sender):
            self._reject(sender, NOT_ALLOWED, "peer no longer allowed; stream closed")
            return False
        if self.limiter is not None and not self.limiter.allow(sender):
            self._reject(sender, RATE_LIMITED, f"more than {self.limiter.rate_per_s:g} frames/s "
                                               f"(burst {self.limiter.burst:g})")
            return True
        if not isinstance(data, bytes):  # over OFF_LOOP_BYTES: joined and decoded in a worker thread
            tensor_checked = hasattr(self.guard, "check_tensor")
            msg, reason, detail, measured = await asyncio.get_running_loop().run_in_executor(
                None, self._decode, data, tensor_checked)
        else:
            tensor_checked = False
            msg, reason, detail, measured = self._decode(data, False)
        if msg is None:
            self._reject(sender, reason, detail)
            return True
        if self.guard is not None:
            reason, detail = self._inspect(msg, sender, tensor_checked, measured)
            if reason is not None:
                self._reject(sender, reason, detail)
                self._tell_rejected(msg, sender, reason, detail)
                return True
        self._record_hop(sender, msg, size, "in", None)
        hold = self._hold_s(msg)
        if hold > 0:
            held = asyncio.create_task(self._deliver_after(hold, msg, sender))
            self._held.add(held)
            held.add_done_callback(self._held.discard)
            return True
        await self._deliver_guarded(msg, sender)
        return True

    async def _handle_stream(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hivemind = import_hivemind()
        header_len, byteorder = hivemind.p2p.P2P.HEADER_LEN, hivemind.p2p.P2P.BYTEORDER
        sender = str(stream_info.peer_id)
        if self.allow is not None and not self.allow(sender):
            self._reject(sender, NOT_ALLOWED, "peer not allowed; stream refused")
            writer.close()
            return
        if self._streams[sender] >= self.max_streams_per_peer:
            self._reject(sender, TOO_MANY_STREAMS, f"{self._streams[sender]} streams already open; stream refused")
            writer.close()
            return
        task = asyncio.current_task()
        self._handler_tasks.add(task)
        self._streams[sender] += 1
        try:
            while True:
                data = await self._read_frame(reader, header_len, byteorder, sender)
                if data is None or not await self.accept_frame(sender, data):
                    return
        except asyncio.CancelledError:
            if task in self._closed_streams:  # ended by close(): a handler that ends cancelled makes asyncio's
                return  # stream callback log a CancelledError traceback, so it ends quietly instead
            raise
        except Exception:
            logger.exception("data-plane stream from %s failed", sender[-8:])
        finally:
            self._handler_tasks.discard(task)
            self._streams[sender] -= 1
            if self._streams[sender] <= 0:
                del self._streams[sender]
            writer.close()

    def _hold_s(self, msg: object) -> float:
        """Seconds to hold ``msg`` for its emulated delivery time (0: deliver now); counts late frames."""
        when = getattr(msg, "deliver_at_unix", None)
        if when is None or self.emulator is None:
            return 0.0
        hold = when - time.time()
        if hold < 0:
            self.late_frames += 1
            self.late_s += -hold
        return min(hold, MAX_EMULATED_HOLD_S)

    async def _deliver_after(self, delay_s: float, msg: object, sender: str) -> None:
        await asyncio.sleep(delay_s)
        await self._deliver_guarded(msg, sender)

    async def _deliver_guarded(self, msg: object, sender: str) -> None:
        try:
            await self._deliver(msg, sender)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - one bad message must not end this peer's stream
            if self._occurrence(sender, "handler_error") is not None:
                logger.exception("data plane: handling %s from %s failed", type(msg).__name__, sender[-8:])

    def _encode(self, peer: str, msg: object) -> List[bytes]:
        """The frame for ``msg``, in parts (:func:`protocol.encode_parts`: the tensor's payload by reference,
        not copied); a hop message to an emulated link carries its delivery time."""
        parts = encode_parts(msg)
        if self.emulator is not None and isinstance(msg, (ActivationMessage, GradientMessage)):
            when = self.emulator.deliver_at_unix(peer, sum(len(p) for p in parts))
            if when is not None:
                parts = encode_parts(dataclasses.replace(msg, deliver_at_unix=when))
        return parts

    def _compress(self, msg: object) -> object:
        """``msg`` with its tensor under the run's wire codec (hop messages only; others as they are)."""
        if (self.compression == NO_COMPRESSION or not isinstance(msg, (ActivationMessage, GradientMessage))
                or msg.tensor.compression != NO_COMPRESSION):
            return msg
        frame = msg.tensor
        payload = get_compressor(self.compression).compress(frame.data)
        return dataclasses.replace(msg, tensor=TensorFrame(frame.dtype, frame.shape, payload, self.compression))

    async def send(self, peer: str, msg: object) -> None:
        """Deliver one message; to ourselves it is handed over without touching the network.

        Hop messages go under the run's wire codec either way, so a hop to ourselves is quantized
        like any other (the single-process convergence bench quantizes every hop the same way)."""
        if self.compression != NO_COMPRESSION and isinstance(msg, (ActivationMessage, GradientMessage)):
            msg = await asyncio.get_running_loop().run_in_executor(None, self._compress, msg)
        if peer == self.peer_id:
            await self._deliver(msg, peer)
            return
        hivemind = import_hivemind()
        t0 = time.monotonic()
        parts = self._encode(peer, msg)
        if self.emulator is not None and not isinstance(msg, (ActivationMessage, GradientMessage)):
            # control message: reserve the emulated link now (in send order), wait out its delivery, then write
            await self.emulator.transmit(peer, sum(len(p) for p in parts))
        via = self.relay.route(peer) if self.relay is not None else None
        if via is not None:  # both behind NAT: through a relay member (node.dataplane.relay)
            size = await self._send_relayed(via, peer, msg, parts)
            self._record_hop(peer, msg, size, "out", time.monotonic() - t0)
            return
        out = self._out.setdefault(peer, _Outgoing())
        async with out.lock:
            for attempt in range(SEND_RETRIES + 1):
                try:
                    if out.writer is None:
                        _, _, out.writer = await self.p2p.call_binary_stream_handler(
                            hivemind.p2p.PeerID.from_base58(peer), self.name)
                    size = await _write_frame(out.writer, parts, hivemind.p2p.P2P.HEADER_LEN,
                                              hivemind.p2p.P2P.BYTEORDER)
                    self.bytes_sent += size
                    if isinstance(msg, (ActivationMessage, GradientMessage)):
                        self.hop_payload_bytes_sent += len(msg.tensor.data)
                        self.hop_elements_sent += math.prod(msg.tensor.shape)
                    self._record_hop(peer, msg, size, "out", time.monotonic() - t0)
                    return
                except Exception as e:
                    if out.writer is not None:
                        out.writer.close()
                    out.writer = None
                    if attempt == SEND_RETRIES:
                        raise DataPlaneError(f"cannot send {type(msg).__name__} to {peer}: {e!r}") from e
                    logger.debug("stream to %s broke (%r); reopening", peer[-8:], e)

    async def _send_relayed(self, via: str, peer: str, msg: object, parts: List[bytes]) -> int:
        try:
            size = await self.relay.send(via, peer, parts)
        except Exception as e:
            raise DataPlaneError(f"cannot send {type(msg).__name__} to {peer} through relay {via}: {e!r}") from e
        self.bytes_sent += size
        return size

    async def close(self) -> None:
        if self.relay is not None:
            await self.relay.close()
        for held in list(self._held):
            held.cancel()
        # a sender keeps its stream to us open: without this its frames would go on reaching this closed
        # plane (and its guard's old iteration) after a new trainer of the same daemon opened its own
        for task in list(self._handler_tasks):
            self._closed_streams.add(task)
            task.cancel()
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
