"""Pure units of earned membership: challenges, silent members, the per-epoch cap, configuration
digests in epochs, the joiner's handshake check, and the start barrier's majority rule.

The behaviour on real daemons is in ``tests/faults/test_bad_joiners.py``; here each rule is checked
with its edge cases (fake views and hosts, no network)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace

import pytest

from node.errors import UserError
from node.net.identity import load_or_create_identity
from node.net.records import StartRecord
from node.net.runconfig import summary_differences, summary_digest
from node.swarm import admission as adm
from node.swarm.admission import MAX_NEW_MEMBERS_PER_EPOCH, Admission
from node.swarm.adverts import FetchedAdvert
from node.swarm.coordinator import Coordinator, RunConfig
from node.swarm.handshake import HelloReply, check_training_summary
from node.swarm.view import SwarmView
from node.train.agreement import RepinEpoch, RunAgreement, TrainingDisagreement
from protocol.messages import StageAdvert

DIGEST = summary_digest({"model": {"d_model": 64}})
OTHER = summary_digest({"model": {"d_model": 32}})


@pytest.fixture(scope="module")
def identities(tmp_path_factory):
    d = tmp_path_factory.mktemp("ids")
    ids = [load_or_create_identity(d / f"id{i}.key") for i in range(8)]
    return sorted(ids, key=lambda i: i.peer_id.to_base58())


def _advert(peer_id, stages, digest=DIGEST):
    return StageAdvert(
        run_id="r", peer_id=peer_id, gossip_peer_id="g", maddrs=(), gossip_maddrs=(), stages=tuple(stages),
        state="ONLINE", compute_s_per_sample_per_layer=0.05, memory_slots=3, free_slots=3, protocol_version=1,
        rpc_port=None, location=None, timestamp=time.time(), config_digest=digest,
    )  # fmt: skip


def _view(identities, me, stages, digests=None):
    digests = digests or {}
    ids = [i.peer_id.to_base58() for i in identities]
    view = SwarmView(run_id="r", self_id=ids[me])
    view.update_from_dht({ids[k]: FetchedAdvert(_advert(ids[k], s, digests.get(k, DIGEST)),
                                                identities[k].public_key_bytes, time.time() + 60)
                          for k, s in stages.items()})
    view.changed_at -= 10
    return view


def _admission(me, answers):
    """An Admission whose challenge call answers from ``answers`` (peer -> reply, or an exception)."""
    async def call(peer, params):
        reply = answers.get(peer, ConnectionError("unreachable"))
        if isinstance(reply, Exception):
            raise reply
        return dict(reply, nonce=params["nonce"]) if reply.get("nonce") is None else reply

    return Admission(me, DIGEST, call, lambda: (0,))


def _coordinator(ident, view, admission, published):
    async def publish(epoch):
        published.append(epoch)

    return Coordinator(run_id="r", identity=ident, view=view, run=RunConfig(2, 2, 2), memory=3, debounce_s=0.0,
                       takeover_s=100.0, budget_s=0.2, publish=publish, on_adopt=lambda e: None,
                       admission=admission)


async def test_only_peers_that_answer_their_challenge_are_admitted(identities):
    ids = [i.peer_id.to_base58() for i in identities]
    view = _view(identities, 0, {0: (0,), 1: (1,), 2: (1,), 3: (1,), 4: (1,)}, digests={4: OTHER})
    answers = {
        ids[1]: {"peer_id": ids[1], "config_digest": DIGEST},  # honest
        ids[2]: {"peer_id": ids[2], "config_digest": DIGEST, "nonce": "replayed"},  # a stale answer
        ids[3]: {"peer_id": ids[3], "config_digest": OTHER},  # lies about its configuration
        ids[4]: {"peer_id": ids[4], "config_digest": OTHER},  # another configuration: never asked
    }
    a = _admission(ids[0], answers)
    assert await a.round(view.online(), ())
    assert set(a.admitted) == {ids[1]} and a.failed == 2
    published = []
    c = _coordinator(identities[0], view, a, published)
    await c.tick()
    assert len(published) == 1 and set(published[0].members) == {ids[0], ids[1]}
    # a failed candidate is not asked again before RETRY_AFTER_S
    answers[ids[2]] = {"peer_id": ids[2], "config_digest": DIGEST}
    assert not await a.round(view.online(), published[0].members)
    assert ids[2] not in a.admitted


async def test_a_running_swarm_admits_a_few_new_members_per_epoch(identities):
    ids = [i.peer_id.to_base58() for i in identities]
    view = _view(identities, 0, {k: ((0,) if k == 0 else (1,)) for k in range(8)})
    a = _admission(ids[0], {p: {"peer_id": p, "config_digest": DIGEST} for p in ids})
    await a.round(view.online(), ())
    published = []
    c = _coordinator(identities[0], view, a, published)
    c.current = SimpleNamespace(members=(ids[0], ids[1]), epoch=1, start_iteration=10, coordinator=ids[0])
    online, assignment = c.target_membership()
    new = set(assignment) - {ids[0], ids[1]}
    assert len(new) == MAX_NEW_MEMBERS_PER_EPOCH and len(online) == 2 + MAX_NEW_MEMBERS_PER_EPOCH
    c.current = None  # the first epoch of a swarm: its founders start together
    assert len(c.target_membership()[1]) == 8


async def test_a_member_that_never_answers_is_dropped_and_may_earn_its_way_back(identities, monkeypatch):
    monkeypatch.setattr(adm, "SILENT_AFTER_S", 0.0)
    monkeypatch.setattr(adm, "MEMBER_PROBE_EVERY_S", 0.0)
    monkeypatch.setattr(adm, "RETRY_AFTER_S", 0.0)
    monkeypatch.setattr(adm, "DROPPED_RETRY_S", 0.0)
    ids = [i.peer_id.to_base58() for i in identities]
    view = _view(identities, 0, {0: (0,), 1: (1,), 2: (1,)})
    answers = {p: {"peer_id": p, "config_digest": DIGEST} for p in ids[:3]}
    a = _admission(ids[0], answers)
    await a.round(view.online(), ())
    members = (ids[0], ids[1], ids[2])
    answers[ids[2]] = TimeoutError("no answer")
    for _ in range(adm.SILENT_AFTER_PROBES - 1):
        assert not await a.round([], members)  # one lost probe never drops a member
    assert await a.round([], members) and a.silent == {ids[2]}
    c = _coordinator(identities[0], view, a, [])
    c.current = SimpleNamespace(members=members, epoch=1, start_iteration=10, coordinator=ids[0])
    assert set(c.target_membership()[1]) == {ids[0], ids[1]}
    answers[ids[2]] = {"peer_id": ids[2], "config_digest": DIGEST}
    assert await a.round(view.online(), (ids[0], ids[1])) and not a.silent  # it answers again: admitted
    assert set(c.target_membership()[1]) == set(members)
    a.leave_out(ids[1], "pinned another run")
    assert ids[1] not in c.target_membership()[1]


async def test_epochs_naming_another_configuration_are_refused(identities):
    ids = [i.peer_id.to_base58() for i in identities]
    stages = {0: (0,), 1: (1,), 2: (0,)}
    # ids[2] trains another model and coordinates its own epochs
    other_view = _view(identities, 2, stages, digests={k: OTHER for k in stages})
    published = []
    theirs = Coordinator(run_id="r", identity=identities[2], view=other_view, run=RunConfig(2, 2, 2), memory=3,
                         debounce_s=0.0, takeover_s=100.0, budget_s=0.2, publish=lambda e: _append(published, e),
                         on_adopt=lambda e: None, config_digest=OTHER)
    epoch = await theirs.issue(*theirs.target_membership())
    assert epoch is not None
    mine = _coordinator(identities[0], _view(identities, 0, stages, digests={2: OTHER}), None, [])
    assert mine.consider(epoch) == "coordinator trains another configuration"
    assert ids[2] not in mine.candidates()


async def _append(out, item):
    out.append(item)


def test_a_joiner_with_another_configuration_is_refused_naming_the_fields():
    mine = {"model": {"d_model": 32, "context": 32}, "optim": {"lr": 0.001}, "seed": 0}
    run = {"model": {"d_model": 64, "context": 64}, "optim": {"lr": 0.001}, "seed": 0}
    with pytest.raises(UserError) as e:
        check_training_summary(mine, HelloReply(RunConfig(2, 2, 2), "QmFounder12345678", run))
    assert "model.d_model: 32 here, 64 there" in str(e.value) and "model.context" in str(e.value)
    assert "optim" not in str(e.value)
    check_training_summary(mine, HelloReply(RunConfig(2, 2, 2), "x", dict(mine)))  # same: no error
    check_training_summary(mine, HelloReply(RunConfig(2, 2, 2)))  # the initial peer does not train
    # a hostile summary: not a dict, deeply nested, huge values; one bounded line either way
    assert summary_differences(mine, "garbage") == ["configuration: a summary here, 'garbage' there"]
    deep: dict = {}
    for _ in range(5000):
        deep = {"model": deep}
    assert len(" ".join(summary_differences(mine, deep))) < 500
    assert len(summary_differences(mine, {"seed": "x" * 10**6})[0]) < 200


class FakeHost:
    def __init__(self, me):
        self.peer_id, self.left = me, {}

    def leave_out(self, peer, reason):
        self.left[peer] = reason


def _agreement(me, summary, host=None):
    host = host or FakeHost(me)
    return RunAgreement(host, "r", summary, min_members=1, start_debounce_s=0.0, agreement_timeout_s=1.0,
                        poll_s=0.01), host


def _record(summary, epoch=1, start=0):
    return StartRecord(epoch, summary, start, time.time())


def test_at_the_start_barrier_the_majority_leaves_a_disagreeing_member_out():
    good, bad = {"model": {"d_model": 64}}, {"model": {"d_model": 32}}
    epoch = SimpleNamespace(epoch=1, coordinator="A", members=("A", "B", "C"))
    found = {"A": _record(good), "B": _record(good), "C": _record(bad)}
    agreement, host = _agreement("A", good)
    with pytest.raises(RepinEpoch):
        agreement._settle(epoch, found, 0)
    assert set(host.left) == {"C"} and "model.d_model" in host.left["C"]
    # the odd one out stops with one line naming the field; it leaves nobody out
    odd, odd_host = _agreement("C", bad)
    with pytest.raises(TrainingDisagreement, match="model.d_model"):
        odd._settle(epoch, found, 0)
    assert not odd_host.left
    # a tie: the coordinator's group trains
    epoch2 = SimpleNamespace(epoch=1, coordinator="B", members=("A", "B"))
    tie = {"A": _record(bad), "B": _record(good)}
    with pytest.raises(TrainingDisagreement):
        _agreement("A", bad)[0]._settle(epoch2, tie, 0)
    with pytest.raises(RepinEpoch):
        _agreement("B", good)[0]._settle(epoch2, tie, 0)
    # an epoch nobody issued, or another start iteration, splits the same way
    forged = {"A": _record(good), "B": _record(good), "C": _record(good, epoch=424242)}
    agreement, host = _agreement("B", good)
    with pytest.raises(RepinEpoch):
        agreement._settle(epoch, forged, 0)
    assert set(host.left) == {"C"}
    agreement._settle(epoch, {"A": _record(good), "B": _record(good)}, 0)  # all agree: nothing happens


async def test_a_node_left_waiting_outside_a_run_with_another_configuration_says_why(monkeypatch):
    """A joiner that came in through a peer that does not train passed no handshake check; epochs never
    admit it, so while it waits it compares its configuration with the members' start records."""
    import node.train.agreement as agreement_module

    good, bad = {"model": {"d_model": 64}}, {"model": {"d_model": 32}}
    epoch = SimpleNamespace(epoch=3, members=("A", "B"), start_iteration=40)
    host = SimpleNamespace(peer_id="J", current_epoch=epoch, config=SimpleNamespace(heartbeat_s=1.0), dht=None)

    async def records(dht, run_id, members=None):
        return {p: _record(good, epoch=1) for p in members}

    monkeypatch.setattr(agreement_module, "read_start_records", records)
    waiting = RunAgreement(host, "r", bad, min_members=1, start_debounce_s=0.0, agreement_timeout_s=1.0, poll_s=0.01)
    waiting.config_check_s = 0.0
    with pytest.raises(TrainingDisagreement, match="model.d_model: 32 here, 64 there"):
        await asyncio.wait_for(waiting.choose_epoch(), 30)  # a hang guard: it used to wait for ever


