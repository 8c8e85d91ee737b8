import json
import math

import pytest

from scheduler.cost import (
    GIB,
    CostMatrix,
    CostParams,
    LinkProfile,
    ModelShape,
    activation_bytes,
    build_cost,
    cost_from_measurements,
    nodes_round_robin,
    transfer_time_s,
)
from scheduler.errors import ScheduleError


def test_profile_loads_all_pairs(geo_profile):
    assert len(geo_profile.locations) == 12
    assert geo_profile.link("Belgium", "Germany") == geo_profile.link("Germany", "Belgium")
    assert geo_profile.link("LA", "LA").latency_ms == 1.0


def test_round_robin_and_explicit_locations(geo_profile):
    nodes = nodes_round_robin(geo_profile, 14)
    assert nodes[12].location == geo_profile.locations[0]
    assert nodes[13].location == geo_profile.locations[1]
    nodes = nodes_round_robin(geo_profile, 2, locations=["Japan", "Japan"])
    assert [n.location for n in nodes] == ["Japan", "Japan"]
    with pytest.raises(ScheduleError, match="unknown locations"):
        nodes_round_robin(geo_profile, 1, locations=["Mars"])


def test_build_cost_matches_hand_computation(geo_profile):
    nodes = nodes_round_robin(geo_profile, 13)
    shape = ModelShape(layers_per_stage=4, d_model=1024, seq_len=1024, samples_per_microbatch=8, bytes_per_element=4)
    cost = build_cost(nodes, geo_profile, shape, CostParams(hop_overhead_s=0.35))
    assert cost.compute_s[0] == pytest.approx(0.055 * 4 * 8)
    assert cost.backward_s(0) == pytest.approx(1.5 * 1.76)
    assert cost.loss_s(0) == pytest.approx(0.25 * 1.76)
    lk = geo_profile.link("Australia", "Belgium")
    nbytes = 4 * 1024 * 1024 * 8
    assert activation_bytes(shape) == nbytes
    assert cost.link_s[0][1] == pytest.approx(lk.latency_ms / 1000 + nbytes / (lk.bandwidth_GiBps * GIB) + 0.35)
    # node 12 shares Australia with node 0: same-location link
    assert cost.link_s[0][12] == pytest.approx(0.001 + nbytes / (2.0 * GIB) + 0.35)
    assert cost.link_s[3][3] == 0.0


def test_measurements_and_transfer_time():
    c = cost_from_measurements([0.1, 0.2], [[0, 10], [20, 0]], [[1, 1e6], [2e6, 1]], ModelShape(1, 1, 1, 1, 1), CostParams(hop_overhead_s=0.0))
    assert c.compute_s == (0.1, 0.2)
    assert c.link_s[0][1] == pytest.approx(0.01 + 1e-6)
    assert c.link_s[1][0] == pytest.approx(0.02 + 0.5e-6)
    with pytest.raises(ScheduleError):
        transfer_time_s(1, 0, 10)


def test_cost_matrix_rejects_bad_shapes_and_values():
    with pytest.raises(ScheduleError, match="cost"):
        CostMatrix((1.0, 1.0), ((0.0, 1.0),))
    with pytest.raises(ScheduleError, match="finite"):
        CostMatrix((math.nan,), ((0.0,),))
    with pytest.raises(ScheduleError, match=">= 0"):
        CostMatrix((1.0, 1.0), ((0.0, -1.0), (1.0, 0.0)))


def test_profile_errors(tmp_path):
    with pytest.raises(ScheduleError, match="cannot read"):
        LinkProfile.load(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ScheduleError, match="not valid JSON"):
        LinkProfile.load(str(bad))
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"locations": ["A", "B", "C"], "links": {"A-B": {"latency_ms": 1, "bandwidth_GiBps": 1}}}))
    with pytest.raises(ScheduleError, match="no link between"):
        LinkProfile.load(str(partial))


def test_per_location_compute():
    p = LinkProfile.from_dict(
        {"locations": ["A", "B"], "links": {"A-B": {"latency_ms": 1, "bandwidth_GiBps": 1}},
         "compute_s_per_sample_per_layer": {"A": 0.1}, "default_compute_s_per_sample_per_layer": 0.3}
    )
    c = build_cost(nodes_round_robin(p, 2), p, ModelShape(2, 8, 8, 3, 4))
    assert c.compute_s == pytest.approx((0.1 * 2 * 3, 0.3 * 2 * 3))
