"""Rules that make a join land: the join lead never pushes the boundary past the run's end, and a
joiner does not coordinate before its data plane is up (nor outrank the members' data nodes)."""

from __future__ import annotations

import logging
import math
import time
from types import SimpleNamespace

import pytest

from node.net.identity import load_or_create_identity
from node.swarm.adverts import FetchedAdvert
from node.swarm.coordinator import Coordinator, RunConfig, rank_candidates
from node.swarm.view import SwarmView
from node.train.service import ServiceState, TrainerService, capped_join_boundary
from protocol.messages import StageAdvert


@pytest.fixture(scope="module")
def identities(tmp_path_factory):
    d = tmp_path_factory.mktemp("ids")
    ids = [load_or_create_identity(d / f"id{i}.key") for i in range(3)]
    return sorted(ids, key=lambda i: i.peer_id.to_base58())


def _advert(peer_id, stages):
    return StageAdvert(
        run_id="r", peer_id=peer_id, gossip_peer_id="g", maddrs=(), gossip_maddrs=(), stages=tuple(stages),
        state="ONLINE", compute_s_per_sample_per_layer=0.05, memory_slots=3, free_slots=3, protocol_version=1,
        rpc_port=None, location=None, timestamp=time.time(),
    )  # fmt: skip


def _view(identities, self_index, present, stages):
    ids = [i.peer_id.to_base58() for i in identities]
    view = SwarmView(run_id="r", self_id=ids[self_index])
    view.update_from_dht({ids[k]: FetchedAdvert(_advert(ids[k], stages[k]), identities[k].public_key_bytes,
                                                time.time() + 60) for k in present})
    view.changed_at -= 10
    return view


def _coordinator(ident, view, published):
    async def publish(epoch):
        published.append(epoch)

    return Coordinator(run_id="r", identity=ident, view=view, run=RunConfig(2, 2, 2), memory=3, debounce_s=0.0,
                       takeover_s=100.0, budget_s=0.2, publish=publish, on_adopt=lambda e: None)


class FakeTrainer:
    """switch_iteration as TrainerNode computes it: current + 2 + the lead in measured iterations."""

    def __init__(self, current, per_it_s):
        self.current, self.per_it_s, self.dataplane = current, per_it_s, object()

    def switch_iteration(self, lead_s=0.0):
        return self.current + 2 + (math.ceil(lead_s / self.per_it_s) if lead_s > 0 else 0)


def _service(iterations, trainer=None, state=ServiceState.TRAINING, daemon=None):
    service = TrainerService.__new__(TrainerService)
    service.iterations, service.trainer, service.state, service.daemon = iterations, trainer, state, daemon
    service._join_failures, service._join_retry_at = 0, 0.0
    return service


def test_join_lead_never_reaches_past_the_run():
    # a 400-iteration run at 0.05 s per iteration, at iteration 100: a 30 s lead is 600 iterations,
    # which used to put the joiner's boundary past the end ("the run ended before this node could join")
    service = _service(400, FakeTrainer(current=100, per_it_s=0.05))
    start = service.switch_iteration(30.0)
    assert 102 <= start < 400, start  # the joiner joins while iterations are left
    assert start == 102 + (400 - 102) // 2  # at most half of what is left
    assert service.switch_iteration(0.0) == 102  # no join: the earliest safe boundary
    slow = _service(400, FakeTrainer(current=10, per_it_s=3.0))
    assert slow.switch_iteration(30.0) == 12 + 10  # a lead that fits is kept: 30 s at 3 s per iteration
    assert capped_join_boundary(398, 700, 400) == 399  # one iteration left: still joins
    assert capped_join_boundary(401, 700, 400) == 401  # none left: past the end (the run is over)
    assert capped_join_boundary(5, 3, 400) == 5  # never before the earliest boundary


def test_candidates_rank_members_before_joiners(identities):
    ids = [i.peer_id.to_base58() for i in identities]
    current = SimpleNamespace(members=(ids[1], ids[2]))
    assert rank_candidates([ids[0], ids[1]], current) == [ids[1], ids[0]]
    assert rank_candidates([ids[1], ids[0]], None) == [ids[0], ids[1]]  # before any epoch: by peer id


async def test_a_joiner_does_not_coordinate_before_its_data_plane_is_up(identities):
    ids = [i.peer_id.to_base58() for i in identities]
    stages = [(0,), (0,), (1,)]
    published = []
    # the run: ids[1] (data node) and ids[2] (stage 1); ids[1] issues epoch 1
    founder = _coordinator(identities[1], _view(identities, 1, [1, 2], stages), published)
    await founder.tick()
    assert len(published) == 1 and set(published[0].members) == {ids[1], ids[2]}
    first = published[0]
    # ids[0] joins as a data node; its peer id sorts first, which used to make it candidate 0
    joined = []
    joiner = _coordinator(identities[0], _view(identities, 0, [0, 1, 2], stages), joined)
    assert joiner.consider(first) == "adopted"
    assert joiner.candidates() == [ids[1], ids[0]]
    service = _service(10, None, ServiceState.AGREEING,
                       SimpleNamespace(current_epoch=first, peer_id=ids[0]))
    joiner.blocker = service.coordination_blocker
    await joiner.tick()
    assert joined == [] and "data plane not up" in joiner.status
    joiner.blocker = None
    await joiner.tick()
    assert joined == [] and "rank 1" in joiner.status  # not before the member data node had its turn
    # with no member data node left, a blocked joiner goes ahead (someone has to include it), and
    # its epoch never starts before the boundary already announced
    alone = _coordinator(identities[0], _view(identities, 0, [0, 2], stages), joined)
    alone.current = first  # adopted while its coordinator was alive
    alone.blocker = service.coordination_blocker
    await alone.tick()
    assert len(joined) == 1 and joined[0].start_iteration >= first.start_iteration
    # the member data node adds the joiner
    member = _coordinator(identities[1], _view(identities, 1, [0, 1, 2], stages), published)
    assert member.consider(first) == "adopted"
    await member.tick()
    assert len(published) == 2 and set(published[1].members) == set(ids)


