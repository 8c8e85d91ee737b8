"""Real daemons of a private swarm (``--swarm-key``): metrics, intruders, floods and garbage.

Three members share a key and an allowlist; three intruders join through a member with the
courtesy hello check switched off (playing modified clients): one with the wrong key and one
with none (both listed in the allowlist, so only the key keeps them out), one with the right
key but not in the allowlist. None may appear in a
member's view or schedule, and the keyless one, which *can* read the members' sealed adverts
and so dials their gossip, must have its gossip dropped. Waits are polls with a
generous deadline, never timing assertions.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.launch.process_swarm import ProcessNode, ProcessSwarm
from node.net.rpc import RpcCallError
from tests.node.helpers import DEADLINE_S, error_lines, poll, rpc, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

RUN_ID = "private-run"
HEARTBEAT_S = 1.0
MEMBERS = 3
STAGE_SIZES = (2, 1)
#: Low limits so that a short flood certainly exceeds them.
RATE_ARGS = ["--rpc-rate", "10", "--rpc-burst", "10"]
#: Seconds the flood and garbage clients run at least (bounded: they stop after that).
FLOOD_MIN_S = 3.0


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    (d / "swarm.key").write_bytes(os.urandom(32).hex().encode())
    (d / "wrong.key").write_bytes(os.urandom(32).hex().encode())
    return d


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, keys):
    from node.net.identity import load_or_create_identity

    base = tmp_path_factory.mktemp("private")
    allowlist = base / "members.txt"
    member_key = ["--swarm-key", str(keys / "swarm.key"), "--allow-peers", str(allowlist)]
    intruder_args = {
        MEMBERS: ["--swarm-key", str(keys / "wrong.key"), "--no-access-handshake"],
        MEMBERS + 1: ["--no-access-handshake"],
        MEMBERS + 2: ["--swarm-key", str(keys / "swarm.key"), "--no-access-handshake"],  # right key, not listed
    }
    ids = [load_or_create_identity(base / f"node{i}" / "identity.key").peer_id.to_base58() for i in range(MEMBERS)]
    # The wrong-key and keyless intruders ARE listed: only the swarm key keeps them out.
    ids += [load_or_create_identity(base / f"intruder{i}" / "identity.key").peer_id.to_base58() for i in (MEMBERS, MEMBERS + 1)]
    allowlist.write_text("# members of the private run\n" + "".join(f"{pid}  # node {i}\n" for i, pid in enumerate(ids)))

    def extra(index: int) -> list[str]:
        return intruder_args.get(index, member_key) + RATE_ARGS

    s = ProcessSwarm(MEMBERS, STAGE_SIZES, base_dir=base, run_id=RUN_ID, heartbeat_s=HEARTBEAT_S, extra_args=extra)
    s.start()
    try:
        for index in intruder_args:  # the intruders hold stage 1, next to a real member
            s.nodes.append(ProcessNode(index=index, stage=1, workdir=base / f"intruder{index}", args=[]))
            s.spawn(s.nodes[-1])
        s.wait_ready(s.nodes[MEMBERS:])
        yield s
    finally:
        s.stop()


def members(swarm):
    return swarm.nodes[:MEMBERS]


def intruders(swarm):
    return swarm.nodes[MEMBERS:]


def http_get(node, path: str) -> tuple[str, str]:
    """(content type, body) of ``GET path``; an HTTP error such as 429 (our own polling hit the
    rate limit) is raised as RpcCallError, which poll() treats as "not yet"."""
    try:
        with urllib.request.urlopen(node.rpc_url + path, timeout=10) as resp:
            return resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as e:
        raise RpcCallError(f"{path}: HTTP {e.code}") from None


def scrape(node) -> dict[tuple[str, tuple], float]:
    """``/metrics`` of ``node`` parsed with prometheus_client: {(sample name, labels): value}."""
    content_type, text = http_get(node, "/metrics")
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def online_ids(node) -> set[str]:
    return {p["peer_id"] for p in rpc(node.rpc_url, "swarm")["peers"] if p["state"] == "ONLINE"}


def test_members_see_each_other_and_no_intruder(swarm):
    expected = {n.peer_id for n in members(swarm)}
    for node in members(swarm):
        poll(lambda: online_ids(node) == expected, what=f"member {node.index} sees exactly the members")

    def one_epoch_of_members():
        eps = [rpc(n.rpc_url, "schedule") for n in members(swarm)]
        keys = {(e["epoch"], tuple(e["members"] or ())) for e in eps}
        return len(keys) == 1 and eps[0]["epoch"] is not None and set(eps[0]["members"]) == expected

    poll(one_epoch_of_members, what="one epoch of the members only")
    # The intruders are really running and have announced themselves ONLINE ...
    for intruder in intruders(swarm):
        poll(lambda: rpc(intruder.rpc_url, "status")["state"] == "ONLINE", what=f"intruder {intruder.index} ONLINE")
    keyless = swarm.nodes[MEMBERS + 1]
    poll(lambda: expected <= online_ids(keyless), what="the keyless intruder reads the sealed adverts")
    # ... and every member has re-read the DHT twice since: still no intruder, in any state.
    marks = {n.index: rpc(n.rpc_url, "status")["view_refreshes"] for n in members(swarm)}
    for node in members(swarm):
        poll(lambda: rpc(node.rpc_url, "status")["view_refreshes"] >= marks[node.index] + 2, what="two view refreshes")
    intruder_ids = {n.peer_id for n in intruders(swarm)}
    for node in members(swarm):
        assert not {p["peer_id"] for p in rpc(node.rpc_url, "swarm")["peers"]} & intruder_ids
        assert not set(rpc(node.rpc_url, "schedule")["members"]) & intruder_ids
        status = rpc(node.rpc_url, "status")
        assert status["access_control"]["swarm_key"] is True
        assert status["access_control"]["allowlist"] == MEMBERS + 2


def test_gossip_of_the_keyless_intruder_is_dropped(swarm):
    keyless = swarm.nodes[MEMBERS + 1]
    gossip_id = rpc(keyless.rpc_url, "status")["gossip_peer_id"]

    def dropped_from_intruder():
        return any(gossip_id in rpc(n.rpc_url, "status")["access_control"]["gossip_dropped_from"] for n in members(swarm))

    poll(dropped_from_intruder, what="a member drops gossip sent by the keyless intruder")
    assert sum(poll(lambda: scrape(n)).get(("skippipe_gossip_dropped_total", (("reason", "not_allowed"),)), 0) for n in members(swarm))
    for node in members(swarm):
        view = rpc(node.rpc_url, "swarm")
        assert keyless.peer_id not in {p["peer_id"] for p in view["peers"]}
        assert keyless.peer_id not in {link["src"] for link in view["links"]}  # its link reports were ignored


def test_metrics_endpoint_reports_peers_and_epoch(swarm):
    node = members(swarm)[0]
    assert rpc(node.rpc_url, "iterations")["iterations"] == []  # no trainer in this swarm (and one HTTP RPC)
    assert rpc(node.rpc_url, "traffic")["peers"] == {}

    def ready():
        m = scrape(node)
        return m.get(("skippipe_peers", (("state", "ONLINE"),))) == MEMBERS and m.get(("skippipe_schedule_epoch", ())) and m

    m = poll(ready, what="metrics show all members ONLINE and an epoch")
    assert m[("skippipe_node_info", (("peer_id", node.peer_id),))] == 1
    assert m[("skippipe_peers", (("state", "OFFLINE"),))] == 0
    assert ("skippipe_iteration", ()) in m and ("skippipe_reroutes_total", ()) in m
    assert m[("skippipe_rpc_requests_total", (("outcome", "ok"), ("transport", "http")))] >= 1
    # the event loop's lag probe runs and is exported (node.ops.looplag)
    poll(lambda: scrape(node).get(("skippipe_loop_lag_max_seconds", ()), 0) > 0, what="a loop-lag sample")
    assert ("skippipe_loop_lag_seconds", ()) in m
    # The dashboard page is served too (rendering is tested in a browser by test_dashboard.py).
    content_type, page = poll(lambda: http_get(node, "/"), what="the dashboard page")
    assert content_type.startswith("text/html")
    assert 'id="paths"' in page and "setInterval(refresh" in page and "__POLL_MS__" not in page


def test_wrong_or_missing_key_is_refused_with_one_error(swarm, keys, tmp_path):
    base = ["node", "run", "--initial-peers", swarm.bootstrap_maddr, "--run-id", RUN_ID, "--stages", "1",
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / "id.key")]  # fmt: skip
    cases = (
        (["--swarm-key", str(keys / "wrong.key")], "wrong swarm key"),
        ([], "needs a swarm key"),
        (["--swarm-key", str(keys / "swarm.key")], "allowlist"),  # right key, identity not listed
    )
    for extra, needle in cases:
        proc = run_cli(*base, *extra)
        assert proc.returncode != 0
        errors = error_lines(proc)
        assert len(errors) == 1 and needle in errors[0], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "content, needle", [(b"", "empty"), (b"short", "at least"), (None, "no such file")], ids=["empty", "short", "missing"]
)
def test_unusable_key_file_is_one_error(tmp_path, content, needle):
    key = tmp_path / "swarm.key"
    if content is not None:
        key.write_bytes(content)
    proc = run_cli("node", "run", "--swarm-key", str(key), "--identity", str(tmp_path / "id.key"))
    assert proc.returncode != 0
    errors = error_lines(proc)
    assert len(errors) == 1 and needle in errors[0] and "--swarm-key" in errors[0], proc.stderr[-2000:]


# ---------------------------------------------------------------- hostile clients
def _garbage_http(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


async def _hostile_clients(target) -> dict:
    import node.compat  # noqa: F401
    from hivemind.p2p import P2P, PeerID

    from node.net.rpc import RPC_PROTOCOL, RpcCallError, call_p2p

    peer = PeerID.from_base58(target.peer_id)
    flooder = await P2P.create(initial_peers=[target.maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    checker = await P2P.create(initial_peers=[target.maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    result = {"rate_limited": 0, "garbage_answers": 0, "health": []}
    stop = asyncio.Event()

    async def flood() -> None:
        while not stop.is_set():
            try:
                await call_p2p(flooder, peer, "status", timeout=10)
            except RpcCallError as e:
                if "rate limited" in str(e):
                    result["rate_limited"] += 1

    async def garbage() -> None:
        frames = [
            (2**60).to_bytes(8, "big"),  # absurd length
            (5).to_bytes(8, "big") + b"\xc1\xc1\xc1\xc1\xc1",  # not msgpack
            (3).to_bytes(8, "big") + b"ab",  # truncated
            os.urandom(64),
        ]
        i = 0
        while not stop.is_set():
            try:
                _, reader, writer = await garbage_p2p.call_binary_stream_handler(peer, RPC_PROTOCOL)
                writer.write(frames[i % len(frames)])
                await writer.drain()
                if i % len(frames) == 1:  # a complete frame: an error answer comes back
                    answer = await asyncio.wait_for(P2P.receive_raw_data(reader), 10)
                    result["garbage_answers"] += bool(answer)
                writer.close()
            except Exception:  # noqa: BLE001 - the daemon may cut us off; we keep going
                pass
            i += 1
            await asyncio.to_thread(_garbage_http, target.info["rpc_port"], os.urandom(200))

    garbage_p2p = await P2P.create(initial_peers=[target.maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        tasks = [asyncio.create_task(flood()) for _ in range(4)] + [asyncio.create_task(garbage())]
        t0 = time.monotonic()
        # Health (from a third peer, so its own bucket) is asked while the flood runs.
        while time.monotonic() - t0 < FLOOD_MIN_S or not result["rate_limited"]:
            if time.monotonic() - t0 > DEADLINE_S:
                break
            try:
                result["health"].append((await call_p2p(checker, peer, "health", timeout=20))["ok"])
            except RpcCallError as e:
                result["health"].append(repr(e))
            await asyncio.sleep(0.5)
        stop.set()
        await asyncio.wait(tasks, timeout=30)
        for t in tasks:
            t.cancel()
    finally:
        for p in (flooder, checker, garbage_p2p):
            await p.shutdown()
    return result


def test_flood_and_garbage_leave_the_daemon_healthy(swarm):
    target = members(swarm)[1]
    result = asyncio.run(_hostile_clients(target))
    assert result["rate_limited"] > 0, result
    assert result["garbage_answers"] > 0, result
    assert result["health"] and all(h is True for h in result["health"]), result["health"]
    assert target.alive
    assert poll(lambda: rpc(target.rpc_url, "health")["ok"], what="health over HTTP after the flood")
    m = poll(lambda: scrape(target), what="metrics after the flood")
    assert m[("skippipe_rpc_requests_total", (("outcome", "rate_limited"), ("transport", "p2p")))] > 0
    assert m[("skippipe_rpc_requests_total", (("outcome", "malformed"), ("transport", "p2p")))] > 0
    assert m[("skippipe_rpc_requests_total", (("outcome", "malformed"), ("transport", "http")))] > 0
    # The member is still a member everywhere.
    for node in members(swarm):  # polled: our own HTTP bucket on the target may still be empty
        poll(lambda: target.peer_id in online_ids(node), what=f"member {node.index} still lists the target")
