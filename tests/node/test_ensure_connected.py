"""A node that just dialled us is reachable before its advert reaches our view: a relay vouching for a NATed
candidate (its challenge goes back over the candidate's own connection) must not call it unreachable."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import types

import pytest

import node.compat  # noqa: F401  (before hivemind)
from hivemind.p2p import P2P
from multiaddr import Multiaddr

from node.swarm.daemon import Daemon

pytestmark = pytest.mark.timeout(60)
LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def test_a_connected_peer_without_an_advert_counts_as_connected_and_a_stranger_does_not():
    async def main():
        hosts = []
        try:
            for _ in range(3):
                hosts.append(await P2P.create(host_maddrs=LOCAL))
            me, dialler, stranger = hosts
            maddr = (await me.get_visible_maddrs())[0]
            await dialler._client.connect(me.peer_id, [Multiaddr(str(maddr).split("/p2p/")[0])])
            host = types.SimpleNamespace(p2p=me, view=types.SimpleNamespace(get=lambda peer: None),
                                         log=logging.getLogger("test"))
            return (await Daemon.ensure_connected(host, dialler.peer_id.to_base58(), timeout=5),
                    await Daemon.ensure_connected(host, stranger.peer_id.to_base58(), timeout=2))
        finally:
            for h in hosts:
                with contextlib.suppress(Exception):
                    await h.shutdown()

    assert asyncio.run(main()) == (True, False)
