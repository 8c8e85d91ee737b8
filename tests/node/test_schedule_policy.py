"""Run-level schedule policy (``--schedule-policy``) and emulated schedule cost (``--schedule-cost``).

A swarm founded with ``--schedule-policy full`` / ``random`` issues the baselines of
:mod:`scheduler.baselines` instead of SkipPipe paths (bench/wan.py runs all three on daemons);
``--schedule-cost emulation`` makes the coordinator schedule for the emulated links by location.
"""

from __future__ import annotations

import time

import pytest

import node.compat  # noqa: F401
from node.cli.node_cmd import add_node_run_arguments, config_from_args, emulated_location_cost
from node.cli.train_args import add_training_arguments
from node.swarm.coordinator import Coordinator, RunConfig
from node.swarm.adverts import FetchedAdvert
from node.net.identity import load_or_create_identity
from node.swarm.view import SwarmView
from protocol.messages import StageAdvert
from scheduler.cost import LinkProfile
from scheduler.schedule import Schedule
from tests.node.helpers import error_lines, run_cli

PROFILE = "/work/shared/profiles/geo-distributed-12.json"
STAGES = [(0,), (0,), (0,), (1,), (1,), (2,), (2,)]


@pytest.fixture(scope="module")
def identities(tmp_path_factory):
    d = tmp_path_factory.mktemp("ids")
    ids = [load_or_create_identity(d / f"id{i}.key") for i in range(len(STAGES))]
    return sorted(ids, key=lambda i: i.peer_id.to_base58())


def _advert(peer_id: str, stages, location=None) -> StageAdvert:
    return StageAdvert(
        run_id="r", peer_id=peer_id, gossip_peer_id="g", maddrs=(), gossip_maddrs=(), stages=tuple(stages),
        state="ONLINE", compute_s_per_sample_per_layer=0.05, memory_slots=3, free_slots=3, protocol_version=1,
        rpc_port=None, location=location, timestamp=time.time(),
    )  # fmt: skip


def _view(identities, self_index, locations=None):
    ids = [i.peer_id.to_base58() for i in identities]
    view = SwarmView(run_id="r", self_id=ids[self_index])
    view.update_from_dht({
        p: FetchedAdvert(_advert(p, STAGES[k], locations[k] if locations else None), identities[k].public_key_bytes,
                         time.time() + 60)
        for k, p in enumerate(ids)
    })  # fmt: skip
    view.changed_at -= 10
    return view


def _coordinator(ident, view, run, published):
    async def publish(epoch):
        published.append(epoch)

    return Coordinator(run_id="r", identity=ident, view=view, run=run, memory=3, debounce_s=0.0, takeover_s=100.0,
                       budget_s=0.5, publish=publish, on_adopt=lambda e: None)


def _routes(epoch):
    sched = Schedule.from_json(epoch.schedule)
    stage_of = {v: s for s, nodes in enumerate(sched.stages) for v in nodes}
    return sched, [[stage_of[v] for v in p.route] for p in sched.paths]


async def test_policy_full_issues_full_pipelines_that_peers_adopt(identities):
    run = RunConfig(3, 2, 2, "full")
    published = []
    await _coordinator(identities[0], _view(identities, 0), run, published).tick()
    assert len(published) == 1
    sched, routes = _routes(published[0])
    assert routes and all(r == [0, 1, 2] for r in routes)  # every microbatch through every stage, in order
    assert sum(p.microbatches for p in sched.paths) == 3 * 2  # the same global batch as a skipping schedule
    assert len({p.route for p in sched.paths}) == 2  # fixed pipelines: as many as the smallest stage
    follower = _coordinator(identities[-1], _view(identities, len(identities) - 1), run, [])
    assert follower.consider(published[0]) == "adopted"


async def test_policy_random_and_default_skip_stages(identities):
    for policy in ("random", "skippipe"):
        published = []
        await _coordinator(identities[0], _view(identities, 0), RunConfig(3, 2, 2, policy), published).tick()
        _, routes = _routes(published[0])
        assert all(len(r) == 2 and r[0] == 0 for r in routes), (policy, routes)


def test_run_config_defaults_parse_old_hello():
    old = {"num_stages": 6, "path_length": 4, "microbatches_per_data_node": 6}
    run = RunConfig.from_json(old)
    assert run == RunConfig(6, 4, 6) and run.schedule_policy == "skippipe" and run.location_cost is None
    full = RunConfig(6, 4, 6, "full", {"locations": ["a"], "compute_s": [1.0], "link_s": [[0.5]]})
    assert RunConfig.from_json(full.to_json()) == full
    assert full.expected_microbatches() is None and run.expected_microbatches() == 6


def test_cost_by_location_expands_the_table():
    table = {"locations": ["a", "b"], "compute_s": [1.0, 2.0], "link_s": [[0.1, 0.7], [0.8, 0.2]]}
    cost = RunConfig(2, 2, 1, location_cost=table).cost_by_location(["b", "a", "a"])
    assert cost.compute_s == (2.0, 1.0, 1.0)
    assert cost.link_s == ((0.0, 0.8, 0.8), (0.7, 0.0, 0.1), (0.7, 0.1, 0.0))  # same location: its own entry
    assert RunConfig(2, 2, 1, location_cost=table).cost_by_location(["a", None]) is None  # fall back to measurements
    assert RunConfig(2, 2, 1).cost_by_location(["a"]) is None


def _parse(*argv):
    import argparse

    p = argparse.ArgumentParser()
    add_node_run_arguments(p)
    add_training_arguments(p)
    return p.parse_args(list(argv))


def test_flags_reach_the_daemon_config():
    cfg = config_from_args(_parse("--schedule-policy", "random", "--schedule-budget", "7"))
    assert cfg.schedule_policy == "random" and cfg.location_cost is None and cfg.schedule_budget_s == 7.0
    assert config_from_args(_parse()).schedule_policy == "skippipe"
    args = _parse("--schedule-cost", "emulation", "--network-profile", PROFILE, "--location", "Germany",
                  "--latency-scale", "0.05", "--bandwidth-scale", "0.08", "--hop-overhead-s", "0.0175",
                  "--compute-s-per-sample-per-layer", "0.011", "--microbatch-size", "8")
    table = emulated_location_cost(args)
    prof = LinkProfile.load(PROFILE)
    assert table["locations"] == list(prof.locations)
    assert table["compute_s"][0] == pytest.approx(0.011 * 1 * 8)  # tiny: 1 layer per stage, 8 samples
    a, b = 0, 1
    lk = prof.link(prof.locations[a], prof.locations[b])
    want = lk.latency_ms * 0.05 / 1000 + 8 * 64 * 64 * 4 / (lk.bandwidth_GiBps * 2**30 * 0.08) + 0.0175
    assert table["link_s"][a][b] == pytest.approx(want)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv, needle", [
    (["--schedule-policy", "fastest"], "--schedule-policy must be one of skippipe, full, random"),
    (["--schedule-cost", "emulation"], "--schedule-cost emulation needs --network-profile"),
])  # fmt: skip
def test_bad_values_give_one_error_line(tmp_path, argv, needle):
    proc = run_cli("node", "run", "--stages", "0", "--identity", str(tmp_path / "id.key"), *argv)
    assert proc.returncode != 0
    errors = error_lines(proc)
    assert len(errors) == 1 and needle in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
