"""The stage probe (membership is earned by holding the stage): its sketch comparison on real stages, and
admission's use of it with a fake challenge call (pure units; the daemons' behaviour is in
``tests/faults/test_bad_joiners.py``)."""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch

from node.dataplane.probe import (PROBE_TOLERANCE, SKETCH_LEN, check_sketch, probe_input, sketches_close,
                                  stage_sketch)
from node.swarm import admission as adm
from node.swarm.admission import PROOF_PENDING, Admission
from node.train.model import build_stage, model_config

STAGE = 1
#: Steps the whole tiny model trains before the comparison (its weights must have left their initial values
#: by more than the probe's tolerance for "initial weights" to count as wrong), and steps a joiner is behind.
WARMUP_STEPS, BEHIND_STEPS = 60, 3


@pytest.fixture(scope="module")
def trained():
    """(live stage, the same stage BEHIND_STEPS steps earlier, config) after WARMUP_STEPS steps of training."""
    torch.manual_seed(0)
    cfg = model_config("tiny")
    stages = [build_stage(cfg, s, seed=0) for s in range(cfg.n_stages)]
    params = [p for m in stages for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95))

    def step():
        start = torch.randint(0, cfg.vocab_size, (4, 1))
        t = (start * 7 + torch.arange(17).unsqueeze(0) * 13) % cfg.vocab_size
        h = stages[0].embed(t[:, :-1])
        for m in stages[1:]:
            h = m(h)
        opt.zero_grad()
        stages[0].head_loss(h, t[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    for _ in range(WARMUP_STEPS):
        step()
    behind = copy.deepcopy(stages[STAGE])
    for _ in range(BEHIND_STEPS):
        step()
    return stages[STAGE], behind, cfg


def _distance(module, reference, cfg, nonce):
    return sketches_close(stage_sketch(module, nonce, cfg.d_model), stage_sketch(reference, nonce, cfg.d_model))


@pytest.mark.parametrize("nonce", [bytes(16), os.urandom(16)], ids=["zero-nonce", "random-nonce"])
def test_the_stage_and_a_joiner_a_few_steps_behind_pass_other_weights_fail(trained, nonce):
    live, behind, cfg = trained
    assert _distance(live, live, cfg, nonce) == (True, 0.0)
    ok, d = _distance(behind, live, cfg, nonce)
    assert ok and d < PROBE_TOLERANCE / 2, d
    reinit = build_stage(cfg, STAGE, seed=12345)
    assert not _distance(reinit, live, cfg, nonce)[0]
    assert not _distance(build_stage(cfg, STAGE, seed=0), live, cfg, nonce)[0]  # never downloaded
    zeroed = copy.deepcopy(live)
    with torch.no_grad():
        for p in zeroed.parameters():
            p.zero_()
    assert not _distance(zeroed, live, cfg, nonce)[0]


def test_the_probe_input_and_sketch_follow_the_nonce():
    a, b = os.urandom(16), os.urandom(16)
    assert torch.equal(probe_input(a, 8), probe_input(a, 8)) and not torch.equal(probe_input(a, 8), probe_input(b, 8))
    cfg = model_config("tiny")
    stage = build_stage(cfg, STAGE, seed=0)
    assert len(stage_sketch(stage, a, cfg.d_model)) == SKETCH_LEN
    assert stage_sketch(stage, a, cfg.d_model) != stage_sketch(stage, b, cfg.d_model)


@pytest.mark.parametrize("answer", [None, "x", [1.0] * (SKETCH_LEN - 1), [1.0] * (SKETCH_LEN + 1),
                                    [float("nan")] + [1.0] * (SKETCH_LEN - 1), [float("inf")] * SKETCH_LEN,
                                    [True] * SKETCH_LEN, [[1.0]] * SKETCH_LEN, {"a": 1}])
def test_malformed_or_non_finite_sketches_are_refused(answer):
    assert check_sketch(answer) is None
    assert check_sketch([1] * SKETCH_LEN) == [1.0] * SKETCH_LEN


# ---------------------------------------------------------------------------------------------- admission
CANDIDATE, REPLICA, ME = "cand", "replica", "me"
#: The iteration the challenger's trainer has committed (probes are asked only while it trains).
TRAINING_AT = 10
DIGEST = "d" * 64


class _Entry:
    def __init__(self, peer_id, stages):
        self.peer_id = peer_id
        self.advert = type("Advert", (), {"config_digest": DIGEST, "stages": tuple(stages)})()


def _admission(candidate_module, reference_module, cfg, mine=None, replicas=(CANDIDATE, REPLICA)):
    """``ME`` (holding ``mine``'s stage or nothing) challenges ``CANDIDATE``, which answers with
    ``candidate_module`` (a module, None: no state yet, or a list: a forged answer); ``REPLICA`` is the
    epoch's replica of the stage (``reference_module``, None: it answers nothing)."""

    def sketch_of(module, nonce):
        return stage_sketch(module, nonce, cfg.d_model) if isinstance(module, torch.nn.Module) else module

    async def call(peer, params):
        reply = {"nonce": params["nonce"], "peer_id": peer, "config_digest": DIGEST, "iteration": None, "ready": True}
        if "probe" in params:
            reply["probe"] = sketch_of(candidate_module, bytes.fromhex(params["nonce"]))
        return reply

    async def ask(peer, params):
        assert peer == REPLICA and params["stage"] == STAGE
        return {"sketch": sketch_of(reference_module, bytes.fromhex(params["nonce"]))}

    async def own(stage, nonce):
        return sketch_of(mine, nonce) if mine is not None and stage == STAGE else None

    return Admission(ME, DIGEST, call, lambda: (0,), sketch=own, replicas=lambda s: list(replicas),
                     ask_replica=ask, is_member=lambda peer: peer in (ME, REPLICA), iteration=lambda: TRAINING_AT)


async def _round(a):
    await a.round([_Entry(CANDIDATE, (STAGE,))], [ME, REPLICA])
    return CANDIDATE in a.admitted


async def test_admission_admits_a_candidate_only_when_its_probe_matches_a_live_replica(trained):
    live, behind, cfg = trained
    # the verifier asks the replica (it holds another stage itself), or computes it on its own weights
    assert await _round(_admission(behind, live, cfg))
    assert await _round(_admission(behind, None, cfg, mine=live))
    for wrong in (build_stage(cfg, STAGE, seed=12345), [float("nan")] * SKETCH_LEN, [0.0] * (SKETCH_LEN + 2)):
        a = _admission(wrong, live, cfg)
        assert not await _round(a) and a.probe_refused == 1
        assert a._retry_at[CANDIDATE] - time.monotonic() > adm.PROOF_PENDING_RETRY_S  # the full retry wait


async def test_a_candidate_without_state_is_asked_again_soon_and_a_lone_one_is_trusted_with_a_log(trained, caplog):
    live, behind, cfg = trained
    a = _admission(None, live, cfg)
    assert not await _round(a) and a.probe_refused == 0
    assert a._retry_at[CANDIDATE] - time.monotonic() <= adm.PROOF_PENDING_RETRY_S
    # no live replica answers a reference: admitted on its answer's shape, and whom it trusted is logged
    a = _admission(behind, None, cfg)
    assert await _round(a) and a.trusted_alone == {CANDIDATE: STAGE}
    assert "without comparing its weights" in caplog.text
    # ... but not a non-finite answer
    assert not await _round(_admission([float("nan")] * SKETCH_LEN, None, cfg))
    # before any epoch trains (no members), founders are admitted on the challenge alone
    a = _admission(None, None, cfg)
    await a.round([_Entry(CANDIDATE, (STAGE,))], [])
    assert CANDIDATE in a.admitted
    # a candidate without state for a stage no live replica holds (it went missing: training paused for
    # it) has nothing to download: it is admitted alone, as the node that brings the stage back
    a = _admission(None, None, cfg, replicas=(CANDIDATE,))
    assert await _round(a) and a.trusted_alone == {CANDIDATE: STAGE}
    assert "no live replica holds the stage" in caplog.text
    # ... and so is a late node once the challenger no longer trains (the run ended: nothing to prove)
    a = _admission(None, None, cfg)
    a._iteration = lambda: None
    assert await _round(a)
    assert PROOF_PENDING  # the reason a candidate without state is given


async def test_a_stage_probe_answer_is_bounded_and_off_the_event_loop_for_malformed_requests(trained):
    live, _, cfg = trained
    a = _admission(None, None, cfg, mine=live)
    good = os.urandom(16).hex()
    assert check_sketch((await a.reference({"stage": STAGE, "nonce": good}))["sketch"]) is not None
    for params in ({"stage": STAGE, "nonce": "zz"}, {"stage": STAGE, "nonce": "a" * 200}, {"stage": "1", "nonce": good},
                   {"stage": True, "nonce": good}, {"stage": 10 ** 9, "nonce": good}, {"stage": 2, "nonce": good}):
        assert (await a.reference(params))["sketch"] is None
    reply = await a.answer_challenge({"nonce": good, "probe": STAGE})
    assert check_sketch(reply["probe"]) is not None and reply["nonce"] == good


async def test_sketches_answer_members_only_so_a_candidate_cannot_relay_its_challenge(trained):
    from node.net.rpc import CALLER_PARAM

    live, _, cfg = trained
    a = _admission(None, None, cfg, mine=live)
    nonce = os.urandom(16).hex()
    with pytest.raises(PermissionError):
        await a.reference({"stage": STAGE, "nonce": nonce, CALLER_PARAM: CANDIDATE})
    assert (await a.answer_challenge({"nonce": nonce, "probe": STAGE, CALLER_PARAM: CANDIDATE}))["probe"] is None
    assert check_sketch((await a.reference({"stage": STAGE, "nonce": nonce, CALLER_PARAM: REPLICA}))["sketch"])
    assert check_sketch((await a.answer_challenge({"nonce": nonce, "probe": STAGE, CALLER_PARAM: REPLICA}))["probe"])


async def test_admission_vouches_for_a_candidate_that_answers_and_caches_both_verdicts(trained):
    calls = []

    async def call(peer, params):
        calls.append(peer)
        assert "probe" not in params  # the state is what it needs to answer one
        return {"nonce": params["nonce"], "peer_id": peer, "config_digest": DIGEST if peer == CANDIDATE else "x" * 64}

    a = Admission(ME, DIGEST, call, lambda: (0,))
    assert await a.vouch(CANDIDATE) and await a.vouch(CANDIDATE) and calls == [CANDIDATE]
    assert not await a.vouch("other") and not await a.vouch("other") and calls == [CANDIDATE, "other"]
    assert await a.vouch(ME)


async def test_one_lying_reference_replica_cannot_keep_an_honest_candidate_out(trained):
    live, behind, cfg = trained
    liar, honest = "a-liar", "b-honest"  # the liar sorts first: asked first

    async def call(peer, params):
        return {"nonce": params["nonce"], "peer_id": peer, "config_digest": DIGEST,
                "probe": stage_sketch(behind, bytes.fromhex(params["nonce"]), cfg.d_model)}

    async def ask(peer, params):
        module = build_stage(cfg, STAGE, seed=99) if peer == liar else live
        return {"sketch": stage_sketch(module, bytes.fromhex(params["nonce"]), cfg.d_model)}

    a = Admission(ME, DIGEST, call, lambda: (0,), sketch=lambda s, n: _none(), replicas=lambda s: [honest, liar],
                  ask_replica=ask, iteration=lambda: TRAINING_AT)
    await a.round([_Entry(CANDIDATE, (STAGE,))], [ME, liar, honest])
    assert CANDIDATE in a.admitted and a.probe_refused == 0


async def _none():
    return None


def test_a_candidates_proof_is_downloaded_from_its_stages_replicas_at_the_replicas_pace():
    from types import SimpleNamespace

    from node.train import proof

    epoch = SimpleNamespace(members=("d", "a", "b", "me"), schedule={"stages": [[0], [1, 2, 3]]})
    assert proof.stage_replicas(epoch, 1, exclude="me") == ["a", "b"] and proof.stage_replicas(epoch, 5) == []
    assert proof.stage_replicas(None, 1) == []
    p = proof.StageProof(SimpleNamespace(), 1, peer_id="me", p2p=None, dht=None, epoch=lambda: epoch)
    assert p.refresh_after_s() == proof.PROOF_REFRESH_S  # before two downloads: the floor
    p._pace = 0.5  # steps per second: PROOF_MAX_LAG_STEPS steps take 20 s
    assert p.refresh_after_s() == proof.PROOF_MAX_LAG_STEPS / 0.5
    p._pace = 1e-6
    assert p.refresh_after_s() == proof.MAX_PROOF_REFRESH_S
    p._pace = 1e6
    assert p.refresh_after_s() == proof.PROOF_REFRESH_S


async def test_the_sketch_comes_from_the_trainer_while_it_trains_else_from_the_proof(trained):
    from types import SimpleNamespace

    from node.train import proof

    live, behind, cfg = trained

    async def compute(fn):
        return fn()

    trainer = SimpleNamespace(runtime=SimpleNamespace(stage=STAGE, module=live), pipeline=SimpleNamespace(compute=compute))
    held = proof.StageProof(SimpleNamespace(model=cfg), STAGE, peer_id="me", p2p=None, dht=None, epoch=lambda: None)
    held.module = behind
    nonce = os.urandom(16)
    want_live, want_behind = stage_sketch(live, nonce, cfg.d_model), stage_sketch(behind, nonce, cfg.d_model)
    assert await proof.held_sketch(STAGE, nonce, trainer, True, held, cfg.d_model) == want_live
    assert await proof.held_sketch(STAGE, nonce, trainer, False, held, cfg.d_model) == want_behind
    assert await proof.held_sketch(STAGE + 1, nonce, trainer, True, held, cfg.d_model) is None
    assert await proof.held_sketch(STAGE, nonce, None, False, None, cfg.d_model) is None


def test_a_moved_node_proves_its_new_stage():
    from types import SimpleNamespace

    from node.train import proof

    host = SimpleNamespace(stages=(1,), peer_id="me", p2p=None, dht=None, current_epoch=None,
                           reaches_directly=lambda peer: True)
    cfg = SimpleNamespace(model=model_config("tiny"))
    p = proof.proof_for(cfg, host, None, wanted=lambda: True)
    p.module, p.iteration = object(), 7
    host.stages = (2,)
    p._follow_stage()
    assert (p.stage, p.module, p.iteration) == (2, None, None)
    host.stages = (1, 2)  # several stages: not probed, the proof keeps what it had
    p._follow_stage()
    assert p.stage == 2 and proof.proof_for(cfg, host, None, wanted=lambda: True) is None
