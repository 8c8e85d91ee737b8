"""``skippipe export --peer``: pull every stage's state from the live replicas of a running swarm.

The exporter joins as a plain libp2p client (no stage, no DHT writes), asks the given peer over RPC what
the run is (model shape, data and tokenizer settings, the replicas of each stage) and then downloads each
stage's weights over the state-transfer protocol the replicas already serve to joiners. In a private swarm
the replicas serve members only, so pull from a member's machine with ``--from`` instead.
"""

from __future__ import annotations

import pathlib
from typing import Dict, List, Sequence

from node.errors import UserError

__all__ = ["pull_stages"]

#: seconds a replica may take to hand over its stage (the state of a 500M-parameter stage is ~1 GB)
PULL_TIMEOUT_S = 300.0


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


def pull_stages(maddrs: Sequence[str], timeout_s: float = PULL_TIMEOUT_S):
    """A :class:`node.eval.omission.LoadedModel` built from the live replicas reachable through ``maddrs``."""
    import asyncio

    return asyncio.run(_pull(list(maddrs), timeout_s))


#: Tries of each RPC to the ``--peer`` node: a busy node has closed an RPC stream unanswered (seen under a full
#: test suite's load), and a second ask a second later was answered.
PEER_RPC_TRIES = 3


async def _ask_peer(p2p, peer, maddr: str, method: str, params: dict):
    """``method`` on the ``--peer`` node, asked up to :data:`PEER_RPC_TRIES` times unless it refuses; one error line."""
    import asyncio

    from node.net.rpc import RpcCallError, call_p2p

    for attempt in range(1, PEER_RPC_TRIES + 1):
        try:
            return await call_p2p(p2p, peer, method, params, timeout=30)
        except RpcCallError as e:
            if attempt == PEER_RPC_TRIES or "access denied" in str(e):
                raise UserError(f"{maddr}: {e}") from None
            await asyncio.sleep(1.0)


async def _pull(maddrs: List[str], timeout_s: float):
    import node.compat  # noqa: F401
    from hivemind.p2p import P2P, PeerID
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
    from multiaddr import Multiaddr

    from node.dataplane.state_codec import ExpectedState
    from node.dataplane.state_transfer import StateTransferError, fetch_verified_state
    from node.eval.omission import LoadedModel
    from node.train.model import ModelConfig, build_stage

    try:
        peer = PeerID.from_base58(Multiaddr(maddrs[0]).value_for_protocol("p2p"))
    except Exception:  # noqa: BLE001 - the library raises several kinds
        raise UserError(f"--peer {maddrs[0]!r} must be a multiaddr ending with /p2p/<peer id>") from None
    try:
        p2p = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/0.0.0.0/tcp/0"], dht_mode="client")
    except P2PDaemonError:
        raise UserError(f"cannot reach {maddrs[0]}") from None
    try:
        training = await _ask_peer(p2p, peer, maddrs[0], "training", {"limit": 1})
        swarm = await _ask_peer(p2p, peer, maddrs[0], "swarm", {})
        if not isinstance(training, dict) or "model" not in training:
            raise UserError(f"{maddrs[0]} does not train (no --train) or runs an older version: nothing to export")
        try:
            config = ModelConfig.from_dict(training["model"])
        except (TypeError, ValueError, AttributeError) as e:
            raise UserError(f"{maddrs[0]} describes a model this version cannot build: {_first_line(e)}") from None
        replicas: Dict[int, List[str]] = {s: [] for s in range(config.n_stages)}
        try:
            for entry in swarm.get("peers", []):
                if str(entry.get("state")) in ("ONLINE", "DRAINING"):
                    for s in entry.get("stages", []):
                        replicas.setdefault(int(s), []).append(str(entry["peer_id"]))
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise UserError(f"{maddrs[0]} answered a malformed swarm view: {_first_line(e)}") from None
        missing = [s for s, ps in replicas.items() if not ps]
        if missing:
            raise UserError(f"stages {missing} have no live replica in the swarm: nothing to pull them from")
        modules, iterations = [], []
        for stage in range(config.n_stages):
            module = build_stage(config, stage, 0)
            expected = ExpectedState.of_module(module)
            try:
                # the other replicas of the stage must back the weights one of them serves
                snap, _ = await fetch_verified_state(p2p, str(training["run_id"]), replicas[stage], stage, 0,
                                                     timeout_s=timeout_s, expected=expected)
            except StateTransferError as e:
                raise UserError(f"{e} (in a private swarm the replicas serve members only: export with --from)") \
                    from None
            assert snap.state is not None
            module.load_state_dict(snap.state["model"])
            modules.append(module)
            iterations.append(snap.iteration)
    finally:
        await p2p.shutdown()
    meta = {"run_id": training["run_id"], "model": training["model"], "data": training.get("data") or {},
            "peer_id": "", "stage_iterations": iterations}
    return LoadedModel(run_dir=pathlib.Path("."), iteration=min(iterations), config=config, modules=modules,
                       meta=meta)
