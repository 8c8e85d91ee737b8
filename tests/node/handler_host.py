"""A process hosting the hardened stream handlers on a real hivemind P2P, for the fuzz tests.

``python -m tests.node.handler_host READY_FILE [ALLOWED_PEER ...]`` starts a P2P on 127.0.0.1 and serves
the link-probe handler (:class:`node.net.ping.PingHandler`), a stage-state server
(:class:`node.dataplane.state_transfer.StateServer`, snapshot = 1 MiB of zeros) and the node RPC over
libp2p (:class:`node.net.rpc.RpcServer`, one method ``echo``). With ALLOWED_PEERs only those peers
are members (as ``Daemon.is_peer_allowed`` with a swarm key). When up it writes
``{"maddr", "peer_id", "pid"}`` to READY_FILE, then runs until killed. Its RSS is what the tests watch.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import node.compat  # noqa: F401  (before hivemind)
from hivemind.p2p import P2P

from node.dataplane.state_transfer import StateServer, StateSnapshot
from node.net.ping import PING_PROTOCOL, PingHandler
from node.net.rpc import RpcServer

RUN_ID = "fuzz"
STATE_BYTES = 1 << 20


async def main(ready_file: str, allowed: list[str]) -> None:
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    me = p2p.peer_id.to_base58()
    members = set(allowed) | {me}
    allow = (lambda peer: peer in members) if allowed else None

    async def snapshot(stage: int, min_iteration: int) -> StateSnapshot:
        if stage != 0:
            raise ValueError(f"stage {stage} is not held here")
        return StateSnapshot(0, max(min_iteration, 0), 0.0, bytes(STATE_BYTES))

    await p2p.add_binary_stream_handler(PING_PROTOCOL, PingHandler(allow=allow))
    await StateServer(p2p, RUN_ID, snapshot, allow=allow).start()
    rpc = RpcServer()
    rpc.allow_p2p = allow

    async def echo(params: dict):
        return {k: v for k, v in params.items() if k != "_caller"}

    rpc.register("echo", echo)
    rpc.register("hello", echo)
    await rpc.attach_p2p(p2p)
    maddr = f"{(await p2p.get_visible_maddrs())[0]}"
    tmp = ready_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"maddr": maddr, "peer_id": me, "pid": os.getpid()}, f)
    os.replace(tmp, ready_file)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2:]))
