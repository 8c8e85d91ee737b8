"""Real daemons on loopback, as subprocesses: join, views, epochs, crash, restart, forgery, CLI.

One 5-node swarm (heartbeat 1 s, advert TTL 3 s) is shared by the module; tests run in file
order and the later ones change membership (kill, restart). Every wait is a poll with a generous
deadline, never a timing assertion.
"""

from __future__ import annotations

import json
import signal
import socket
import time

import pytest

from node.launch.process_swarm import ProcessSwarm
from node.launch.procs import process_group_members
from tests.node.helpers import DEADLINE_S, error_lines, poll, rpc, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

N_NODES = 5
STAGE_SIZES = (2, 2, 1)
HEARTBEAT_S = 1.0
RUN_ID = "test-run"
#: The node the churn tests kill/restart/stop: a stage-1 replica, so a schedule stays possible.
CHURN_INDEX = 3


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    s = ProcessSwarm(N_NODES, STAGE_SIZES, base_dir=tmp_path_factory.mktemp("swarm"), run_id=RUN_ID, heartbeat_s=HEARTBEAT_S)
    s.start()
    groups = {}
    try:
        yield s
    finally:
        groups = {n.proc.pid: n.group_pids() for n in s.nodes if n.proc is not None}
        s.stop()
    # No daemon, p2pd or DHT child of any node survives a stop.
    leftovers = {pg: process_group_members(pg) for pg in groups}
    assert not any(leftovers.values()), f"processes left after stop: {leftovers}"


def online_ids(url: str) -> set[str]:
    return {p["peer_id"] for p in rpc(url, "swarm")["peers"] if p["state"] == "ONLINE"}


def live_nodes(swarm):
    return [n for n in swarm.nodes if n.alive]


def test_every_view_lists_all_nodes(swarm):
    expected = {n.peer_id for n in swarm.nodes}
    assert len(expected) == N_NODES
    for node in swarm.nodes:
        poll(lambda: online_ids(node.rpc_url) == expected, what=f"node {node.index} sees all {N_NODES} peers")
    view = rpc(swarm.nodes[0].rpc_url, "swarm")
    stages = {p["peer_id"]: p["stages"] for p in view["peers"]}
    assert stages == {n.peer_id: [n.stage] for n in swarm.nodes}
    for p in view["peers"]:
        assert p["gossip_peer_id"].startswith("12D3KooW")  # separate Ed25519 gossip identity
        assert p["gossip_peer_id"] != p["peer_id"]
        assert p["compute_s_per_sample_per_layer"] > 0


def test_links_are_measured_and_gossiped(swarm):
    def enough_links():
        links = rpc(swarm.nodes[0].rpc_url, "swarm")["links"]
        srcs = {l["src"] for l in links}
        return len(srcs) >= 2 and all(l["rtt_ms"] >= 0 for l in links)

    poll(enough_links, what="link reports from several peers")


def _epochs(swarm):
    return [rpc(n.rpc_url, "schedule") for n in live_nodes(swarm)]


def test_all_nodes_adopt_the_same_epoch(swarm):
    expected = {n.peer_id for n in swarm.nodes}

    def agreed():
        eps = _epochs(swarm)
        keys = {(e["epoch"], e["coordinator"], tuple(e["members"])) for e in eps}
        return len(keys) == 1 and eps[0]["epoch"] is not None and set(eps[0]["members"]) == expected and eps[0]

    epoch = poll(agreed, what="one schedule epoch on every node")
    data_nodes = sorted(n.peer_id for n in swarm.nodes if n.stage == 0)
    # Normally the lowest-id data node; a backup may take over if it was slow (a loaded CI box).
    assert epoch["coordinator"] in data_nodes
    sched = epoch["schedule"]
    assert [len(s) for s in sched["stages"]] == list(STAGE_SIZES)
    for path in sched["paths"]:
        assert path["route"][0] in sched["stages"][0]


def test_status_cli_table_json_and_peer(swarm):
    node = swarm.nodes[1]
    table = run_cli("swarm", "status", "--rpc", node.rpc_url)
    assert table.returncode == 0, table.stderr
    assert node.peer_id in table.stdout and "ONLINE" in table.stdout and "PEER" in table.stdout
    as_json = run_cli("swarm", "status", "--rpc", node.rpc_url, "--json")
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert data["status"]["peer_id"] == node.peer_id
    assert {p["peer_id"] for p in data["swarm"]["peers"]} >= {n.peer_id for n in swarm.nodes}
    over_p2p = run_cli("swarm", "status", "--peer", swarm.nodes[2].maddr, "--json")
    assert over_p2p.returncode == 0, over_p2p.stderr
    assert json.loads(over_p2p.stdout)["status"]["peer_id"] == swarm.nodes[2].peer_id
    health = rpc(node.rpc_url, "health")
    assert health["ok"] is True


