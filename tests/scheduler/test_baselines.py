"""Baselines: structure, and that they never beat the optimiser on the fixtures."""

import pytest

from scheduler.allocation import allocate
from scheduler.baselines import aligned_pipelines, full_pipeline, random_skip
from scheduler.compare import compare_variants
from scheduler.cost import LinkProfile, build_cost, nodes_round_robin
from scheduler.simulator import simulate
from scheduler.validate import validate_schedule

from .conftest import GEO_STAGES, uniform_cost


def test_full_pipeline_keeps_global_batch():
    stages = ((0, 1, 2, 3, 4), (5, 6, 7), (8, 9, 10))
    sched = full_pipeline(stages, uniform_cost(11, link=1.0), 6, 3)
    assert sched.path_length == 3
    assert sum(p.microbatches for p in sched.paths) == 30
    assert sorted(p.microbatches for p in sched.paths) == [10, 10, 10]
    pipes = [p.route for p in sched.paths]
    assert len({v for r in pipes for v in r}) == 9  # disjoint pipelines


def test_aligned_pipelines_use_fast_links():
    # nodes 0,1 data; 2,3 stage 1; links fast only 0-3 and 1-2
    n = 4
    link = [[5.0] * n for _ in range(n)]
    for u, v in ((0, 3), (1, 2)):
        link[u][v] = link[v][u] = 0.1
    for v in range(n):
        link[v][v] = 0.0
    from scheduler.cost import CostMatrix

    pipes = aligned_pipelines(((0, 1), (2, 3)), CostMatrix((1.0,) * n, tuple(map(tuple, link))))
    assert sorted(pipes) == [(0, 3), (1, 2)]


def test_random_skip_valid_and_seeded(geo_cost):
    a = random_skip(GEO_STAGES, geo_cost, 4, 6, 3, seed=1)
    validate_schedule(a, microbatches_per_data_node=6)
    assert a.to_json() == random_skip(GEO_STAGES, geo_cost, 4, 6, 3, seed=1).to_json()


def _fixtures(geo_profile):
    geo = build_cost(nodes_round_robin(geo_profile, 20), geo_profile)
    yield "geo-20", GEO_STAGES, geo, 4
    clusters = ["LA", "NL", "Germany", "Singapore", "Oregon"]
    c5 = build_cost(nodes_round_robin(geo_profile, 20, locations=[clusters[i % 5] for i in range(20)]), geo_profile)
    yield "5-clusters-20", allocate(c5, [5, 3, 3, 3, 3, 3], seed=0).stages, c5, 4
    yield "geo-18-skip25", allocate(build_cost(nodes_round_robin(geo_profile, 18), geo_profile), [6, 4, 4, 4], seed=0).stages, \
        build_cost(nodes_round_robin(geo_profile, 18), geo_profile), 3


def test_baselines_never_beat_optimiser(geo_profile):
    for name, stages, cost, L in _fixtures(geo_profile):
        cmp = compare_variants(stages, cost, L, 6, 3, seed=0, budget_s=60, max_iterations=400)
        sp = cmp.time_s("skippipe")
        for other in ("full_pipeline", "random_skip", "skippipe_no_tc2"):
            assert sp <= cmp.time_s(other) + 1e-9, (name, other, sp, cmp.time_s(other))
        assert cmp.ratio("skippipe") < 0.6, name  # skipping a third/quarter of the stages pays
