"""Learning whether other peers can dial us: a dial-back by peers we are connected to (``skippipe/dialback/1``).

Why a dial-back of our own: hivemind's p2pd runs go-libp2p's AutoNAT, but its control protocol has no call
that reports the reachability AutoNAT concluded (``identify`` returns addresses only), and AutoNAT ignores
private address ranges, so it says nothing on a LAN. So a node asks peers it already has a connection with
(it dialled them, which works behind any NAT) to open a plain TCP connection back to its p2pd port.

The asked peer only ever dials the address it *observed* the stream coming from (the requester's public
address as seen through any NAT), at no more than :data:`MAX_DIALBACK_PORTS` ports: a peer cannot use it to
make others connect to a third party. The answer names the observed address, so a node behind a router
learns the address and port it should forward and announce.

Outcomes (:class:`protocol.messages.Reachability`): a dial-back that connected -> ``DIRECT``; every asked
peer failed to connect -> ``RELAYED`` when the node holds a relay reservation, else ``OUTBOUND_ONLY``;
nobody answered -> ``UNKNOWN`` (asked again later).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import msgpack
from multiaddr import Multiaddr

from node.net.framing import FrameTooLarge, peer_stream_guard, read_frame, stream_caller, write_frame
from protocol.messages import MAX_PORT, Reachability

__all__ = ["DIALBACK_PROTOCOL", "MAX_DIALBACK_PORTS", "DIALBACK_CONNECT_TIMEOUT_S", "DialbackHandler",
           "DialbackAnswer", "ReachabilityReport", "ask_dialback", "learn_reachability", "listen_ports",
           "is_relayed_maddr", "advice_line"]

logger = logging.getLogger(__name__)

#: libp2p protocol id of the dial-back request.
DIALBACK_PROTOCOL = "skippipe/dialback/1"
#: Ports one request may name (p2pd listens on one or two): bounds the connections one request causes.
MAX_DIALBACK_PORTS = 4
#: Dial-back requests answered at once; more are refused (each one opens up to MAX_DIALBACK_PORTS connections).
MAX_CONCURRENT_DIALBACKS = 8
#: Largest request or answer frame (a few ports, an address): anything larger is not ours.
MAX_DIALBACK_FRAME_BYTES = 256
#: Seconds a dial-back connection may take: a home router drops the SYN, so failure shows as this timeout.
DIALBACK_CONNECT_TIMEOUT_S = 2.0
#: Seconds the requester waits for one peer's whole answer: the (concurrent) connects plus a slow round trip.
DIALBACK_ANSWER_TIMEOUT_S = DIALBACK_CONNECT_TIMEOUT_S + 5.0
#: What refuses a request: a limit broken or a request that is not a list of ports.
_DIALBACK_REFUSALS = (FrameTooLarge, asyncio.TimeoutError, ValueError, msgpack.UnpackException)


def listen_ports(maddrs: Sequence[str]) -> list[int]:
    """Distinct TCP ports of our p2pd addresses (relay addresses excluded), at most :data:`MAX_DIALBACK_PORTS`."""
    ports: list[int] = []
    for m in maddrs:
        if is_relayed_maddr(m):
            continue
        try:
            port = int(Multiaddr(m).value_for_protocol("tcp"))
        except Exception:  # noqa: BLE001 - not a TCP address
            continue
        if 0 < port <= MAX_PORT and port not in ports:
            ports.append(port)
    return ports[:MAX_DIALBACK_PORTS]


def is_relayed_maddr(maddr: str) -> bool:
    """True for a circuit-relay address (``.../p2p-circuit/...``): we are reachable through that relay."""
    return "/p2p-circuit" in maddr


def _observed_ip(stream_info) -> Optional[str]:
    try:
        addr = stream_info.addr
        if "/p2p-circuit" in str(addr):
            return None  # a relayed stream: its address is the relay's, dialling it says nothing about the peer
        return addr.value_for_protocol("ip4")
    except Exception:  # noqa: BLE001
        return None


async def _can_connect(ip: str, port: int, timeout_s: float) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout_s)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


class DialbackHandler:
    """``await p2p.add_binary_stream_handler(DIALBACK_PROTOCOL, DialbackHandler(allow=daemon.is_peer_allowed))``.

    Request: msgpack ``{"ports": [int, ...]}``; answer: msgpack ``{"ip": observed ip or "", "open": [ports]}``.
    """

    def __init__(self, allow: Optional[Callable[[str], bool]] = None, *,
                 connect_timeout_s: float = DIALBACK_CONNECT_TIMEOUT_S):
        self.allow, self.connect_timeout_s = allow, connect_timeout_s
        self.answered = 0
        self.refused = 0
        self._busy = 0

    async def __call__(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        caller = stream_caller(stream_info)
        async with peer_stream_guard("dial-back request", caller, writer, self._refuse, _DIALBACK_REFUSALS):
            if (self.allow is not None and not self.allow(caller)) or self._busy >= MAX_CONCURRENT_DIALBACKS:
                self._refuse()
                return
            self._busy += 1
            try:
                await self._answer(stream_info, reader, writer)
            finally:
                self._busy -= 1

    def _refuse(self) -> None:
        self.refused += 1

    async def _answer(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = msgpack.unpackb(await read_frame(reader, MAX_DIALBACK_FRAME_BYTES, self.connect_timeout_s),
                                  raw=False, max_array_len=MAX_DIALBACK_PORTS, max_map_len=1)
        ports = request.get("ports") if isinstance(request, dict) else None
        if not isinstance(ports, list) or not all(type(p) is int and 0 < p <= MAX_PORT for p in ports):
            self.refused += 1
            return
        ip = _observed_ip(stream_info)
        opened = []
        if ip is not None:
            results = await asyncio.gather(*(_can_connect(ip, p, self.connect_timeout_s) for p in ports))
            opened = [p for p, ok in zip(ports, results) if ok]
        await write_frame(writer, msgpack.packb({"ip": ip or "", "open": opened}))
        self.answered += 1


@dataclass(frozen=True)
class DialbackAnswer:
    """What one peer saw: the address our stream came from, and which of our ports it could connect to."""

    peer: str
    observed_ip: str
    open_ports: tuple[int, ...]


async def ask_dialback(p2p, peer_id, ports: Sequence[int], timeout_s: float = DIALBACK_ANSWER_TIMEOUT_S
                       ) -> Optional[DialbackAnswer]:
    """Ask ``peer_id`` (a hivemind ``PeerID`` we can reach) to dial us back; None if it did not answer."""
    async def exchange() -> DialbackAnswer:
        _, reader, writer = await p2p.call_binary_stream_handler(peer_id, DIALBACK_PROTOCOL)
        try:
            await write_frame(writer, msgpack.packb({"ports": list(ports)[:MAX_DIALBACK_PORTS]}))
            raw = msgpack.unpackb(await read_frame(reader, MAX_DIALBACK_FRAME_BYTES, timeout_s), raw=False,
                                  max_array_len=MAX_DIALBACK_PORTS, max_map_len=2, max_str_len=64)
        finally:
            writer.close()
        ip, opened = raw.get("ip"), raw.get("open")
        if not (isinstance(ip, str) and isinstance(opened, list) and all(type(p) is int for p in opened)):
            raise ValueError("malformed dial-back answer")
        return DialbackAnswer(peer=peer_id.to_base58(), observed_ip=ip,
                              open_ports=tuple(p for p in opened if p in ports))

    try:
        return await asyncio.wait_for(exchange(), timeout_s)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - a peer that cannot or will not answer
        logger.debug("dial-back by %s: no answer (%r)", str(peer_id)[-8:], e)
        return None


@dataclass(frozen=True)
class ReachabilityReport:
    """What a node learned about itself: how others reach it, from which address they see it, and why."""

    reachability: Reachability
    observed_ip: str = ""
    ports: tuple[int, ...] = ()
    relays: tuple[str, ...] = ()
    answers: tuple[DialbackAnswer, ...] = field(default=())


async def learn_reachability(p2p, peers: Sequence, maddrs: Sequence[str]) -> ReachabilityReport:
    """Ask every peer in ``peers`` (hivemind ``PeerID``\\ s, concurrently) to dial us back at our ``maddrs``' ports."""
    ports = listen_ports(maddrs)
    relays = tuple(sorted({m.split("/p2p-circuit")[0] for m in maddrs if is_relayed_maddr(m)}))
    if not ports or not peers:
        return ReachabilityReport(Reachability.RELAYED if relays else Reachability.UNKNOWN, ports=tuple(ports),
                                  relays=relays)
    answers = [a for a in await asyncio.gather(*(ask_dialback(p2p, p, ports) for p in peers)) if a is not None]
    observed = next((a.observed_ip for a in answers if a.observed_ip), "")
    if any(a.open_ports for a in answers):
        kind = Reachability.DIRECT
    elif not answers:
        kind = Reachability.RELAYED if relays else Reachability.UNKNOWN
    else:
        kind = Reachability.RELAYED if relays else Reachability.OUTBOUND_ONLY
    return ReachabilityReport(kind, observed, tuple(ports), relays, tuple(answers))


def advice_line(report: ReachabilityReport) -> str:
    """The one start-up line that tells the user how others reach this node, and what to do if they cannot."""
    port = report.ports[0] if report.ports else 0
    public = report.observed_ip or "<public ip>"
    fix = (f"forward TCP port {port} on your router to this machine and pass "
           f"--announce-maddrs /ip4/{public}/tcp/{port}")
    if report.reachability is Reachability.DIRECT:
        return f"reachability: reachable directly (a peer dialled back {public}:{port})"
    if report.reachability is Reachability.RELAYED:
        return f"reachability: not dialable, reachable via relay {', '.join(report.relays)}; to be reached directly, {fix}"
    if report.reachability is Reachability.OUTBOUND_ONLY:
        return (f"reachability: not reachable (peers see this node as {public}, and none could connect back): "
                f"it uses only connections it opens; {fix}")
    return "reachability: unknown (no peer has answered a dial-back yet; asking again later)"
