"""Units of the recovery rules that need no network: re-sync source choice, non-finite gradients."""

import math
import types

import torch

from node.train.model import build_stage, model_config
from node.train.runtime import OptimConfig, StageRuntime
from node.train.resync import TIE_MAX_LR_STEPS, ResyncAction, not_averaged_after, resync_decision, within_tie_bound
from node.train.trainer import TrainerConfig


def _node(peer_id: str, stage: int = 1):
    """The resync rule as the replica ``peer_id`` of ``stage`` applies it (members d, a, b; d is stage 0):
    ``_resync_source`` names whom it downloads from (None: it keeps its own state)."""
    tolerance = TrainerConfig().resync_tolerance

    def decide(records, mine, not_averaged=frozenset()):
        replicas = {p: (r["stage"], r["checksum"]) for p, r in records.items()}
        return resync_decision(replicas, mine, stage, peer_id, tolerance, not_averaged)

    return types.SimpleNamespace(_resync_source=lambda records, mine: decide(records, mine).source, decide=decide)


def test_resync_copies_a_finite_majority_only():
    node = _node("b")
    records = {"a": {"stage": 1, "checksum": 10.0}, "b": {"stage": 1, "checksum": 10.5}, "c": {"stage": 1, "checksum": 10.0},
               "d": {"stage": 0, "checksum": 1.0}}
    assert node._resync_source(records, 10.5) == "a"  # diverged: copy the majority's lowest id
    records.pop("c")
    assert node._resync_source(dict(records, b={"stage": 1, "checksum": 10.0}), 10.0) is None  # in sync
    poisoned = dict(records, a={"stage": 1, "checksum": math.nan})
    assert node._resync_source(poisoned, 10.5) is None  # a NaN replica is never a source
    assert _node("a")._resync_source(dict(records, a={"stage": 1, "checksum": math.nan}), math.nan) == "b"


def test_two_replicas_that_disagree_tie_and_only_the_later_id_may_copy_within_bounds():
    """Two replicas that diverged (a failed all-reduce, a view flap) must converge again: with no third
    opinion the one whose id sorts later may copy the other, as a TIE (bounded by within_tie_bound and a
    rate limit in the commit), never as a plain FOLLOW."""
    records = {"a": {"stage": 1, "checksum": 99.0}, "b": {"stage": 1, "checksum": 10.0},
               "d": {"stage": 0, "checksum": 1.0}}
    decision = _node("b").decide(records, 10.0)
    assert decision.action is ResyncAction.TIE and decision.source == "a"
    assert _node("a").decide(records, 99.0).action is ResyncAction.KEEP


def test_of_two_replicas_the_one_whose_averaging_round_failed_copies_the_other():
    """A round whose results did not all come back leaves the replica that failed on its own gradient and the
    other on the mean: the one that failed copies, whichever id sorts first; when both failed, the ids decide."""
    records = {"a": {"stage": 1, "checksum": 99.0}, "b": {"stage": 1, "checksum": 10.0},
               "d": {"stage": 0, "checksum": 1.0}}
    a_failed = _node("a").decide(records, 99.0, {"a", "d"})
    assert a_failed.action is ResyncAction.TIE and a_failed.source == "b", a_failed
    assert _node("b").decide(records, 10.0, {"a", "d"}).action is ResyncAction.KEEP
    both = _node("b").decide(records, 10.0, {"a", "b"})
    assert both.action is ResyncAction.TIE and both.source == "a"
    assert _node("a").decide(records, 99.0, {"a", "b"}).action is ResyncAction.KEEP
    # three replicas: the majority rule alone decides
    three = dict(records, c={"stage": 1, "checksum": 10.0})
    assert _node("a").decide(three, 99.0, {"b", "c"}).action is ResyncAction.FOLLOW


def test_resync_follows_the_majority_not_the_lowest_peer_id():
    """Three replicas; "a" (the lowest id, the old canonical source) diverged: the others keep their
    weights and "a" copies the majority's lowest id."""
    records = {"a": {"stage": 1, "checksum": 99.0}, "b": {"stage": 1, "checksum": 10.0},
               "c": {"stage": 1, "checksum": 10.0 + 1e-7}, "d": {"stage": 0, "checksum": 1.0}}
    assert _node("b")._resync_source(records, 10.0) is None
    assert _node("c")._resync_source(records, 10.0 + 1e-7) is None
    decision = _node("a").decide(records, 99.0)
    assert decision.action is ResyncAction.FOLLOW and decision.source == "b" and decision.backers == ("b", "c")


