"""An application-level relay for the data plane: a public member forwards frames between two members
behind NAT that cannot connect to each other.

Why not libp2p's circuit relay: hivemind's p2pd (v0.5) has circuit relay v2, but a NATed daemon only
looks for relays about three minutes after it starts (autorelay's boot delay), its reservation and
circuit limits are start-time options nobody can read back, and it counts nothing a node could show in
``/metrics``. So the relay runs here instead, on the connections that already exist: a NATed node opens
one stream to each relay it may be reached through (:class:`RelayClient`; the stream keeps its
connection open), and the relay (:class:`RelayServer`) writes the frames addressed to it back on that
stream. A frame from NATed A to NATed B goes A -> R on A's stream, R -> B on B's stream.

Wire format on a relay stream: pairs of length-prefixed frames (hivemind's 8-byte header, as the data
plane), first a peer-id frame (:func:`encode_peer`), then the data-plane frame itself, untouched. From a
client the peer id names the target (an empty one is a hello that only registers the circuit); from the
relay it names the origin, which the relay took from the libp2p stream (authenticated), never from the
client's bytes. The receiver then handles the data frame exactly like one from the origin's own stream
(:meth:`node.dataplane.transport.DataPlane.accept_frame`: allowlist, size cap, rate limit, decoder,
guard), so a relay adds no trust in the frame itself; it is trusted only to name the origin truly, and
only members may be relays (the receiver's allowlist checks the relay when the stream opens).

Bounds on a relay (hostile input: every number below caps what a peer can make it do): circuits (open
client streams) in all and per peer, the peer-id frame's size, the data frame's size (the data plane's
cap), and relayed bytes per second (a token bucket; a frame waits for its tokens, so a sender that goes
faster is slowed down, never served beyond the cap). Frames are never decoded by the relay.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Dict, List, Optional

from node.compat import import_hivemind
from node.dataplane.state_transfer import (ask_vouch, encode_relayed_origin, relayed_state_handler_name,
                                           state_relay_handler_name)
from node.dataplane.transport import OFF_LOOP_BYTES, REJECT_LOG_EVERY, SEND_RETRIES, _write_frame
from node.net.identity import looks_like_peer_id

__all__ = ["RelayMode", "serves_relay", "relay_handler_name", "encode_peer", "decode_peer", "RelayServer",
           "RelayClient", "Relay", "MAX_RELAY_CIRCUITS", "MAX_CIRCUITS_PER_PEER", "RELAY_BYTES_PER_S",
           "RELAYS_PER_CLIENT", "RELAY_REFRESH_S", "MAX_PEER_FRAME_BYTES"]

logger = logging.getLogger(__name__)

#: Client streams one relay holds open at once. Each NATed member keeps one stream to each of its
#: :data:`RELAYS_PER_CLIENT` relays; 64 covers swarms of dozens of NATed volunteers, and each stream
#: buffers at most one frame, so the count bounds what the relay's memory can be made to hold.
MAX_RELAY_CIRCUITS = 64
#: Client streams one peer may hold on a relay: one, and briefly a second while it replaces a broken one.
MAX_CIRCUITS_PER_PEER = 2
#: Relayed bytes per second, all circuits together. Every relayed byte crosses the relay's uplink twice (in
#: and out); 25 MiB/s is a fifth of a 1 Gbit/s line each way, what a public volunteer can lend without its
#: own hops (activations of its own stage) starving.
RELAY_BYTES_PER_S = 25 * 1024 * 1024
#: Relays a NATed node keeps a stream to (the first ones by peer id, as senders pick them): the second
#: one covers a sender whose view does not list the first yet, or a first relay that just went away.
RELAYS_PER_CLIENT = 2
#: Seconds between a NATed node's checks that its relay streams are open (re-opened when one broke).
RELAY_REFRESH_S = 2.0
#: Seconds a relay this node could not open a stream to is passed over for the next one in the order (then
#: tried again): a member may advertise ``relay`` at addresses nobody can reach (a wrong ``--announce-maddrs``,
#: ``--relay on`` behind a NAT), and the relay after it must carry the frames meanwhile.
RELAY_RETRY_S = 30.0
#: ... once every try has failed for this long. Every node must pick the same relays (a frame crosses only a
#: relay its target holds a stream to), and a relay starting up refuses streams for a few seconds (its data
#: plane is not serving yet): passed over at its first refusal by some nodes and not by others, it would
#: split the NATed nodes between relays, and frames between them would reach relays with no way on.
RELAY_DEAD_AFTER_S = 20.0
#: Seconds a NATed node gives the stream to one relay to open: a dial of a dead address can take a minute.
RELAY_OPEN_TIMEOUT_S = 10.0
#: Longest peer-id frame: a base58 libp2p peer id is 46-53 characters (RSA and Ed25519 keys).
MAX_PEER_FRAME_BYTES = 128
#: Seconds a relay waits for a stream's write to drain before it gives that circuit up: a receiver that
#: stops reading must not hold the frames of other circuits behind it for long.
RELAY_WRITE_TIMEOUT_S = 30.0
#: Relay refusals and drops, by reason (counted in :attr:`RelayServer.refused`).
NOT_MEMBER = "not_member"
NOT_RELAY = "not_relay"
TOO_MANY_CIRCUITS = "too_many_circuits"
BAD_PEER_FRAME = "bad_peer_frame"
OVERSIZED = "oversized"
NO_ROUTE = "no_route"
WRITE_FAILED = "write_failed"
STATE_FAILED = "state_failed"
#: State streams (:mod:`node.dataplane.state_transfer`) one relay pipes at once. A download carries a whole stage's
#: weights and optimizer state through the relay's uplink (at the relay's byte rate); a NATed joiner or a re-sync
#: needs one now and then, plus a sketch stream per other replica to check it.
MAX_RELAYED_STATE_STREAMS = 4
#: Of those, per requester: a download and the next request (a sketch) that may open before the relay has seen
#: the download's stream end.
MAX_RELAYED_STATE_STREAMS_PER_PEER = 2
#: Bytes a client may send on a piped state stream: its request (a few dozen bytes) and nothing more.
MAX_RELAYED_REQUEST_BYTES = 64 * 1024
#: Seconds a piped state stream may last: a 1 GiB stage state at the relay's rate takes about 40 s; the
#: stage's own server and client time out sooner, so this only ends streams neither side closes.
RELAYED_STATE_TIMEOUT_S = 600.0
#: Seconds the relay's vouch for a requester may take: admission's challenge (5 s) with room for its DHT reads;
#: after that the target applies the stranger's rate, which only slows a candidate's proof.
RELAY_VOUCH_TIMEOUT_S = 10.0


class RelayMode(enum.Enum):
    """``--relay``: serve as a relay hop always, never, or when this node can be dialled (``auto``)."""

    ON = "on"
    OFF = "off"
    AUTO = "auto"


def serves_relay(mode: RelayMode, reachability: str) -> bool:
    """Whether a node with ``mode`` and its learned ``reachability`` relays: ``auto`` only for a node others can
    dial (a NATed relay could reach nobody a NATed peer cannot reach itself). ``unknown`` counts as dialable,
    as everywhere in the scheduler (:mod:`scheduler.reachability`): a founder whose only peers sit behind NAT
    has nobody to dial it back and stays ``unknown``, yet it is the one relay such a swarm has."""
    return mode is RelayMode.ON or (mode is RelayMode.AUTO and reachability in ("direct", "unknown"))


def relay_handler_name(run_id: str) -> str:
    return f"skippipe/{run_id}/relay/1"


def encode_peer(peer_id: str) -> bytes:
    return peer_id.encode("ascii")


def decode_peer(data: bytes) -> Optional[str]:
    """The peer id in a peer-id frame, or None when it is not a plausible base58 peer id ("" is a hello)."""
    if data == b"":
        return ""
    if len(data) > MAX_PEER_FRAME_BYTES or not data.isascii():
        return None
    text = data.decode("ascii")
    return text if looks_like_peer_id(text) else None


def _frame_format():
    p2p = import_hivemind().p2p.P2P
    return p2p.HEADER_LEN, p2p.BYTEORDER


async def read_frame(reader: asyncio.StreamReader, cap: int) -> Optional[List[bytes]]:
    """The next frame's body in pieces of at most :data:`OFF_LOOP_BYTES`, or None when the stream ended or
    the frame's length header says more than ``cap`` (checked before any of the body is read)."""
    header_len, byteorder = _frame_format()
    try:
        length = int.from_bytes(await reader.readexactly(header_len), byteorder)
        if length > cap:
            return None
        chunks: List[bytes] = []
        got = 0
        while got < length:
            chunks.append(await reader.readexactly(min(OFF_LOOP_BYTES, length - got)))
            got += len(chunks[-1])
            await asyncio.sleep(0)
        return chunks
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


