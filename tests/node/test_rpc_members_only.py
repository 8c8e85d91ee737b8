"""A private swarm's state over libp2p RPC is readable by members (and key holders) only."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest

from node.errors import UserError
from node.net.access import HELLO_PROOF_PARAM, SwarmAccess
from node.net.rpc import CALLER_PARAM
from node.swarm.rpc_api import members_only, rpc_refusal

KEY = b"k" * 32


def _daemon(access, members=()):
    return SimpleNamespace(access=access, is_peer_allowed=lambda p: p in members,
                           log=logging.getLogger("test"))


async def test_refusal_rules():
    keyed = _daemon(SwarmAccess(KEY), members={"QmMember"})
    outsider = {CALLER_PARAM: "QmOutsider"}
    assert "access denied" in rpc_refusal(keyed, "swarm", outsider)
    assert rpc_refusal(keyed, "swarm", {CALLER_PARAM: "QmMember"}) is None
    assert rpc_refusal(keyed, "swarm", {}) is None  # local HTTP: the operator
    assert rpc_refusal(keyed, "hello", outsider) is None and rpc_refusal(keyed, "health", outsider) is None
    proved = dict(outsider, **{HELLO_PROOF_PARAM: SwarmAccess(KEY).hello_proof("QmOutsider")})
    assert rpc_refusal(keyed, "training", proved) is None
    stolen = dict(outsider, **{HELLO_PROOF_PARAM: SwarmAccess(KEY).hello_proof("QmMember")})
    assert rpc_refusal(keyed, "training", stolen) is not None  # a proof is bound to its caller
    assert rpc_refusal(_daemon(SwarmAccess()), "swarm", outsider) is None  # an open swarm stays open

    async def method(params):
        return "state"

    gated = members_only(keyed, "swarm", method)
    with pytest.raises(PermissionError):
        await gated(outsider)
    assert await gated({CALLER_PARAM: "QmMember"}) == "state"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_private_swarm_state_over_libp2p_needs_the_key(tmp_path):
    import asyncio

    from node.cli.swarm_cmd import fetch_status
    from node.net.rpc import RpcCallError, call_http, call_p2p
    from node.launch.process_swarm import ProcessSwarm

    key = os.urandom(32).hex().encode()
    (tmp_path / "swarm.key").write_bytes(key)
    swarm = ProcessSwarm(2, [1, 1], base_dir=tmp_path / "swarm", run_id="private",
                         extra_args=["--swarm-key", str(tmp_path / "swarm.key")])
    try:
        swarm.start(timeout=180)
        target = swarm.nodes[0]
        assert call_http(target.rpc_url, "swarm", {})["peers"]  # local HTTP: the operator's
        with pytest.raises(UserError, match="access denied"):
            fetch_status(None, target.maddr, 20)  # `skippipe swarm status --peer` without the key
        data = fetch_status(None, target.maddr, 20, key.strip())
        assert data["swarm"]["peers"] and data["status"]

        async def health():
            import node.compat  # noqa: F401
            from hivemind.p2p import P2P, PeerID

            p2p = await P2P.create(initial_peers=[target.maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            try:
                peer = PeerID.from_base58(target.peer_id)
                with pytest.raises(RpcCallError, match="access denied"):
                    await call_p2p(p2p, peer, "schedule", timeout=20)
                return await call_p2p(p2p, peer, "health", timeout=20)
            finally:
                await p2p.shutdown()

        assert asyncio.run(health())["ok"] is True
    finally:
        swarm.stop()
