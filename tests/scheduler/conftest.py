"""Shared fixtures: the reference's 20-node geo-distributed setting and small hand-made costs."""

from __future__ import annotations

import os

import pytest

from scheduler.cost import CostMatrix, LinkProfile, build_cost, nodes_round_robin

PROFILE = os.environ.get("SKIPPIPE_GEO_PROFILE", "/work/shared/profiles/geo-distributed-12.json")
if not os.path.exists(PROFILE):  # the repo copy, if the shared one is not mounted
    PROFILE = os.path.join(os.path.dirname(__file__), "data", "geo-distributed-12.json")

#: An allocation of the 20 geo nodes (what ``allocate(cost, [5,3,3,3,3,3], seed=0)`` gave).
GEO_STAGES = ((12, 14, 15, 18, 19), (2, 5, 8), (0, 7, 16), (1, 9, 11), (3, 6, 10), (4, 13, 17))


@pytest.fixture(scope="session")
def geo_profile() -> LinkProfile:
    return LinkProfile.load(PROFILE)


@pytest.fixture(scope="session")
def geo_cost(geo_profile) -> CostMatrix:
    return build_cost(nodes_round_robin(geo_profile, 20), geo_profile)


def uniform_cost(n: int, compute: float = 1.0, link: float = 0.0) -> CostMatrix:
    return CostMatrix((compute,) * n, tuple(tuple(0.0 if u == v else link for v in range(n)) for u in range(n)))