async def test_a_joiner_matching_one_member_record_is_not_refused(monkeypatch):
    """A member's record of an earlier session (another configuration) must not refuse a joiner that
    matches this session's records."""
    import node.train.agreement as agreement_module

    good, old = {"model": {"d_model": 64}}, {"model": {"d_model": 32}}
    host = SimpleNamespace(peer_id="J", current_epoch=SimpleNamespace(epoch=3, members=("A", "B"), start_iteration=40),
                           dht=None)

    async def records(dht, run_id, members=None):
        return {"A": _record(good), "B": _record(old)}

    monkeypatch.setattr(agreement_module, "read_start_records", records)
    joiner = RunAgreement(host, "r", good, min_members=1, start_debounce_s=0.0, agreement_timeout_s=1.0, poll_s=0.01)
    await joiner.check_joining_config()
    with pytest.raises(TrainingDisagreement):
        await RunAgreement(host, "r", {"model": {"d_model": 16}}, min_members=1, start_debounce_s=0.0,
                           agreement_timeout_s=1.0, poll_s=0.01).check_joining_config()


def _progress_admission(me, answers, ours, epoch_start=0):
    """An Admission as :func:`_admission`, whose own trainer committed ``ours[0]`` (a list: tests move it)."""
    a = _admission(me, answers)
    a._iteration, a._epoch_start = (lambda: ours[0]), (lambda: epoch_start)
    return a