def test_with_no_majority_a_replica_keeps_its_own_state():
    """Three replicas that all differ (one liar, one honest replica that diverged): nobody follows "the
    lowest peer id", each keeps its own; two against two is no majority either; its own checksum counts
    as one opinion when it matches one of its peers'."""
    three = {"a": {"stage": 1, "checksum": 99.0}, "b": {"stage": 1, "checksum": 10.0},
             "c": {"stage": 1, "checksum": 11.0}, "d": {"stage": 0, "checksum": 1.0}}
    for me in ("b", "c"):
        decision = _node(me).decide(three, three[me]["checksum"])
        assert decision.action is ResyncAction.REFUSE and decision.source is None, decision
        assert "no majority among 3 replicas" in decision.why
    assert _node("a").decide(three, 99.0).action is ResyncAction.REFUSE
    four = dict(three, c={"stage": 1, "checksum": 99.0}, e={"stage": 1, "checksum": 10.0})
    assert _node("b").decide(four, 10.0).action is ResyncAction.REFUSE  # 2 against 2
    # our own opinion breaks the tie between two peers: we agree with "b", so "a" is outvoted
    mine_matches = dict(three, c={"stage": 1, "checksum": 10.0})
    assert _node("c").decide(mine_matches, 10.0).action is ResyncAction.KEEP
    assert _node("a").decide(mine_matches, 99.0).source == "b"
    # a liar with the lowest id in a stage of three where the other two disagree hands nobody its weights
    assert all(_node(me)._resync_source(three, three[me]["checksum"]) != "a" for me in ("b", "c"))


def test_a_tie_copies_only_a_state_a_failed_round_explains():
    """Between two replicas the copy is bounded: weights a few learning-rate steps away (a failed
    averaging round) are taken, all-zero or perturbed weights (a liar with the lower id) are not."""
    lr = 1e-3
    mine = {"w": torch.ones(4, 3), "b": torch.zeros(3), "steps": torch.tensor(3)}
    near = {"w": mine["w"] + 2 * lr, "b": mine["b"] - 3 * lr, "steps": torch.tensor(4)}
    ok, steps = within_tie_bound(mine, near, lr)
    assert ok and abs(steps - 3.0) < 1e-6
    assert not within_tie_bound(mine, {"w": torch.zeros(4, 3), "b": mine["b"], "steps": mine["steps"]}, lr)[0]
    assert not within_tie_bound(mine, dict(near, w=mine["w"] + 2 * TIE_MAX_LR_STEPS * lr), lr)[0]
    beyond = dict(near, w=mine["w"] + (TIE_MAX_LR_STEPS + 2) * lr)
    assert not within_tie_bound(mine, beyond, lr)[0] and within_tie_bound(mine, beyond, lr, skipped=1)[0]
    assert not within_tie_bound(mine, dict(near, w=torch.full((4, 3), math.nan)), lr)[0]
    assert not within_tie_bound(mine, dict(near, w=torch.ones(3, 4)), lr)[0]
    assert not within_tie_bound(mine, {"w": near["w"]}, lr)[0]


def test_a_stage_mate_whose_record_we_lack_counts_as_not_averaged_so_never_both_copy():
    """A view flap: "a" lost "b" from its view in iteration 1, skipped its round and did not wait for b's record;
    "b"'s round failed (its partner went on). "b" holds both records, "a" only its own. Both must count both
    as not averaged, so the id rule decides for both and exactly one copies (with "a" counting only itself,
    "a" copied by "our round failed" and "b" by the id rule: two downloads that timed out, every iteration)."""
    failed = types.SimpleNamespace(avg_group=())
    averaged = types.SimpleNamespace(avg_group=("a", "b"))
    seen_by_a = not_averaged_after(set(), {"a": failed, "d": averaged}, ["a", "b"], in_sync=True)
    seen_by_b = not_averaged_after(set(), {"a": failed, "b": failed, "d": averaged}, ["a", "b"], in_sync=True)
    assert seen_by_a == seen_by_b == {"a", "b"}
    records = {"a": {"stage": 1, "checksum": 99.0}, "b": {"stage": 1, "checksum": 10.0}}
    decisions = [_node("a").decide(records, 99.0, seen_by_a), _node("b").decide(records, 10.0, seen_by_b)]
    assert [d.action for d in decisions] == [ResyncAction.KEEP, ResyncAction.TIE], decisions
    # out of sync, failures add up until the stage agrees again; then only the new iteration's count
    assert not_averaged_after({"a"}, {"a": averaged, "b": averaged}, ["a", "b"], in_sync=False) == {"a"}
    assert not_averaged_after({"a"}, {"a": averaged, "b": averaged}, ["a", "b"], in_sync=True) == set()
    assert not_averaged_after(set(), {"a": averaged, "b": averaged, "c": failed}, ["a", "b"], in_sync=True) == set()