async def _write_pair(writer: asyncio.StreamWriter, peer: str, parts: List[bytes]) -> int:
    """One peer-id frame then one data frame; the data frame's size."""
    header_len, byteorder = _frame_format()
    await _write_frame(writer, [encode_peer(peer)], header_len, byteorder)
    return await _write_frame(writer, parts, header_len, byteorder)


@dataclass
class _Circuit:
    """A client's stream on a relay (or a client's stream to its relay): writes to it are serialised."""

    writer: asyncio.StreamWriter
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class RelayServer:
    """Forwards data frames between the members whose streams it holds (see the module doc)."""

    def __init__(self, p2p, run_id: str, allow: Optional[Callable[[str], bool]], max_frame_bytes: int,
                 metrics=None, max_circuits: int = MAX_RELAY_CIRCUITS,
                 max_circuits_per_peer: int = MAX_CIRCUITS_PER_PEER, bytes_per_s: float = RELAY_BYTES_PER_S,
                 enabled: Callable[[], bool] = lambda: True,
                 vouch: Optional[Callable[[str], Awaitable[bool]]] = None):
        """``allow(peer)``: the swarm's access check (members only in a private swarm), for both ends of every
        frame; ``max_frame_bytes``: the data plane's frame cap; ``metrics``: a NodeMetrics (relayed bytes and
        circuits are counted); ``enabled()``: whether this node relays now (``--relay auto`` follows the
        node's reachability, which it may learn or re-learn while it runs), checked per new circuit; ``vouch(peer)``:
        whether this node's admission vouches for a non-member requesting state (told to the target,
        :func:`~node.dataplane.state_transfer.encode_relayed_origin`; None: it vouches for nobody)."""
        self.enabled, self.vouch = enabled, vouch
        self.p2p, self.name, self.allow, self.metrics = p2p, relay_handler_name(run_id), allow, metrics
        self.max_frame_bytes, self.max_circuits, self.max_circuits_per_peer = max_frame_bytes, max_circuits, max_circuits_per_peer
        self.bytes_per_s = float(bytes_per_s)
        self._tokens, self._refilled = float(bytes_per_s), time.monotonic()
        self._pace = asyncio.Lock()
        self._circuits: Dict[str, _Circuit] = {}  # the newest stream of each client
        self._open: collections.Counter = collections.Counter()  # open streams per client
        self._tasks: set = set()
        self.relayed_bytes = 0
        self.relayed_frames = 0
        self.circuits_opened = 0
        self.refused: collections.Counter = collections.Counter()
        self._state_slots = asyncio.Semaphore(MAX_RELAYED_STATE_STREAMS)
        self._state_clients: collections.Counter = collections.Counter()  # piped state streams per client
        self.relayed_states = 0  # state streams piped (opened to their target)
        self.run_id = run_id
        self._started = False

    @property
    def circuits(self) -> int:
        return sum(self._open.values())

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.name, self._handle)
        await self.p2p.add_binary_stream_handler(state_relay_handler_name(self.run_id), self._handle_state)
        self._started = True

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for circuit in self._circuits.values():
            circuit.writer.close()
        self._circuits.clear()
        if self._started:
            for name in (self.name, state_relay_handler_name(self.run_id)):
                try:
                    await self.p2p.remove_binary_stream_handler(name)
                except Exception:  # noqa: BLE001 - the daemon may be gone already
                    pass
            self._started = False

    def _refuse(self, peer: str, reason: str) -> None:
        self.refused[reason] += 1
        if self.metrics is not None:
            self.metrics.count_rejected(f"relay_{reason}")
        if self.refused[reason] == 1 or self.refused[reason] % REJECT_LOG_EVERY == 0:  # a flood cannot flood the log
            logger.warning("relay: refused %s: %s [%d so far]", peer[-8:], reason, self.refused[reason])

    def _allowed(self, peer: str) -> bool:
        return self.allow is None or bool(self.allow(peer))


    async def _handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = str(stream_info.peer_id)
        if not self.enabled():
            self._refuse(client, NOT_RELAY)
            writer.close()
            return
        if not self._allowed(client):
            self._refuse(client, NOT_MEMBER)
            writer.close()
            return
        if self.circuits >= self.max_circuits or self._open[client] >= self.max_circuits_per_peer:
            self._refuse(client, TOO_MANY_CIRCUITS)
            writer.close()
            return
        task = asyncio.current_task()
        self._tasks.add(task)
        self._open[client] += 1
        self.circuits_opened += 1
        circuit = self._circuits[client] = _Circuit(writer)
        self._count_circuits()
        try:
            while True:
                head = await read_frame(reader, MAX_PEER_FRAME_BYTES)
                target = decode_peer(b"".join(head)) if head is not None else None
                if target is None:
                    if head is not None:
                        self._refuse(client, BAD_PEER_FRAME)
                    return
                if target == "":
                    continue  # a hello: the circuit is registered
                data = await read_frame(reader, self.max_frame_bytes)
                if data is None:
                    self._refuse(client, OVERSIZED)
                    return
                if not self._allowed(client):
                    self._refuse(client, NOT_MEMBER)
                    return
                await self._forward(client, target, data)
        except asyncio.CancelledError:
            return
        except Exception:  # noqa: BLE001 - one client's stream must not end the relay
            logger.exception("relay stream from %s failed", client[-8:])
        finally:
            self._tasks.discard(task)
            self._open[client] -= 1
            if self._open[client] <= 0:
                del self._open[client]
            if self._circuits.get(client) is circuit:
                del self._circuits[client]
            self._count_circuits()
            writer.close()

    async def _forward(self, origin: str, target: str, data: List[bytes]) -> None:
        circuit = self._circuits.get(target)
        if circuit is None or not self._allowed(target):
            self._refuse(origin, NO_ROUTE)  # the sender's hop fails by its deadline, as on a lost peer
            return
        size = sum(len(d) for d in data)
        await self._take(size)
        try:
            async with circuit.lock:
                await asyncio.wait_for(_write_pair(circuit.writer, origin, data), RELAY_WRITE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a broken target stream: its client re-opens one
            self._refuse(origin, WRITE_FAILED)
            circuit.writer.close()
            if self._circuits.get(target) is circuit:
                del self._circuits[target]
            return
        self.relayed_bytes += size
        self.relayed_frames += 1
        if self.metrics is not None and hasattr(self.metrics, "count_relayed"):
            self.metrics.count_relayed(size)

    async def _handle_state(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A state request from a member to a member nobody can dial (the first frame names it): piped to the
        target's state handler over the connection the target keeps to this relay, untouched both ways (the
        client checks a piped state against its source's signed sketch, :func:`fetch_verified_state`)."""
        client, target_writer, registered = str(stream_info.peer_id), None, False
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            refusal = (NOT_RELAY if not self.enabled() else NOT_MEMBER if not self._allowed(client)
                       else TOO_MANY_CIRCUITS if self._state_slots.locked()
                       or self._state_clients[client] >= MAX_RELAYED_STATE_STREAMS_PER_PEER else None)
            if refusal is not None:
                self._refuse(client, refusal)
                return
            self._state_clients[client] += 1
            registered = True
            async with self._state_slots:
                head = await asyncio.wait_for(read_frame(reader, MAX_PEER_FRAME_BYTES), RELAY_WRITE_TIMEOUT_S)
                target = decode_peer(b"".join(head)) if head is not None else None
                if not target or not self._allowed(target):
                    self._refuse(client, BAD_PEER_FRAME if not target else NO_ROUTE)
                    return
                peer_id = import_hivemind().p2p.PeerID.from_base58(target)
                _, target_reader, target_writer = await asyncio.wait_for(
                    self.p2p.call_binary_stream_handler(peer_id, relayed_state_handler_name(self.run_id)),
                    RELAY_WRITE_TIMEOUT_S)
                vouched = await self._vouches(client)
                await _write_frame(target_writer, [encode_relayed_origin(client, vouched)], *_frame_format())
                self.relayed_states += 1
                if self.metrics is not None and hasattr(self.metrics, "count_relayed_state"):
                    self.metrics.count_relayed_state()
                await asyncio.wait_for(self._pipe(reader, writer, target_reader, target_writer), RELAYED_STATE_TIMEOUT_S)
        except asyncio.CancelledError:
            return
        except Exception as e:  # noqa: BLE001 - one client's stream must not end the relay
            self._refuse(client, STATE_FAILED)
            logger.debug("relayed state stream from %s failed: %r", client[-8:], e)
        finally:
            self._tasks.discard(task)
            if registered:
                self._state_clients[client] -= 1
                if self._state_clients[client] <= 0:
                    del self._state_clients[client]
            writer.close()
            if target_writer is not None:
                target_writer.close()

    async def _vouches(self, client: str) -> bool:
        """Whether this node's admission vouches for ``client`` (a challenge it answered, cached by admission)."""
        return self.vouch is not None and await ask_vouch(self.vouch, client, RELAY_VOUCH_TIMEOUT_S)

    async def _pipe(self, reader, writer, target_reader, target_writer) -> None:
        """Client -> target (at most :data:`MAX_RELAYED_REQUEST_BYTES`) and target -> client (paced like frames,
        counted as relayed bytes) until the target ends its answer."""

        async def upstream() -> None:
            sent = 0
            while chunk := await reader.read(OFF_LOOP_BYTES):
                sent += len(chunk)
                if sent > MAX_RELAYED_REQUEST_BYTES:
                    target_writer.close()  # ends the answer too: nothing more is piped
                    return
                target_writer.write(chunk)
                await target_writer.drain()

        up = asyncio.create_task(upstream())
        try:
            while chunk := await target_reader.read(OFF_LOOP_BYTES):
                await self._take(len(chunk))
                writer.write(chunk)
                await writer.drain()
                self.relayed_bytes += len(chunk)
                if self.metrics is not None and hasattr(self.metrics, "count_relayed_state"):
                    self.metrics.count_relayed_state(len(chunk))
        finally:
            up.cancel()
            await asyncio.gather(up, return_exceptions=True)

    async def _take(self, size: int) -> None:
        """Wait until ``size`` bytes fit the relay's rate (frames queue in arrival order). A frame larger
        than one second's worth waits for a full second's tokens and leaves a debt, so the average holds."""
        async with self._pace:
            now = time.monotonic()
            self._tokens = min(self.bytes_per_s, self._tokens + (now - self._refilled) * self.bytes_per_s)
            self._refilled = now
            need = min(float(size), self.bytes_per_s)
            if self._tokens < need:
                await asyncio.sleep((need - self._tokens) / self.bytes_per_s)
                self._tokens, self._refilled = need, time.monotonic()
            self._tokens -= size

    def _count_circuits(self) -> None:
        if self.metrics is not None and hasattr(self.metrics, "set_relay_circuits"):
            self.metrics.set_relay_circuits(self.circuits)

    def status(self) -> dict:
        return {"circuits": self.circuits, "circuits_opened": self.circuits_opened,
                "relayed_bytes": self.relayed_bytes, "relayed_frames": self.relayed_frames,
                "relayed_states": self.relayed_states,
                "refused": dict(self.refused)}


Deliver = Callable[[str, List[bytes]], Awaitable[bool]]


class RelayClient:
    """A NATed node's streams to its relays: frames to peers it cannot connect to go out on them, and frames
    relayed to it come in on them (handed to ``deliver(origin, data)``, the data plane's frame pipeline)."""

    def __init__(self, p2p, run_id: str, relays: Callable[[], List[str]], needs_relay: Callable[[str], bool],
                 behind_nat: Callable[[], bool], allow: Optional[Callable[[str], bool]], max_frame_bytes: int):
        """``relays()``: the members serving as relays, in the order every node picks them (by peer id);
        ``needs_relay(peer)``: True when no direct connection to ``peer`` can exist (both behind NAT);
        ``behind_nat()``: True when nobody can dial this node (it then keeps streams open to its relays)."""
        self.p2p, self.name, self.allow, self._behind_nat = p2p, relay_handler_name(run_id), allow, behind_nat
        self._relays, self._needs_relay, self.max_frame_bytes = relays, needs_relay, max_frame_bytes
        self._circuits: Dict[str, _Circuit] = {}
        self._readers: Dict[str, asyncio.Task] = {}
        self._opening: Dict[str, asyncio.Lock] = {}
        self._unreachable: Dict[str, float] = {}  # relay -> monotonic time until which it is passed over
        self._failing_since: Dict[str, float] = {}  # relay -> first failure of the tries that failed since
        self._deliver: Optional[Deliver] = None
        self._loop_task: Optional[asyncio.Task] = None
        self.sent_bytes = 0
        self.received_bytes = 0

    def chosen(self) -> List[str]:
        """The relays this node keeps a stream to (and senders pick first): the first in the common order that
        this node could reach when it last tried (one it could not is passed over for :data:`RELAY_RETRY_S`)."""
        now = time.monotonic()
        return [r for r in self._relays() if (self.allow is None or self.allow(r))
                and self._unreachable.get(r, 0.0) <= now][:RELAYS_PER_CLIENT]

    def route(self, peer: str) -> Optional[str]:
        """The relay a frame to ``peer`` goes through (a chosen one this node holds a stream to first), or None
        to send it directly."""
        if not self._needs_relay(peer):
            return None
        relays = self.chosen()
        return next((r for r in relays if r in self._circuits), relays[0] if relays else None)

    def _failed(self, relay: str, error: BaseException) -> None:
        """A stream to ``relay`` did not open: once they have failed for :data:`RELAY_DEAD_AFTER_S`, it is
        passed over for :data:`RELAY_RETRY_S`."""
        now = time.monotonic()
        since = self._failing_since.setdefault(relay, now)
        if now - since < RELAY_DEAD_AFTER_S or self._unreachable.get(relay, 0.0) > now:
            logger.debug("relay %s: no stream yet: %r", relay[-8:], error)
            return
        level = logging.DEBUG if relay in self._unreachable else logging.WARNING  # one warning per dead relay
        logger.log(level, "relay %s cannot be reached (%s, for %.0f s); using the next relay, and trying it "
                   "again every %.0f s", relay[-8:], str(error).splitlines()[0][:200] if str(error) else
                   type(error).__name__, now - since, RELAY_RETRY_S)
        self._unreachable[relay] = now + RELAY_RETRY_S

    def start(self, deliver: Deliver) -> None:
        self._deliver = deliver
        self._loop_task = asyncio.create_task(self._keep_open(), name="relay-client")

    async def close(self) -> None:
        tasks = [t for t in (self._loop_task, *self._readers.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for circuit in self._circuits.values():
            circuit.writer.close()
        self._circuits.clear()

    async def _keep_open(self) -> None:
        """Keep a stream open to each chosen relay while this node needs one (only a node nobody can dial
        needs one: its relays then hold a way back to it)."""
        async def open_one(relay: str) -> None:
            try:
                await asyncio.wait_for(self._open(relay), RELAY_OPEN_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - passed over for a while; the next one is opened meanwhile
                self._failed(relay, e)

        while True:
            missing = [r for r in (self.chosen() if self._behind_nat() else ()) if r not in self._circuits]
            await asyncio.gather(*map(open_one, missing))  # at once: a dead relay's dial must not hold the others
            await asyncio.sleep(RELAY_REFRESH_S)

    async def _open(self, relay: str) -> _Circuit:
        lock = self._opening.setdefault(relay, asyncio.Lock())
        async with lock:
            circuit = self._circuits.get(relay)
            if circuit is not None:
                return circuit
            hivemind = import_hivemind()
            _, reader, writer = await self.p2p.call_binary_stream_handler(
                hivemind.p2p.PeerID.from_base58(relay), self.name)
            circuit = self._circuits[relay] = _Circuit(writer)
            self._failing_since.pop(relay, None), self._unreachable.pop(relay, None)
            header_len, byteorder = _frame_format()
            async with circuit.lock:  # a hello (an empty peer-id frame): registers us, nothing to forward
                await _write_frame(writer, [b""], header_len, byteorder)
            self._readers[relay] = asyncio.create_task(self._read(relay, reader, circuit), name="relay-reader")
            logger.info("reachability: reachable via relay %s (other nodes behind NAT reach this one through it)",
                        relay[-8:])
            return circuit

    def _drop(self, relay: str, circuit: _Circuit) -> None:
        circuit.writer.close()
        if self._circuits.get(relay) is circuit:
            del self._circuits[relay]

    async def _read(self, relay: str, reader: asyncio.StreamReader, circuit: _Circuit) -> None:
        try:
            while True:
                head = await read_frame(reader, MAX_PEER_FRAME_BYTES)
                origin = decode_peer(b"".join(head)) if head is not None else None
                if not origin:
                    return
                data = await read_frame(reader, self.max_frame_bytes)
                if data is None:
                    return
                size = sum(map(len, data))
                self.received_bytes += size
                # as on the origin's own stream; a refused frame or origin never ends the relay's stream
                await self._deliver(origin, b"".join(data) if size <= OFF_LOOP_BYTES else data)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the stream is re-opened by the next refresh
            logger.debug("relay stream from %s failed", relay[-8:], exc_info=True)
        finally:
            self._drop(relay, circuit)
            self._readers.pop(relay, None)

    async def send(self, relay: str, target: str, parts: List[bytes]) -> int:
        """Write one data frame for ``target`` to ``relay``; its size. A broken stream is reopened, as the data
        plane reopens a direct one (:data:`SEND_RETRIES`)."""
        for attempt in range(SEND_RETRIES + 1):
            try:
                circuit = self._circuits.get(relay) or await asyncio.wait_for(self._open(relay), RELAY_OPEN_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._failed(relay, e)  # the next frame takes the next relay
                raise
            try:
                async with circuit.lock:
                    size = await _write_pair(circuit.writer, target, parts)
                self.sent_bytes += size
                return size
            except Exception:
                self._drop(relay, circuit)
                if attempt == SEND_RETRIES:
                    raise
        raise AssertionError("unreachable")


class Relay:
    """What a data plane needs of relaying: a client (always; idle unless this node is behind NAT) and a
    server when this node serves as a relay. Made by the trainer's host, started and closed by the data plane."""

    def __init__(self, client: RelayClient, server: Optional[RelayServer] = None):
        self.client, self.server = client, server

    async def start(self, deliver: Deliver, max_frame_bytes: int) -> None:
        """Serve and keep relay streams open; ``max_frame_bytes``: the data plane's frame cap, for both ends."""
        self.client.max_frame_bytes = max_frame_bytes
        if self.server is not None:
            self.server.max_frame_bytes = max_frame_bytes
            await self.server.start()
        self.client.start(deliver)

    async def close(self) -> None:
        await self.client.close()
        if self.server is not None:
            await self.server.close()

    def route(self, peer: str) -> Optional[str]:
        return self.client.route(peer)

    async def send(self, relay: str, target: str, parts: List[bytes]) -> int:
        return await self.client.send(relay, target, parts)