async def test_a_candidate_training_a_stale_iteration_is_refused_until_it_left_its_old_run(identities):
    ids = [i.peer_id.to_base58() for i in identities]
    view = _view(identities, 0, {0: (0,), 1: (1,), 2: (1,)})
    answers = {ids[1]: {"peer_id": ids[1], "config_digest": DIGEST, "iteration": 181},  # frozen, then continued
               ids[2]: {"peer_id": ids[2], "config_digest": DIGEST, "iteration": 660}}  # in step (one behind)
    a = _progress_admission(ids[0], answers, [661])
    assert await a.round(view.online(), ())
    assert set(a.admitted) == {ids[2]} and a.failed == 1
    a._retry_at.clear()
    answers[ids[1]] = {"peer_id": ids[1], "config_digest": DIGEST, "iteration": None}  # left: joins afresh
    assert await a.round(view.online(), ()) and ids[1] in a.admitted
    assert a.answer({"nonce": "n"})["iteration"] == 661


async def test_a_member_that_answers_but_does_not_train_is_dropped_with_a_growing_back_off(identities, monkeypatch):
    monkeypatch.setattr(adm, "SILENT_AFTER_S", 0.0)
    monkeypatch.setattr(adm, "MEMBER_PROBE_EVERY_S", 0.0)
    ids = [i.peer_id.to_base58() for i in identities]
    answers = {ids[1]: {"peer_id": ids[1], "config_digest": DIGEST, "iteration": None},  # a joiner loading
               ids[2]: {"peer_id": ids[2], "config_digest": DIGEST, "iteration": 99}}
    ours = [99]
    a = _progress_admission(ids[0], answers, ours, epoch_start=100)
    members = (ids[0], ids[1], ids[2])
    for _ in range(adm.SILENT_AFTER_PROBES):  # before the epoch's first iteration: nobody is held to it
        assert not await a.round([], members)
    ours[0] = 101
    answers[ids[2]]["iteration"] = 100  # in step: one behind
    for _ in range(adm.SILENT_AFTER_PROBES - 1):
        assert not await a.round([], members)
    assert await a.round([], members) and a.silent == {ids[1]}
    first = a._retry_at[ids[1]] - time.monotonic()
    a.silent.clear()
    a._failures.clear()
    for _ in range(adm.SILENT_AFTER_PROBES):
        await a.round([], members)
    assert a.silent == {ids[1]} and a._retry_at[ids[1]] - time.monotonic() > first + adm.DROPPED_RETRY_S / 2
    answers[ids[2]]["iteration"] = 90  # the swarm went on without it
    for _ in range(adm.SILENT_AFTER_PROBES):
        await a.round([], members)
    assert a.silent == {ids[1], ids[2]}