def test_coordination_blocker_rules(identities):
    ids = [i.peer_id.to_base58() for i in identities]
    start = SimpleNamespace(members=(ids[0], ids[1]), start_iteration=0)
    in_progress = SimpleNamespace(members=(ids[1], ids[2]), start_iteration=50)
    daemon = SimpleNamespace(current_epoch=None, peer_id=ids[0])
    s = _service(100, None, ServiceState.WAITING, daemon)
    assert s.coordination_blocker() is None  # founders issue the first epoch
    daemon.current_epoch = start
    assert s.coordination_blocker() is None  # at the start barrier with the others
    daemon.current_epoch = in_progress
    assert "joining" in s.coordination_blocker()
    s.state = ServiceState.TRAINING
    s.trainer = FakeTrainer(50, 1.0)
    assert s.coordination_blocker() is None
    s.trainer.dataplane = None
    assert "data plane" in s.coordination_blocker()
    s.state = ServiceState.DONE
    assert s.coordination_blocker() is None


def test_the_daemons_coordinator_asks_its_training_service(identities, tmp_path):
    """The service's hooks reach the coordinator through the daemon's own wiring (the coordinator swallows a
    failing blocker, so a hook set under the wrong name would only make a joiner coordinate too early)."""
    from node.swarm.config import DaemonConfig
    from node.swarm.daemon import Daemon
    from node.swarm.wiring import coordinator_of

    ids = [i.peer_id.to_base58() for i in identities]
    daemon = Daemon(DaemonConfig(run_id="r", identity_path=tmp_path / "id.key"))
    daemon.identity, daemon.peer_id, daemon.run = identities[0], ids[0], RunConfig(2, 2, 2)
    daemon.view = _view(identities, 0, [0, 1, 2], [(0,), (0,), (1,)])
    daemon.coordinator = coordinator_of(daemon, daemon._on_adopt)
    assert daemon.coordinator._blocked() is None and daemon.coordinator._progress(0.0) is None  # no service yet
    service = _service(100, None, ServiceState.WAITING)
    service.attach(daemon)
    daemon.coordinator.current = SimpleNamespace(members=(ids[1], ids[2]), start_iteration=50)
    assert "joining" in daemon.coordinator._blocked()  # the service's verdict on the daemon's epoch
    service.state = ServiceState.DONE
    assert daemon.coordinator._blocked() is None and daemon.coordinator._progress(0.0) == 100


def test_after_a_disputed_join_the_daemon_answers_not_ready_for_a_doubling_while(identities, tmp_path):
    """Two replicas of its stage disagree, so the joiner verified no state: until its back-off ends, its
    admission answers say it cannot train (the members drop it at once instead of waiting for its norm)."""
    from node.swarm.config import DaemonConfig
    from node.swarm.daemon import Daemon
    from node.swarm.wiring import admission_of
    from node.train.service import JOIN_RETRY_S, MAX_JOIN_RETRY_S

    daemon = Daemon(DaemonConfig(run_id="r", identity_path=tmp_path / "id.key"))
    daemon.peer_id, daemon.stages = identities[0].peer_id.to_base58(), (1,)
    admission = admission_of(daemon)
    assert admission.answer({"nonce": "n"})["ready"] is True  # no service: nothing against it
    service = _service(100, None, ServiceState.WAITING)
    service.attach(daemon)
    assert service._join_backoff(disputed=False) == 0 and admission.answer({"nonce": "n"})["ready"] is True
    assert service._join_backoff(disputed=True) == JOIN_RETRY_S
    assert admission.answer({"nonce": "n"})["ready"] is False
    assert service._join_backoff(disputed=True) == 2 * JOIN_RETRY_S
    assert max(service._join_backoff(disputed=True) for _ in range(10)) == MAX_JOIN_RETRY_S
    service._join_retry_at = time.monotonic() - 1  # the back-off is over: it may try again
    assert admission.answer({"nonce": "n"})["ready"] is True


def test_a_failing_blocker_is_logged_once_and_coordination_goes_on(identities, caplog):
    coordinator = _coordinator(identities[0], _view(identities, 0, [0], [(0,)]), [])

    def broken():
        raise AttributeError("no such hook")

    coordinator.blocker = broken
    with caplog.at_level("DEBUG", logger="node.swarm.coordinator"):
        assert coordinator._blocked() is None and coordinator._blocked() is None
    failures = [r for r in caplog.records if "blocker failed" in r.getMessage()]
    assert [r.levelno for r in failures] == [logging.WARNING, logging.DEBUG]