async def test_a_tie_with_a_liar_with_the_lower_id_keeps_our_weights(monkeypatch):
    """The commit's wiring of the tie: replica "b" of stage 1 disagrees with "a" (lower id); "a" serves
    all-zero weights: "b" keeps its own (and steps on), tries no second download within
    TIE_EVERY_ITERATIONS, then takes a state a failed round explains. Only the download is stubbed."""
    import node.dataplane.state_transfer as transfer
    from node.train.commit import IterationCommit
    from node.train.progress import StageResources
    from node.train.resync import TIE_EVERY_ITERATIONS, ResyncDecision

    cfg = TrainerConfig()
    runtime = StageRuntime(build_stage(model_config("tiny", n_stages=3), 1, 0), OptimConfig(lr=cfg.optim.lr))
    ours = {k: v.clone() for k, v in runtime.module.state_dict().items()}
    served = []

    async def fetch(p2p, run_id, peers, stage, it, **kw):
        state = served.pop(0)
        served.append(state)
        return types.SimpleNamespace(state=state), None

    monkeypatch.setattr(transfer, "fetch_verified_state", fetch)

    async def compute(fn, *args):
        return fn(*args)

    commit = IterationCommit(cfg, peer_id="b", node_name="b", epochs=types.SimpleNamespace(stage=1), progress=
                             types.SimpleNamespace(state_iteration=-1), health=None, resources=
                             StageResources(runtime=runtime), sender=None, compute=compute, expected_state=lambda: None)
    tie = ResyncDecision(ResyncAction.TIE, "a", ("a",), "two replicas disagree")
    full = runtime.state_dict()
    served.append({**full, "model": {k: torch.zeros_like(v) for k, v in full["model"].items()}})
    assert await commit._resync(tie, 10) is None  # refused: the caller steps as usual
    assert all(torch.equal(ours[k], v) for k, v in runtime.module.state_dict().items())
    assert commit.resyncs_refused == 1 and commit.resyncs == 0
    served[0] = {**full, "model": {k: v + 2 * cfg.optim.lr for k, v in ours.items()}}  # a failed round's distance
    assert await commit._resync(tie, 11) is None and commit.resyncs_refused == 2  # too soon: not even asked
    assert await commit._resync(tie, 10 + TIE_EVERY_ITERATIONS) is True and commit.resyncs == 1
    assert all(torch.allclose(ours[k] + 2 * cfg.optim.lr, v) for k, v in runtime.module.state_dict().items())
    # a replica that skipped its own step knows it is behind: it may copy again at once, a bit further
    far = {k: v + (TIE_MAX_LR_STEPS + 2) * cfg.optim.lr for k, v in runtime.module.state_dict().items()}
    served[0] = {**full, "model": far}
    assert await commit._resync(tie, 11 + TIE_EVERY_ITERATIONS) is None  # too soon, nothing skipped
    commit._skipped_steps = 1
    assert await commit._resync(tie, 12 + TIE_EVERY_ITERATIONS) is True and commit.resyncs == 2
    assert commit._skipped_steps == 0
    # one whose own averaging round failed knows why it differs: it copies at once, within the usual bound
    served[0] = {**full, "model": {k: v + 2 * cfg.optim.lr for k, v in runtime.module.state_dict().items()}}
    assert await commit._resync(tie, 13 + TIE_EVERY_ITERATIONS) is None  # too soon, our round went fine
    assert await commit._resync(tie, 14 + TIE_EVERY_ITERATIONS, own_round_failed=True) is True and commit.resyncs == 3


def test_last_bit_noise_of_an_allreduce_is_not_a_divergence():
    """Measured on skippipe up: ordinary rounds leave checksums of ~130 equal to 9 digits (below
    5e-7 apart); a failed round left 130.243528 vs 130.172493. Only the second must trigger a state download."""
    node = _node("b")
    records = {"a": {"stage": 1, "checksum": 129.568975}, "b": {"stage": 1, "checksum": 129.568975 + 4e-7}}
    assert node._resync_source(records, 129.568975 + 4e-7) is None
    records = {"a": {"stage": 1, "checksum": 130.172493}, "b": {"stage": 1, "checksum": 130.243528},
               "c": {"stage": 1, "checksum": 130.172493}}
    assert node._resync_source(records, 130.243528) == "a"