def test_a_trainer_out_of_step_leaves_only_when_an_epoch_dropped_it_long_past_where_it_is():
    from node.train.staleness import FAR_BEHIND_ITERATIONS, STALE_AFTER_S, stale_reason

    dropped = SimpleNamespace(epoch=3, start_iteration=400, members=("d", "b"))
    assert stale_reason(dropped, "a", 1, 182, STALE_AFTER_S + 10)  # frozen at 181 while the swarm went on
    assert stale_reason(dropped, "a", 1, 182, 1.0)  # committing its old iterations, far behind the swarm
    near = SimpleNamespace(epoch=3, start_iteration=182 + 2 + FAR_BEHIND_ITERATIONS - 1, members=("d", "b"))
    assert stale_reason(near, "a", 1, 182, STALE_AFTER_S - 1) is None  # maybe a slow member: the idle clock decides
    assert stale_reason(near, "a", 1, 182, STALE_AFTER_S + 1)
    assert stale_reason(SimpleNamespace(epoch=3, start_iteration=184, members=("d", "b")), "a", 1, 182,
                        STALE_AFTER_S + 10) is None  # in step: it trains up to the boundary
    # woken just before the boundary, it paused (its old stage-mates no longer answer it): no boundary is reached
    assert stale_reason(SimpleNamespace(epoch=3, start_iteration=184, members=("d", "b")), "a", 1, 182,
                        STALE_AFTER_S + 10, paused=True)
    assert stale_reason(SimpleNamespace(epoch=3, start_iteration=184, members=("d", "b")), "a", 1, 182,
                        STALE_AFTER_S - 1, paused=True) is None  # a momentary pause: the idle clock decides
    assert stale_reason(SimpleNamespace(epoch=3, start_iteration=400, members=("d", "a")), "a", 1, 182,
                        STALE_AFTER_S + 10) is None  # an epoch that keeps it
    assert stale_reason(SimpleNamespace(epoch=1, start_iteration=400, members=("d",)), "a", 1, 182,
                        STALE_AFTER_S + 10) is None  # not newer than its own


