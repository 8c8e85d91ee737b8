"""The data-plane relay on real libp2p hosts (loopback, one process): a frame from A to B through relay R
arrives as A's, through B's own data-plane checks; what a hostile peer sends the relay is refused.

Three members (R relays, A and B are told they need it) and an outsider. B's plane has a guard-less
pipeline with the allowlist, so a frame relayed for a non-member origin is refused by B as one on that
origin's own stream would be.
"""

from __future__ import annotations

import asyncio

import node.compat  # noqa: F401  (before hivemind)
import pytest
from hivemind.p2p import P2P, PeerID
from multiaddr import Multiaddr

from node.dataplane import relay as relay_module
from node.dataplane.relay import (BAD_PEER_FRAME, NO_ROUTE, NOT_MEMBER, OVERSIZED, Relay, RelayClient, RelayServer,
                                  relay_handler_name)
from node.dataplane.transport import DataPlane
from protocol.messages import IterationDone

pytestmark = pytest.mark.timeout(120)
RUN = "relaytest"
#: Frame cap on the relay for the test: small, so an oversized claim is cheap to make.
CAP = 1 << 16


async def _host(*peers: P2P) -> P2P:
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    for other in peers:
        maddr = (await other.get_visible_maddrs())[0]
        await p2p._client.connect(other.peer_id, [Multiaddr(str(maddr).split("/p2p/")[0])])
    return p2p


async def _until(check, what: str, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def _frame(body: bytes) -> bytes:
    return len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body


async def test_a_frame_crosses_the_relay_as_its_origins_and_hostile_bytes_are_refused():
    r = await _host()
    a, b, outsider = await _host(r), await _host(r), await _host(r)
    ids = {name: p.peer_id.to_base58() for name, p in (("r", r), ("a", a), ("b", b), ("out", outsider))}
    members = {ids["r"], ids["a"], ids["b"]}
    allow = members.__contains__
    server = RelayServer(r, RUN, allow, CAP)
    got: list = []
    planes = []
    try:
        await server.start()
        for p2p, sink in ((a, None), (b, got)):
            client = RelayClient(p2p, RUN, relays=lambda: [ids["r"]], needs_relay=lambda peer: peer != ids["r"],
                                 behind_nat=lambda: True, allow=allow, max_frame_bytes=CAP)
            plane = DataPlane(p2p, RUN, (lambda m, s, sink=sink: sink.append((m, s)) if sink is not None else None),
                              allow=allow, relay=Relay(client))
            await plane.start()
            planes.append(plane)
        await _until(lambda: server.circuits == 2, "both clients' streams on the relay")

        msg = IterationDone(RUN, 1, 0, ids["a"], {}, 0)
        await planes[0].send(ids["b"], msg)  # A has no direct way to B here: it goes through R
        await _until(lambda: got, "the relayed frame")
        assert got == [(msg, ids["a"])]  # delivered as A's, decoded by B's own plane
        assert server.relayed_frames == 1 and server.relayed_bytes > 0

        await planes[0].send(ids["out"], msg)  # no circuit for that target: dropped and counted
        await _until(lambda: server.refused[NO_ROUTE] == 1, "no_route")

        # an outsider may not open a circuit; a member's garbage ends only its own stream
        _, _, w = await outsider.call_binary_stream_handler(PeerID.from_base58(ids["r"]), relay_handler_name(RUN))
        w.write(_frame(b""))
        await w.drain()
        await _until(lambda: server.refused[NOT_MEMBER] == 1, "the outsider refused")
        w.close()
        _, _, w = await a.call_binary_stream_handler(PeerID.from_base58(ids["r"]), relay_handler_name(RUN))
        w.write(_frame(b"../../not a peer id"))
        await w.drain()
        await _until(lambda: server.refused[BAD_PEER_FRAME] == 1, "a bad peer-id frame refused")
        w.close()
        _, _, w = await a.call_binary_stream_handler(PeerID.from_base58(ids["r"]), relay_handler_name(RUN))
        w.write(_frame(ids["b"].encode()) + (CAP + 1).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        await w.drain()
        await _until(lambda: server.refused[OVERSIZED] == 1, "an oversized frame refused before its body")
        w.close()

        got.clear()
        await planes[0].send(ids["b"], msg)  # the circuits of A and B still work
        await _until(lambda: got, "a second relayed frame")
        assert server.relayed_frames == 2
    finally:
        for plane in planes:
            await plane.close()
        await server.close()
        for p2p in (r, a, b, outsider):
            await p2p.shutdown()


async def test_a_relay_nobody_can_reach_is_passed_over_for_the_next(monkeypatch):
    """The first relay in the common order advertises itself but cannot be reached (its host is gone, or its
    addresses are wrong): both NATed members open their streams to the second one and frames cross it."""
    monkeypatch.setattr(relay_module, "RELAY_OPEN_TIMEOUT_S", 3.0)
    monkeypatch.setattr(relay_module, "RELAY_DEAD_AFTER_S", 5.0)
    r, gone = await _host(), await _host()
    a, b = await _host(r), await _host(r)
    ids = {name: p.peer_id.to_base58() for name, p in (("r", r), ("gone", gone), ("a", a), ("b", b))}
    await gone.shutdown()
    members = {ids["r"], ids["gone"], ids["a"], ids["b"]}
    allow = members.__contains__
    server = RelayServer(r, RUN, allow, CAP)
    got: list = []
    planes, clients = [], []
    try:
        await server.start()
        for p2p, sink in ((a, None), (b, got)):
            client = RelayClient(p2p, RUN, relays=lambda: [ids["gone"], ids["r"]],
                                 needs_relay=lambda peer: peer not in (ids["r"], ids["gone"]),
                                 behind_nat=lambda: True, allow=allow, max_frame_bytes=CAP)
            plane = DataPlane(p2p, RUN, (lambda m, s, sink=sink: sink.append((m, s)) if sink is not None else None),
                              allow=allow, relay=Relay(client))
            await plane.start()
            planes.append(plane)
            clients.append(client)
        await _until(lambda: server.circuits == 2, "both clients' streams on the second relay")
        assert all(c.route(ids["b"]) == ids["r"] for c in clients)  # the relay they hold a stream to
        await _until(lambda: all(c.chosen() == [ids["r"]] for c in clients), "the dead relay passed over")
        assert all(c.route(ids["b"]) == ids["r"] for c in clients)

        msg = IterationDone(RUN, 1, 0, ids["a"], {}, 0)
        await planes[0].send(ids["b"], msg)
        await _until(lambda: got, "the frame relayed by the second relay")
        assert got == [(msg, ids["a"])] and server.relayed_frames == 1
    finally:
        for plane in planes:
            await plane.close()
        await server.close()
        for p2p in (r, a, b):
            await p2p.shutdown()