def test_forged_adverts_are_rejected(swarm):
    import node.compat  # noqa: F401
    from hivemind import DHT
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils.crypto import RSAPrivateKey

    from node.swarm.adverts import stage_key
    from node.net.identity import load_or_create_identity
    from protocol.messages import StageAdvert, encode

    victim = swarm.nodes[2]
    victim_key = load_or_create_identity(victim.identity_path).public_key_bytes
    forged = StageAdvert(
        run_id=RUN_ID, peer_id=victim.peer_id, gossip_peer_id="", maddrs=(), gossip_maddrs=(), stages=(victim.stage,),
        state="OFFLINE", compute_s_per_sample_per_layer=0.0, memory_slots=0, free_slots=0, protocol_version=1,
        rpc_port=None, location="forged", timestamp=time.time() + 100,
    )  # fmt: skip
    key = stage_key(RUN_ID, victim.stage)
    attacker_key = RSAPrivateKey()
    # 1) overwrite the victim's own subkey without its private key (no valid signature possible).
    plain = DHT(initial_peers=[swarm.bootstrap_maddr], start=True, client_mode=True)
    try:
        victim_subkey = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", victim_key)
        ok = plain.store(key, encode(forged), time.time() + 30, subkey=victim_subkey)
        assert not ok, "a peer accepted an unsigned write to another peer's subkey"
    finally:
        plain.shutdown()
    # 2) a correctly signed record in the attacker's own subkey that claims the victim's peer id.
    signer = RSASignatureValidator(attacker_key)
    signed = DHT(initial_peers=[swarm.bootstrap_maddr], start=True, client_mode=True, record_validators=[signer])
    try:
        ok = signed.store(key, encode(forged), time.time() + 30, subkey=signer.local_public_key)
        assert not ok, "a peer accepted an advert whose peer id does not match its owner key"
    finally:
        signed.shutdown()
    for node in live_nodes(swarm):
        peers = {p["peer_id"]: p for p in rpc(node.rpc_url, "swarm")["peers"]}
        assert peers[victim.peer_id]["state"] == "ONLINE"
        assert peers[victim.peer_id]["location"] != "forged"


def test_sigkill_removes_node_from_every_view(swarm):
    victim = swarm.nodes[CHURN_INDEX]
    pgid = victim.proc.pid
    assert len(victim.group_pids()) >= 2  # daemon + p2pd (+ DHT child)
    swarm.kill(victim.index, signal.SIGKILL)
    assert process_group_members(pgid) == []  # its p2pd did not survive it
    for node in live_nodes(swarm):
        poll(lambda: victim.peer_id not in online_ids(node.rpc_url), what=f"node {node.index} drops the dead node")

    def new_epoch_without_victim():
        eps = _epochs(swarm)
        keys = {(e["epoch"], tuple(e["members"])) for e in eps}
        return len(keys) == 1 and victim.peer_id not in eps[0]["members"] and len(eps[0]["members"]) == N_NODES - 1

    poll(new_epoch_without_victim, what="a new epoch without the dead node on every node")


def test_restarted_node_keeps_its_peer_id(swarm):
    victim = swarm.nodes[CHURN_INDEX]
    old_id = victim.peer_id
    swarm.restart(victim.index)
    assert victim.peer_id == old_id
    for node in swarm.nodes:
        poll(lambda: old_id in online_ids(node.rpc_url), what=f"node {node.index} sees the restarted node")


def test_clean_stop_is_seen_at_once_via_gossip(swarm):
    leaver = swarm.nodes[CHURN_INDEX]
    swarm.stop_node(leaver.index)
    assert process_group_members(leaver.proc.pid) == []
    for node in live_nodes(swarm):
        poll(
            lambda: leaver.peer_id not in online_ids(node.rpc_url),
            deadline_s=DEADLINE_S,
            what=f"node {node.index} drops the node that left",
        )


# ---------------------------------------------------------------- bad input against a live swarm
def test_wrong_run_id_is_refused(swarm, tmp_path):
    proc = run_cli("node", "run", "--initial-peers", swarm.bootstrap_maddr, "--run-id", "other-run",
                   "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / "id.key"), "--auto")  # fmt: skip
    assert proc.returncode != 0
    assert len(error_lines(proc)) == 1 and "wrong run id" in error_lines(proc)[0]
    assert "Traceback" not in proc.stderr


def test_incompatible_protocol_version_is_refused(swarm, tmp_path):
    proc = run_cli("node", "run", "--initial-peers", swarm.bootstrap_maddr, "--run-id", RUN_ID,
                   "--protocol-version", "99", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                   "--identity", str(tmp_path / "id.key"), "--auto")  # fmt: skip
    assert proc.returncode != 0
    assert len(error_lines(proc)) == 1 and "protocol version" in error_lines(proc)[0]
    assert "Traceback" not in proc.stderr


def test_identity_in_use_is_refused(swarm):
    proc = run_cli("node", "run", "--initial-peers", swarm.bootstrap_maddr, "--run-id", RUN_ID,
                   "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity", str(swarm.nodes[0].identity_path))  # fmt: skip
    assert proc.returncode != 0
    assert len(error_lines(proc)) == 1 and "already used" in error_lines(proc)[0]
    assert "Traceback" not in proc.stderr


def test_rpc_port_in_use_is_refused(swarm, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_cli("node", "run", "--new-swarm", "--stages", "0", "--rpc-port", str(port),
                       "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / "id.key"))  # fmt: skip
    assert proc.returncode != 0
    assert len(error_lines(proc)) == 1 and "not available" in error_lines(proc)[0]
    assert "Traceback" not in proc.stderr
