"""The 20-node plan, pinned bit for bit.

Allocation and path search are deterministic per seed, and the work that makes them fast (the
simulator's queues and events, the stage-order scoring on replica classes, the allocation score's
pair cache) must not change what they choose. The digests below were recorded from the code before
that work; a change that alters the search on purpose records them again (run this file's
``_digests`` and paste what it prints).
"""

import hashlib
import random

from scheduler.allocation import allocate
from scheduler.cost import CostMatrix
from scheduler.paths import search_paths
from scheduler.simulator import simulate_routes

from .conftest import GEO_STAGES, uniform_cost

#: repr of ``allocate(geo 20 nodes, [5, 3, 3, 3, 3, 3], seed 0).score``
ALLOCATION_SCORE = "8.180539384985448"
#: the path search's report: best construction, result (simulated s per iteration), steps
SEARCH_TIMES = ("69.56076636266371", "65.99638581126781", 1500)
#: sha256 (first 16 hex digits) of every route of the result and of the collision-blind schedule, in dispatch order
SEARCH_ROUTES = "3f47e33ce97c5513"
#: sha256 of the results of 120 simulations of seeded random routes (ties, shared links, gaps, timelines)
SIMULATIONS = "bf5a626df1180b9a"


def _digest(x) -> str:
    return hashlib.sha256(repr(x).encode()).hexdigest()[:16]


def _random_simulations() -> str:
    """Equal compute and link times make many events coincide, so the tie rules are exercised."""
    rng = random.Random(7)
    costs = [uniform_cost(12, 1.0, 1.0),
             CostMatrix(tuple(rng.choice([0.5, 1.0, 2.0]) for _ in range(12)),
                        tuple(tuple(0.0 if u == v else rng.choice([0.0, 0.5, 1.0]) for v in range(12)) for u in range(12)),
                        2.0, 0.5)]
    out = []
    for cost in costs:
        for _ in range(30):
            L = rng.randint(1, 5)
            routes = {d: [tuple([d] + rng.sample(range(3, 12), L - 1)) for _ in range(rng.randint(0, 7))] for d in range(3)}
            busy = tuple(tuple(x * rng.random() for x in row) for row in cost.link_s)
            for link_busy_s, gap in ((None, 0.0), (busy, 0.1)):
                r = simulate_routes(routes, cost, rng.randint(1, 4), record_timelines=True, task_gap_s=gap,
                                    link_busy_s=link_busy_s)
                out.append((repr(r.iteration_time_s), sorted((d, repr(t)) for d, t in r.finish_s.items()),
                            [repr(x) for x in r.busy_s], r.deadlock,
                            [[(repr(k.start_s), repr(k.end_s), k.kind, k.data_node, k.index) for k in tl] for tl in r.timelines]))
    return _digest(out)


def _digests(geo_cost) -> tuple:
    alloc = allocate(geo_cost, [5, 3, 3, 3, 3, 3], 0)
    found = search_paths(GEO_STAGES, geo_cost, 4, 6, 3, 0)
    rep = found.report
    routes = _digest((sorted(found.schedule.dispatch_order().items()), sorted(found.blind.dispatch_order().items())))
    return (alloc.stages, repr(alloc.score), (repr(rep.initial_time_s), repr(rep.final_time_s), rep.iterations), routes,
            _random_simulations())


def test_allocation_search_and_simulator_give_the_recorded_results(geo_cost):
    stages, score, times, routes, sims = _digests(geo_cost)
    assert stages == GEO_STAGES
    assert score == ALLOCATION_SCORE
    assert times == SEARCH_TIMES
    assert routes == SEARCH_ROUTES
    assert sims == SIMULATIONS
