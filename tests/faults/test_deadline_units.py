"""Microbatch deadlines see the links microbatches really cross (pure units, no network).

Under WAN emulation the measured links run over loopback, so deadlines built from them expire on
healthy emulated hops (a 20-daemon random-skip run dropped one microbatch per iteration that way);
and a schedule whose routes collide on a slow link takes longer than an unshared-link simulation says.
"""

import pytest

from node.train.deadlines import HopDeadlines
from node.dataplane.emulation import Emulation
from node.train.timing import deadline_links
from scheduler.cost import LinkProfile

PROFILE = LinkProfile.from_dict({
    "name": "two", "locations": ["A", "B"], "same_location": {"latency_ms": 0.0, "bandwidth_GiBps": 10.0},
    "links": {"A-B": {"latency_ms": 200.0, "bandwidth_GiBps": 1e-4}},
})


def test_deadline_links_are_the_emulated_ones_when_links_are_emulated():
    emu = Emulation.for_node(profile=PROFILE, location="A", peer_locations={"p": "B", "q": "A"})
    loopback = lambda a, b: (0.0001, 1e9)  # noqa: E731 - what a link probe over 127.0.0.1 measures
    links = deadline_links(emu, loopback, "me")
    lat, bw = links("me", "p")  # this node (at A) to a peer at B
    assert lat == pytest.approx(0.2) and bw == pytest.approx(1e-4 * 2**30)
    assert links("q", "p")[0] == pytest.approx(0.2)  # any two peers, not only this node's links
    assert links("me", "stranger") == (0.0001, 1e9)  # no known location: the measured link
    plain = deadline_links(None, loopback, "me")
    assert plain is loopback


def test_makespan_queues_transfers_that_share_a_link():
    # one data node, two microbatches over one slow link: the second waits for the first's bytes
    schedule = {"stages": [[0], [1]], "path_length": 2, "memory": 2,
                "paths": [{"data_node": 0, "route": [0, 1], "microbatches": 2}]}
    act = 1_000_000
    link = lambda a, b: (0.0, 1e6)  # noqa: E731 - 1 s per activation on the link
    d = HopDeadlines(schedule, ["d", "p"], [0.1, 0.1], act, link)
    # forward: mb0 leaves at 0.1 and arrives 1.1; mb1 leaves at 0.2 but the link is busy until 1.1 -> 2.1
    # unshared, mb1 would arrive at 1.2 and the iteration end at 4.675 s; the gradients queue too
    assert d.makespan_s == pytest.approx(5.525)
    route = ["d", "p", "d"]
    assert d.microbatch_budget_s(route) >= d.cfg.slack * d.makespan_s
