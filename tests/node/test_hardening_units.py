"""In-process tests of metrics, rate limiting, access control and hostile RPC input."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time

import pytest

import node.compat  # noqa: F401
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer
from prometheus_client.parser import text_string_to_metric_families

from node.net.access import SwarmAccess, load_allowlist, load_swarm_key
from node.swarm.coordinator import Coordinator, RunConfig
from node.swarm.adverts import FetchedAdvert, make_record_validators
from node.errors import UserError
from node.net.identity import load_or_create_identity
from node.ops.metrics import NodeMetrics
from node.net.ratelimit import PeerRateLimiter, TokenBucket
from node.net.rpc import HttpReply, RpcServer, call_http
from node.swarm.view import SwarmView
from protocol.messages import ScheduleEpoch, StageAdvert, encode

KEY = b"k" * 32


@pytest.fixture(scope="module")
def identities(tmp_path_factory):
    d = tmp_path_factory.mktemp("ids")
    ids = [load_or_create_identity(d / f"id{i}.key") for i in range(3)]
    return sorted(ids, key=lambda i: i.peer_id.to_base58())


def advert(peer_id: str, stages=(0,)) -> StageAdvert:
    return StageAdvert(
        run_id="r", peer_id=peer_id, gossip_peer_id="g", maddrs=(), gossip_maddrs=(), stages=tuple(stages),
        state="ONLINE", compute_s_per_sample_per_layer=0.05, memory_slots=3, free_slots=3, protocol_version=1,
        rpc_port=None, location=None, timestamp=time.time(),
    )  # fmt: skip


# ---------------------------------------------------------------- metrics
def _families(metrics: NodeMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def test_metrics_render_and_parse():
    m = NodeMetrics(peer_id="QmSelf")
    m.set_iteration(7, loss=2.5, tokens_per_s=1234.0)
    m.record_hop("QmA", 0.02, 4096, "out")
    m.record_hop("QmA", 0.03, 100, "in")
    m.record_hop("QmB", None, 0, "in")
    m.count_failure("hop_timeout")
    m.count_reroute()
    m.set_schedule_epoch(3)
    m.set_peer_states(["ONLINE", "ONLINE", "JOINING"])
    fams = _families(m)
    assert fams["skippipe_iteration"].samples[0].value == 7
    assert fams["skippipe_loss"].samples[0].value == 2.5
    assert fams["skippipe_tokens_per_second"].samples[0].value == 1234.0
    mb = {(s.labels["peer"], s.labels["direction"]): s.value for s in fams["skippipe_microbatches"].samples if s.name.endswith("_total")}
    assert mb == {("QmA", "out"): 1, ("QmA", "in"): 1, ("QmB", "in"): 1}
    assert m.sample("skippipe_data_bytes_total", {"peer": "QmA", "direction": "out"}) == 4096
    assert m.sample("skippipe_hop_latency_seconds_count", {"direction": "out"}) == 1
    assert m.sample("skippipe_failures_total", {"kind": "hop_timeout"}) == 1
    assert m.sample("skippipe_reroutes_total") == 1
    assert m.sample("skippipe_schedule_epoch") == 3
    assert m.sample("skippipe_peers", {"state": "ONLINE"}) == 2
    assert m.sample("skippipe_peers", {"state": "OFFLINE"}) == 0
    assert [r["iteration"] for r in m.recent_iterations()] == [7]
    with pytest.raises(ValueError, match="direction"):
        m.record_hop("QmA", 0.1, 1, "sideways")


def test_metrics_registries_are_separate():
    a, b = NodeMetrics(), NodeMetrics()
    a.count_reroute()
    assert a.sample("skippipe_reroutes_total") == 1 and b.sample("skippipe_reroutes_total") == 0


def test_recent_iterations_ring_is_bounded():
    m = NodeMetrics(recent_iterations=3)
    for i in range(10):
        m.set_iteration(i, loss=float(i))
    assert [r["iteration"] for r in m.recent_iterations()] == [7, 8, 9]
    assert [r["iteration"] for r in m.recent_iterations(2)] == [8, 9]


# ---------------------------------------------------------------- rate limiting
def test_token_bucket_refills_at_rate():
    clock = [0.0]
    limiter = PeerRateLimiter(rate_per_s=2.0, burst=3, clock=lambda: clock[0])
    assert [limiter.allow("a") for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("b")  # buckets are per peer
    clock[0] += 0.5  # one token back
    assert limiter.allow("a") and not limiter.allow("a")
    assert limiter.rejected == 2
    with pytest.raises(ValueError):
        TokenBucket(0, 1)


def test_rate_limiter_forgets_oldest_peers():
    limiter = PeerRateLimiter(rate_per_s=1.0, burst=1, max_peers=2)
    for peer in ("a", "b", "c"):
        limiter.allow(peer)
    assert len(limiter) == 2


# ---------------------------------------------------------------- access control
def test_key_and_allowlist_files(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_swarm_key(tmp_path / "missing")
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(UserError, match="empty"):
        load_swarm_key(tmp_path / "empty")
    (tmp_path / "short").write_text("abc")
    with pytest.raises(UserError, match="at least"):
        load_swarm_key(tmp_path / "short")
    with pytest.raises(UserError, match="directory"):
        load_swarm_key(tmp_path)
    (tmp_path / "key").write_text("x" * 40 + "\n")
    assert load_swarm_key(tmp_path / "key") == b"x" * 40
    (tmp_path / "allow").write_text("# members\nQmAbc  # node a\n\n12D3KooWxyz\n")
    assert load_allowlist(tmp_path / "allow") == {"QmAbc", "12D3KooWxyz"}
    (tmp_path / "none").write_text("# nobody\n")
    with pytest.raises(UserError, match="no peer id"):
        load_allowlist(tmp_path / "none")
    (tmp_path / "bad").write_text("QmA QmB\n")
    with pytest.raises(UserError, match=":1:"):
        load_allowlist(tmp_path / "bad")


def test_seal_unseal_and_hello():
    access, other, open_ = SwarmAccess(KEY), SwarmAccess(b"o" * 32), SwarmAccess()
    sealed = access.seal(b"message")
    assert access.unseal(sealed) == b"message"
    assert other.unseal(sealed) is None
    assert access.unseal(b"message") is None  # unsealed values are refused in a keyed swarm
    assert open_.unseal(b"message") == b"message" and open_.seal(b"m") == b"m"
    assert access.check_hello("QmA", access.hello_proof("QmA")) is None
    assert "wrong swarm key" in access.check_hello("QmA", other.hello_proof("QmA"))
    assert "wrong swarm key" in access.check_hello("QmB", access.hello_proof("QmA"))  # bound to the caller
    assert "needs a swarm key" in access.check_hello("QmA", None)
    assert "allowlist" in SwarmAccess(allowed_peers=frozenset({"QmA"})).check_hello("QmB", None)


def _record(identity, value: bytes, validators) -> DHTRecord:
    owner_marker = make_record_validators(identity.private_key)[0].local_public_key
    record = DHTRecord(
        key=b"\x01" * 20, subkey=MSGPackSerializer.dumps(owner_marker), value=MSGPackSerializer.dumps(value),
        expiration_time=time.time() + 10,
    )  # fmt: skip
    return dataclasses.replace(record, value=CompositeValidator(validators).sign_value(record))


def test_validator_enforces_swarm_key_and_allowlist(identities):
    a, b, _ = identities
    a_id, b_id = a.peer_id.to_base58(), b.peer_id.to_base58()
    keyed = CompositeValidator(make_record_validators(a.private_key, SwarmAccess(KEY))).validate
    good = SwarmAccess(KEY).seal(encode(advert(b_id)))
    wrong = SwarmAccess(b"w" * 32).seal(encode(advert(b_id)))
    assert keyed(_record(b, good, make_record_validators(b.private_key)))
    assert not keyed(_record(b, wrong, make_record_validators(b.private_key)))
    assert not keyed(_record(b, encode(advert(b_id)), make_record_validators(b.private_key)))
    assert keyed(_record(b, b"not a skippipe value", make_record_validators(b.private_key)))
    listed = CompositeValidator(make_record_validators(a.private_key, SwarmAccess(allowed_peers=frozenset({a_id})))).validate
    assert listed(_record(a, encode(advert(a_id)), make_record_validators(a.private_key)))
    assert not listed(_record(b, encode(advert(b_id)), make_record_validators(b.private_key)))


def test_is_peer_allowed_combines_allowlist_and_accepted_adverts(identities):
    from node.swarm.config import DaemonConfig
    from node.swarm.daemon import Daemon

    a, b, c = (i.peer_id.to_base58() for i in identities)
    daemon = Daemon(DaemonConfig())
    daemon.peer_id = a
    daemon.view = SwarmView(run_id="r", self_id=a)
    daemon.view.update_from_dht({b: FetchedAdvert(advert(b), b"k", time.time() + 60)})
    assert daemon.is_peer_allowed(c)  # open swarm
    daemon.access = SwarmAccess(KEY)
    assert daemon.is_peer_allowed(b) and not daemon.is_peer_allowed(c)  # c has no proved advert
    daemon.access = SwarmAccess(KEY, frozenset({a, c}))
    assert not daemon.is_peer_allowed(b) and not daemon.is_peer_allowed(c)
    assert daemon.is_peer_allowed(a)  # ourselves
    daemon.access = SwarmAccess(allowed_peers=frozenset({c}))
    assert daemon.is_peer_allowed(c) and not daemon.is_peer_allowed(b)


# ---------------------------------------------------------------- schedules from the wrong signer
def _view(identities, self_index):
    ids = [i.peer_id.to_base58() for i in identities]
    view = SwarmView(run_id="r", self_id=ids[self_index])
    stages = [(0,), (0,), (1,)]
    view.update_from_dht(
        {p: FetchedAdvert(advert(p, stages[k]), identities[k].public_key_bytes, time.time() + 60) for k, p in enumerate(ids)}
    )
    view.changed_at -= 10
    return view


def _coordinator(ident, view, published, adopted):
    async def publish(epoch):
        published.append(epoch)

    return Coordinator(
        run_id="r", identity=ident, view=view, run=RunConfig(2, 2, 2), memory=3, debounce_s=0.0,
        takeover_s=100.0, budget_s=0.2, publish=publish, on_adopt=adopted.append,
    )  # fmt: skip


async def test_epoch_not_signed_by_its_coordinator_is_ignored(identities):
    published = []
    primary = _coordinator(identities[0], _view(identities, 0), published, [])
    await primary.tick()
    epoch = published[0]
    adopted = []
    follower = _coordinator(identities[2], _view(identities, 2), [], adopted)
    # Re-signed by another member (a stage-1 node) but claiming the primary as coordinator.
    impostor = dataclasses.replace(epoch, epoch=5, signature=identities[2].sign(dataclasses.replace(epoch, epoch=5).signing_payload()))
    assert follower.consider(impostor) == "bad signature"
    # Correctly signed by its claimed coordinator, but that coordinator is not a data node.
    unsigned = dataclasses.replace(epoch, epoch=6, coordinator=identities[2].peer_id.to_base58(), signature=b"")
    by_stage1 = dataclasses.replace(unsigned, signature=identities[2].sign(unsigned.signing_payload()))
    assert follower.consider(by_stage1) == "pending"
    await follower.tick()
    assert follower.current is None and adopted == []
    assert follower.consider(epoch) == "adopted"


# ---------------------------------------------------------------- hostile HTTP input
def _raw_http(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


async def test_http_garbage_is_answered_and_counted():
    outcomes = []
    server = RpcServer(on_request=lambda t, o: outcomes.append((t, o)))

    async def ok(params):
        return "pong"

    async def page(params):
        return HttpReply(200, "text/plain", b"hello")

    server.register("ping", ok)
    server.register_http_route("/page", page)
    port = await server.start_http("127.0.0.1", 0)
    try:
        for garbage in (b"\x00\xff\xfe garbage\r\n\r\n", b"POST /rpc HTTP/1.1\r\nContent-Length: 5\r\n\r\n[1,2]",
                        b"POST /rpc HTTP/1.1\r\nContent-Length: zz\r\n\r\n", b"GET\r\n\r\n", b"X" * 100_000):  # fmt: skip
            reply = await asyncio.to_thread(_raw_http, port, garbage)
            assert reply.startswith(b"HTTP/1.1 400"), reply[:80]
        assert (await asyncio.to_thread(_raw_http, port, b"GET /page HTTP/1.1\r\n\r\n")).endswith(b"hello")
        assert await asyncio.to_thread(call_http, f"http://127.0.0.1:{port}", "ping") == "pong"
    finally:
        await server.stop()
    assert outcomes.count(("http", "malformed")) == 5
    assert ("http", "ok") in outcomes


async def test_http_rate_limit_answers_429():
    server = RpcServer(http_limiter=PeerRateLimiter(rate_per_s=0.001, burst=2))

    async def ok(params):
        return "pong"

    server.register("ping", ok)
    port = await server.start_http("127.0.0.1", 0)
    try:
        replies = [await asyncio.to_thread(_raw_http, port, b"GET /ping HTTP/1.1\r\n\r\n") for _ in range(4)]
    finally:
        await server.stop()
    assert [r.split(b" ")[1] for r in replies] == [b"200", b"200", b"429", b"429"]