async def test_a_member_left_out_of_an_epoch_answers_a_fresh_challenge_before_it_returns(identities):
    """A frozen node whose advert lapsed is left out; its old admission must not carry it into the
    next epoch while it still cannot answer."""
    ids = [i.peer_id.to_base58() for i in identities]
    view = _view(identities, 0, {0: (0,), 1: (1,), 2: (1,)})
    answers = {p: {"peer_id": p, "config_digest": DIGEST} for p in ids[:3]}
    a = _admission(ids[0], answers)
    await a.round(view.online(), ())
    await a.round([], (ids[0], ids[1], ids[2]))
    answers[ids[2]] = TimeoutError("frozen")
    assert not await a.round(view.online(), (ids[0], ids[1]))  # the epoch without it: asked again, no answer
    assert ids[2] not in a.admitted
    c = _coordinator(identities[0], view, a, [])
    c.current = SimpleNamespace(members=(ids[0], ids[1]), epoch=2, start_iteration=10, coordinator=ids[0])
    assert set(c.target_membership()[1]) == {ids[0], ids[1]}


async def test_a_node_that_says_it_cannot_train_is_not_admitted_and_dropped_at_once(identities):
    ids = [i.peer_id.to_base58() for i in identities]
    view = _view(identities, 0, {0: (0,), 1: (1,), 2: (1,)})
    answers = {ids[1]: {"peer_id": ids[1], "config_digest": DIGEST, "ready": False},
               ids[2]: {"peer_id": ids[2], "config_digest": DIGEST, "ready": False}}
    a = _admission(ids[0], answers)
    assert not await a.round(view.online(), ()) and ids[1] not in a.admitted
    assert await a.round([], (ids[0], ids[2])) and a.silent == {ids[2]}  # a member: out at its first probe
    assert a.answer({"nonce": "n"})["ready"] is True