def test_skip_step_leaves_parameters_untouched():
    rt = StageRuntime(build_stage(model_config("tiny", n_stages=3), 1, 0), OptimConfig())
    before = [p.detach().clone() for p in rt.parameters()]
    for p in rt.parameters():
        p.grad = torch.full_like(p, math.nan)
    rt.skip_step()
    assert all(torch.equal(a, b) for a, b in zip(before, rt.parameters()))
    assert all(bool((p.grad == 0).all()) for p in rt.parameters()) and rt.visits == 0


def test_a_peer_counts_as_gone_only_after_the_grace_and_a_return_resets_it():
    from node.train.trainer import gone_peers

    alive = {"a": True, "b": False, "c": False}
    absent: dict = {}
    assert gone_peers(["a", "b"], alive.get, absent, now=100.0, grace_s=10.0) == set()
    assert absent == {"b": 100.0}
    assert gone_peers(["a", "b"], alive.get, absent, now=109.9, grace_s=10.0) == set()
    assert gone_peers(["a", "b", "c"], alive.get, absent, now=110.0, grace_s=10.0) == {"b"}  # c just left
    alive["b"] = True  # its advert came back: the lapse is forgotten
    assert gone_peers(["b"], alive.get, absent, now=111.0, grace_s=10.0) == set() and "b" not in absent
    alive["b"] = False
    assert gone_peers(["b"], alive.get, absent, now=112.0, grace_s=10.0) == set()  # a new lapse starts over
    assert gone_peers(["b", "c"], alive.get, absent, now=122.0, grace_s=10.0) == {"b", "c"}
    assert gone_peers(["c"], alive.get, {}, now=0.0, grace_s=0.0) == {"c"}  # no grace: at once


def _bound_node(metrics, **cfg):
    from node.train.trainer import TrainerNode

    epoch = types.SimpleNamespace(epoch=0, start_iteration=0, members=("d", "a", "b"), run_id="skippipe",
                                  schedule={"stages": [[0], [1], [2]], "path_length": 3, "memory": 1,
                                            "paths": [{"data_node": 0, "route": [0, 1, 2], "microbatches": 2}]})
    t = TrainerNode(p2p=None, dht=None, peer_id="d", epoch=epoch, config=TrainerConfig(**cfg), metrics=metrics,
                    alive=lambda p: p != "a")
    t.epochs.bind(epoch)
    t.current_iteration = 0
    t.runtime = types.SimpleNamespace(drop=lambda key: None)
    return t


def test_skips_and_drops_are_counted_in_the_metrics():
    import asyncio

    from node.ops.metrics import NodeMetrics
    from node.train.common import Pending
    from protocol import ActivationMessage, MicrobatchId

    m = NodeMetrics()
    t = _bound_node(m, max_retries=0)
    sent = []

    async def send(peer, msg):
        sent.append((peer, msg.route))

    t.dataplane = types.SimpleNamespace(send=send)
    mb = MicrobatchId("skippipe", 0, 0, "d", 0, 0)
    # a is down and has no other replica: the path may lose one stage, so it skips to b
    asyncio.run(t.recovery.send_forward(ActivationMessage(mb, 1, ("d", "a", "b", "d"), None)))
    assert sent == [("b", ("d", "b", "d"))] and t.skips == 1 and m.sample("skippipe_skips_total") == 1

    st = t.iteration_state(0)
    st.remaining = 2
    p = Pending(0, 0, ("d", "a", "b", "d"), deadline=0.0)
    t.recovery.pending[0] = p
    t.recovery.fail_microbatch(p, "test")  # no retries left: dropped
    assert st.dropped == 1 and st.remaining == 1 and m.sample("skippipe_dropped_microbatches_total") == 1


def test_a_data_node_does_not_pause_an_iteration_another_data_node_already_finished():
    """Data nodes decide to pause at an iteration boundary from their own views, which may differ by a
    heartbeat: one that began the iteration waits for the other's IterationDone, so the other must run it
    (skipping or dropping what it cannot route) instead of pausing before it."""
    from node.train.common import IterationState
    from node.train.trainer import begun_elsewhere

    iters = {5: IterationState()}
    assert not begun_elsewhere(iters, 5, "me") and not begun_elsewhere(iters, 6, "me")
    iters[5].done["me"] = object()  # our own IterationDone does not count
    assert not begun_elsewhere(iters, 5, "me")
    iters[5].done["other-data-node"] = object()
    assert begun_elsewhere(iters, 5, "me") and not begun_elsewhere(iters, 6, "me")
