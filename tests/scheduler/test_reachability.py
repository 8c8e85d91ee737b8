"""Reachability in the cost model: relayed links cost more, links nobody can make are never on a path."""

import itertools

import pytest

from scheduler.cost import CostMatrix
from scheduler.errors import ScheduleError
from scheduler.paths import schedule_paths
from scheduler.reachability import (LinkKind, RelayParams, apply_reachability, check_reachable, choose_relays,
                                    impossible_hops, link_kind, relayed_hops)
from scheduler.schedule import PathEntry, Schedule

D, R, O, U = "direct", "relayed", "outbound_only", "unknown"


def test_link_kinds():
    assert link_kind(O, O) is LinkKind.IMPOSSIBLE
    assert link_kind(O, R) is LinkKind.RELAYED and link_kind(R, R) is LinkKind.RELAYED
    for a, b in itertools.product([D, U], [D, R, O, U]):
        assert link_kind(a, b) is LinkKind.DIRECT and link_kind(b, a) is LinkKind.DIRECT


def test_relayed_links_cost_more_and_impossible_ones_are_priced_out():
    cost = CostMatrix((1.0,) * 3, ((0, 2, 2), (2, 0, 2), (2, 2, 0)))
    params = RelayParams(relay_slowdown=3.0, relay_added_s=0.5, impossible_link_s=1e6)
    out = apply_reachability(cost, [O, O, R], params)
    assert out.link_s[0][1] == out.link_s[1][0] == 1e6
    assert out.link_s[0][2] == out.link_s[2][1] == 2 * 3.0 + 0.5
    assert out.compute_s == cost.compute_s
    assert apply_reachability(cost, [D, O, U]).link_s == cost.link_s
    with pytest.raises(ScheduleError):
        apply_reachability(cost, [D, D])


def _stages_and_cost(n_per_stage=(2, 2, 2, 2)):
    stages, v = [], 0
    for size in n_per_stage:
        stages.append(list(range(v, v + size)))
        v += size
    n = v
    # links to the NATed nodes (3, 5) are the *cheapest* on paper: a search blind to reachability would join them
    link = [[0.0 if a == b else (0.01 if {a, b} == {3, 5} else 0.2) for b in range(n)] for a in range(n)]
    return stages, CostMatrix((0.1,) * n, tuple(map(tuple, link)))


def test_a_real_schedule_never_joins_two_outbound_only_nodes():
    stages, cost = _stages_and_cost()
    reach = [D] * 8
    reach[3] = reach[5] = O  # a replica of stage 1 and one of stage 2, both behind NAT, no relay
    blind = schedule_paths(stages, cost, 4, 4, 4, seed=1)
    assert impossible_hops(blind, reach), "the check cannot fail: the blind schedule should join 3 and 5"
    aware = schedule_paths(stages, apply_reachability(cost, reach), 4, 4, 4, seed=1)
    check_reachable(aware, reach)
    assert any(3 in p.route for p in aware.paths) and any(5 in p.route for p in aware.paths), aware.paths


def test_check_reachable_names_the_hops():
    schedule = Schedule(stages=((0,), (1,), (2,)), path_length=3, memory=2,
                        paths=(PathEntry(data_node=0, route=(0, 1, 2), microbatches=1),))
    check_reachable(schedule, [O, D, D])  # every hop has a dialable end
    with pytest.raises(ScheduleError, match="reachability"):
        check_reachable(schedule, [O, O, D])
    assert impossible_hops(schedule, [O, D, O]) == [(2, 0)]


def test_a_relay_member_turns_impossible_links_into_relayed_ones():
    assert link_kind(O, O, relay=True) is LinkKind.RELAYED and link_kind(D, O, relay=True) is LinkKind.DIRECT
    cost = CostMatrix((1.0,) * 3, ((0, 2, 2), (2, 0, 2), (2, 2, 0)))
    params = RelayParams(relay_slowdown=3.0, relay_added_s=0.5, impossible_link_s=1e6)
    out = apply_reachability(cost, [O, O, D], params, relay=True)
    assert out.link_s[0][1] == out.link_s[1][0] == 2 * 3.0 + 0.5  # through the relay: slower, not impossible
    assert out.link_s[0][2] == 2  # a dialable end: direct, as before
    schedule = Schedule(stages=((0,), (1,), (2,)), path_length=3, memory=2,
                        paths=(PathEntry(data_node=2, route=(2, 0, 1), microbatches=1),))
    assert impossible_hops(schedule, [O, O, D]) == [(0, 1)]
    check_reachable(schedule, [O, O, D], relay=True)
    assert impossible_hops(schedule, [O, O, D], relay=True) == []
    assert relayed_hops(schedule, [O, O, D]) == [(0, 1)]


def test_a_schedule_with_a_relay_may_join_natted_nodes_only_when_it_pays():
    stages, cost = _stages_and_cost()
    reach = [D] * 8
    reach[3] = reach[5] = O
    cheap = schedule_paths(stages, apply_reachability(cost, reach, RelayParams(1.0, 0.0), relay=True), 4, 4, 4, seed=1)
    assert relayed_hops(cheap, reach), "a relay as cheap as the link: the search takes the 0.01 s link 3-5"
    check_reachable(cheap, reach, relay=True)
    dear = schedule_paths(stages, apply_reachability(cost, reach, RelayParams(100.0, 1.0), relay=True), 4, 4, 4, seed=1)
    assert relayed_hops(dear, reach) == [], dear.paths  # a dear relay: around it through the public replicas


def test_relays_are_chosen_by_peer_id_among_dialable_relaying_members():
    candidates = {"Qm3": (D, True), "Qm1": (O, True), "Qm2": (U, True), "Qm0": (D, False), "Qm4": (D, True)}
    assert choose_relays(candidates, "Qm9", 2) == ["Qm2", "Qm3"]  # a NATed one or a non-relay never
    assert choose_relays(candidates, "Qm2", 5) == ["Qm3", "Qm4"]  # never itself
    assert choose_relays(dict(reversed(list(candidates.items()))), "Qm9", 2) == ["Qm2", "Qm3"]  # order-free
    assert choose_relays({"Qm1": (O, True)}, "Qm9", 2) == []


def test_a_stage_whose_replicas_nobody_can_dial_gets_a_dialable_reducer():
    from scheduler.reachability import averaging_reducers

    out, d, relayed = O, D, R
    stage_of = {"a": 0, "b": 0, "n1": 1, "n2": 1, "n3": 2, "n4": 2, "p": 3, "n5": 3}
    reach = {"a": d, "b": d, "n1": out, "n2": out, "n3": out, "n4": out, "p": d, "n5": out}
    # stages 1 and 2 need one; stage 3 has a dialable replica (client mode suffices); spread over a, b, p
    assert averaging_reducers(stage_of, reach) == {1: "a", 2: "b"}
    # a single replica needs none, nor does a stage where a relay-reachable replica connects to the others
    assert averaging_reducers({"a": 0, "n1": 1}, {"a": d, "n1": out}) == {}
    assert averaging_reducers({"a": 0, "n1": 1, "n2": 1}, {"a": d, "n1": out, "n2": relayed}) == {}
    # nobody dialable: nothing to pick
    assert averaging_reducers({"n1": 1, "n2": 1}, {"n1": out, "n2": out}) == {}
    # deterministic whatever the mapping's order
    shuffled = dict(reversed(list(stage_of.items())))
    assert averaging_reducers(shuffled, reach) == averaging_reducers(stage_of, reach)