async def test_a_node_whose_advert_says_it_cannot_train_is_out_for_peers_that_cannot_probe_it(identities, tmp_path):
    """A joiner whose stage's replicas disagreed answers 'not ready' to probes, but a member behind NAT cannot
    probe a NATed joiner: without the advert's word its trainer waited the norm timeout every iteration."""
    from node.swarm.daemon import Daemon, DaemonConfig

    ids = [i.peer_id.to_base58() for i in identities]
    view = _view(identities, 0, {0: (0,), 1: (1,), 2: (1,)})
    view.peers[ids[2]].advert = dataclasses.replace(view.peers[ids[2]].advert, ready=False)
    host = SimpleNamespace(peer_id=ids[0], view=view, admission=None)
    assert Daemon.peer_alive(host, ids[1]) and not Daemon.peer_alive(host, ids[2])
    a = _admission(ids[0], {})
    assert a.may_join(ids[1], view.get(ids[1]).advert) and not a.may_join(ids[2], view.get(ids[2]).advert)
    published = []
    c = _coordinator(identities[0], view, a, published)
    c.current = SimpleNamespace(members=(ids[0], ids[1], ids[2]))
    assert [e.peer_id for e in c.eligible()] == [ids[0], ids[1]]  # a member, but no coordinator names it again
    assert view.get(ids[2]).to_json()["ready"] is False  # swarm status shows it

    daemon = Daemon(DaemonConfig(identity_path=tmp_path / "identity.key"))
    ready = [False]
    daemon.training_ready = lambda: ready[0]
    assert daemon.advert().ready is False
    ready[0] = True
    assert daemon.advert().ready is True


async def test_a_member_no_connection_can_reach_is_not_probed_nor_made_silent(identities, monkeypatch):
    """Two nodes behind NAT cannot connect: a probe between them always fails, and counting the other
    silent made a NATed replica's trainer wait for a stage whose only (NATed) node was training all along."""
    from node.swarm.wiring import can_connect

    monkeypatch.setattr(adm, "SILENT_AFTER_S", 0.0)
    monkeypatch.setattr(adm, "MEMBER_PROBE_EVERY_S", 0.0)
    ids = [i.peer_id.to_base58() for i in identities]
    probed = []

    async def call(peer, params):
        probed.append(peer)
        raise ConnectionError("unreachable at its advertised addresses")

    natted = {ids[2]}
    a = Admission(ids[0], DIGEST, call, lambda: (0,), reachable=lambda peer: peer not in natted)
    members = (ids[0], ids[1], ids[2])
    for _ in range(adm.SILENT_AFTER_PROBES + 1):
        await a.round([], members)
    assert ids[2] not in probed and a.silent == {ids[1]}  # the reachable one that never answers is silent
    natted.add(ids[1])  # learned later: no connection to it can exist either
    assert await a.round([], members) and a.silent == set()

    view = _view(identities, 0, {0: (0,), 1: (1,), 2: (1,)})
    view.peers[ids[1]].advert = dataclasses.replace(view.peers[ids[1]].advert, reachability="outbound_only")
    host = SimpleNamespace(view=view, reachability=SimpleNamespace(value="outbound_only"))
    assert not can_connect(host, ids[1])  # both outbound-only
    assert can_connect(host, ids[2]) and can_connect(host, "unknown-peer")  # it may be dialled / nothing known
    host.reachability.value = "direct"
    assert can_connect(host, ids[1])


async def test_a_silent_member_is_dropped_within_a_bound_that_adverts_cannot_stretch(monkeypatch):
    """Rounds on a simulated clock: each round starts a heartbeat after the previous one ended and lasts
    one challenge timeout per wave of challenges to peers that do not answer. With 300 made-up adverts
    as candidates, every round stays one wave, a member that goes silent is dropped within
    ``silent_drop_bound_s`` (3 and 20 other members), and an honest candidate among the fakes is still
    admitted (round-robin over the candidates)."""
    import math

    heartbeat_s, fakes = 5.0, 300
    clock = [1000.0]
    monkeypatch.setattr(adm, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    def entry(peer):
        return SimpleNamespace(peer_id=peer, advert=SimpleNamespace(config_digest=DIGEST, stages=(1,)))

    for n_members in (3, 20):
        members = ["me"] + [f"member{i:02d}" for i in range(n_members)]
        answering = set(members) | {"honest"}
        candidates = [entry(f"fake{i:03d}") for i in range(fakes)]
        calls: list = []

        async def call(peer, params):
            calls.append(peer)
            if peer in answering:
                return {"peer_id": peer, "config_digest": DIGEST, "nonce": params["nonce"]}
            raise TimeoutError("no daemon behind this advert")

        a = Admission("me", DIGEST, call, lambda: (0,))

        async def one_round():
            calls.clear()
            await a.round(candidates, members)
            # one wave, and a round's work does not grow with the number of adverts
            assert len(calls) <= min(adm.MAX_CONCURRENT_CHALLENGES, fakes // 10), len(calls)
            waves = math.ceil(len(calls) / adm.MAX_CONCURRENT_CHALLENGES)
            late = any(p not in answering for p in calls)
            clock[0] += heartbeat_s + (waves * adm.CHALLENGE_TIMEOUT_S if late else 0.0)

        for _ in range(10):  # steady state: every member probed and answering
            await one_round()
        assert not a.silent
        silent_member, went_silent = members[-1], clock[0]
        answering.discard(silent_member)
        candidates.append(entry("honest"))
        rounds, admitted_after = 0, None
        while silent_member not in a.silent:
            await one_round()
            rounds += 1
            if admitted_after is None and "honest" in a.admitted:
                admitted_after = rounds
            assert rounds < 1000
        bound = adm.silent_drop_bound_s(n_members, heartbeat_s)
        assert clock[0] - went_silent <= bound, (n_members, clock[0] - went_silent, bound)
        assert bound < 10 * adm.SILENT_AFTER_S  # a bound worth the name for an epoch of 20
        while admitted_after is None and rounds < 1000:
            await one_round()
            rounds += 1
            admitted_after = rounds if "honest" in a.admitted else None
        assert admitted_after is not None and admitted_after <= math.ceil((fakes + 1) / adm.MAX_CHALLENGES_PER_ROUND) + 1


async def test_a_woken_trainer_leaves_once_the_swarm_trained_past_the_epoch_that_left_it_out(monkeypatch):
    from node.train import staleness

    monkeypatch.setattr(staleness, "POLL_S", 0.01)
    monkeypatch.setattr(staleness, "PASSED_CHECK_S", 0.0)
    # woken at iteration 10; the epoch that dropped it starts at 12: "in step" by the epoch alone, and committing
    trainer = SimpleNamespace(committed_iteration=9, current_iteration=10, epoch=SimpleNamespace(epoch=1),
                              paused_reason=None)
    dropped = SimpleNamespace(epoch=2, start_iteration=12, members=("d", "b"))
    asked = []

    async def swarm_at(last):
        async def read(it, members):
            asked.append((it, tuple(members)))
            return {"d": "a norm record"} if it <= last else None
        return read

    why = await asyncio.wait_for(staleness._wait_until_stale(trainer, lambda: dropped, "a", await swarm_at(186)), 5)
    assert "trained iteration 16 without this node" in why, why
    assert asked[0] == (12 + staleness.FAR_BEHIND_ITERATIONS, ("d", "b"))

    async def watched(epoch, read, looks=20):
        """The watch's verdict after it looked at the epoch ``looks`` times (None: still watching); counted
        in looks, not seconds, so a loaded box cannot end it before it looked."""
        seen = []

        def adopted():
            seen.append(1)
            return epoch

        task = asyncio.create_task(staleness._wait_until_stale(trainer, adopted, "a", read))
        for _ in range(3000):
            if task.done() or len(seen) >= looks:
                break
            await asyncio.sleep(0.01)
        if task.done():
            return task.result()
        task.cancel()
        return None

    # the swarm is only at the boundary (an in-step member being dropped): it trains up to it
    asked.clear()
    assert await watched(dropped, await swarm_at(13)) is None
    assert asked, "it never looked"
    # an epoch that keeps it: nothing is read at all
    asked.clear()
    kept = SimpleNamespace(epoch=2, start_iteration=12, members=("d", "a"))
    assert await watched(kept, await swarm_at(186)) is None
    assert asked == []

    async def broken(it, members):
        raise OSError("the DHT is down")

    assert await staleness.swarm_went_past(broken, dropped, 10) is None  # no verdict, never an error
