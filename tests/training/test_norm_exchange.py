"""The per-iteration norm exchange (node.train.commit): direct NormReports first, the DHT only as a
fallback, and the same numbers either way. A fake node stands in for the trainer (no network)."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest

import node.train.commit as commit_mod
from node.net.records import NormRecord
from node.train.commit import IterationCommit, global_squared_norm, norm_report, record_of_report
from node.train.common import IterationState, TrainerConfig
from node.train.progress import StageResources

RUN = "norm-test"
ME, A, B = "peer-a0", "peer-b1", "peer-c2"
MEMBERS = (ME, A, B)


class FakeNode:
    def __init__(self, cfg, members=MEMBERS, dead=()):
        self.cfg, self.node_name, self.peer_id = cfg, "fake", ME
        self.members, self.data_node_peers = members, [A]
        self.epoch = SimpleNamespace(epoch=2)
        self.committed_iteration, self.current_iteration = 4, 5
        self.dht = object()
        self.dataplane = object()
        self.sent = []
        self.suspected = []
        dead = set(dead)
        self.unreachable = set()  # peers no connection can reach (both behind NAT)
        self.health = SimpleNamespace(is_alive=lambda p: p not in dead, reaches=lambda p: p not in self.unreachable,
                                      suspect=lambda p, why: self.suspected.append(p))
        self.pipeline = SimpleNamespace(send_control=lambda peer, msg: self.sent.append((peer, msg)))
        self.epochs = SimpleNamespace(to_announce=lambda it: [], learn=lambda records: list(records),
                                      knows=lambda n: True)
        self.checked = 0

    def check_done(self, st):
        self.checked += 1


def commit_for(node: FakeNode) -> IterationCommit:
    """An IterationCommit given the fake's parts, as the trainer gives it its own."""
    epochs = SimpleNamespace(members=node.members, data_node_peers=node.data_node_peers, epoch=node.epoch, stage=0,
                             to_announce=node.epochs.to_announce, learn=node.epochs.learn, knows=node.epochs.knows)
    progress = SimpleNamespace(committed=node.committed_iteration, current=node.current_iteration, history=[],
                               check_done=node.check_done)
    sender = SimpleNamespace(send_control=node.pipeline.send_control, dataplane=node.dataplane)

    async def compute(fn, *args):
        return fn(*args)

    return IterationCommit(node.cfg, peer_id=node.peer_id, node_name=node.node_name, epochs=epochs, progress=progress,
                           health=node.health, resources=StageResources(runtime=getattr(node, "runtime", None)),
                           sender=sender, compute=compute, expected_state=lambda: None, dht=node.dht,
                           emulation=getattr(node, "emulation", None))


def _record(stage, sq, epoch=2, **kw):
    return NormRecord(stage=stage, sq=sq, checksum=float(stage), epoch=epoch, loss_sum=1.5 * (stage + 1), n_mb=2, **kw)


@pytest.fixture
def dht(monkeypatch):
    """Our writes, and the records a DHT read returns (mutable)."""
    state = SimpleNamespace(writes=[], records=None, reads=0)

    async def write(dht, run_id, it, peer, record, ttl_s):
        state.writes.append((it, peer, record))

    async def read(dht, run_id, it, members=None):
        state.reads += 1
        return state.records

    monkeypatch.setattr(commit_mod, "write_norm_record", write)
    monkeypatch.setattr(commit_mod, "read_norm_records", read)
    return state


def test_report_and_record_carry_the_same_numbers():
    rec = _record(3, 0.25, tokens=7, dropped=1, avg_group=("x", "y"), epochs=(b"e",))
    msg = norm_report(RUN, 9, ME, rec)
    assert (msg.run_id, msg.iteration, msg.peer_id) == (RUN, 9, ME)
    assert record_of_report(msg) == rec
    poisoned = record_of_report(norm_report(RUN, 9, ME, _record(1, math.inf)))
    assert poisoned.sq == math.inf


def test_direct_reports_end_the_barrier_without_reading_the_dht(dht):
    cfg = TrainerConfig(run_id=RUN, norm_direct_grace_s=60.0)
    node = FakeNode(cfg)
    c = commit_for(node)
    mine, theirs = _record(0, 1.0), {A: _record(1, 4.0), B: _record(1, 9.0)}

    async def main():
        task = asyncio.create_task(c._exchange_norms(5, mine))
        await asyncio.sleep(0.05)
        for peer, rec in theirs.items():
            c.on_norm_report(norm_report(RUN, 5, peer, rec), peer)
        return await asyncio.wait_for(task, 30)

    got = asyncio.run(main())
    assert got == {ME: mine, **theirs}
    assert dht.reads == 0 and c.norms_from_dht == 0
    assert [w[:2] for w in dht.writes] == [(5, ME)]  # the DHT record is still written
    assert sorted(p for p, _ in node.sent) == [A, B]
    assert all(record_of_report(m) == mine and m.iteration == 5 for _, m in node.sent)
    assert global_squared_norm(got) == 1.0 + 4.0  # stage 1: the lower median of its reports
    assert c._reports == {}  # forgotten once the iteration is through


def test_a_missing_report_is_read_from_the_dht_after_the_grace(dht):
    cfg = TrainerConfig(run_id=RUN, norm_direct_grace_s=0.05, norm_poll_s=0.01)
    node = FakeNode(cfg)
    c = commit_for(node)
    mine, a, b = _record(0, 1.0), _record(1, 4.0), _record(2, 2.0)
    dht.records = {ME: mine, A: a, B: b, "outsider": _record(2, 100.0)}

    async def main():
        task = asyncio.create_task(c._exchange_norms(5, mine))
        c.on_norm_report(norm_report(RUN, 5, A, a), A)
        return await asyncio.wait_for(task, 30)

    got = asyncio.run(main())
    assert got == {ME: mine, A: a, B: b}  # the outsider's DHT record is left out
    assert dht.reads >= 1 and c.norms_from_dht == 1


def test_a_member_no_connection_can_reach_is_read_from_the_dht_at_once(dht):
    """Two nodes behind NAT with no relay cannot exchange reports: none is sent (a send would only fail and
    blame the peer), and its numbers are read from the DHT without waiting out the direct grace."""
    cfg = TrainerConfig(run_id=RUN, norm_direct_grace_s=60.0, norm_poll_s=0.01)
    node = FakeNode(cfg)
    node.unreachable.add(B)
    c = commit_for(node)
    mine, a, b = _record(0, 1.0), _record(1, 4.0), _record(2, 2.0)
    dht.records = {ME: mine, A: a, B: b}

    async def main():
        task = asyncio.create_task(c._exchange_norms(5, mine))
        c.on_norm_report(norm_report(RUN, 5, A, a), A)
        return await asyncio.wait_for(task, 5)  # far inside the 60 s grace

    got = asyncio.run(main())
    assert got == {ME: mine, A: a, B: b} and c.norms_from_dht == 1
    assert [p for p, _ in node.sent] == [A] and node.suspected == []


def test_same_result_direct_or_from_the_dht(dht):
    """The global norm, clip and everything else come out the same whichever way the numbers came."""
    records = {ME: _record(0, 1.0), A: _record(1, 4.0), B: _record(1, 9.0, epoch=3)}

    def exchange(direct: bool):
        cfg = TrainerConfig(run_id=RUN, norm_direct_grace_s=60.0 if direct else 0.0, norm_poll_s=0.01)
        c = commit_for(FakeNode(cfg))
        dht.records = None if direct else dict(records)

        async def main():
            task = asyncio.create_task(c._exchange_norms(5, records[ME]))
            if direct:
                for p in (A, B):
                    c.on_norm_report(norm_report(RUN, 5, p, records[p]), p)
            return await asyncio.wait_for(task, 30)

        return asyncio.run(main())

    via_direct, via_dht = exchange(True), exchange(False)
    assert via_direct == via_dht == {ME: records[ME], A: records[A]}  # B's other epoch is left out both ways
    assert global_squared_norm(via_direct) == global_squared_norm(via_dht) == 5.0


def test_dead_members_are_not_waited_for_and_silent_ones_time_out(dht):
    cfg = TrainerConfig(run_id=RUN, norm_direct_grace_s=0.0, norm_poll_s=0.01, norm_exchange_timeout_s=0.2)
    node = FakeNode(cfg, dead={B})
    c = commit_for(node)
    mine = _record(0, 1.0)
    got = asyncio.run(asyncio.wait_for(c._exchange_norms(5, mine), 30))
    assert got == {ME: mine} and node.suspected == [A]
    assert [p for p, _ in node.sent] == [A]  # no report to a dead member


def test_reports_outside_the_window_or_of_another_run_are_ignored():
    node = FakeNode(TrainerConfig(run_id=RUN))
    c = commit_for(node)
    c.on_norm_report(norm_report(RUN, 4, A, _record(1, 1.0)), A)  # committed already
    c.on_norm_report(norm_report(RUN, 7, A, _record(1, 1.0)), A)  # too far ahead
    c.on_norm_report(norm_report("other", 5, A, _record(1, 1.0)), A)
    c.on_norm_report(norm_report(RUN, 5, A, _record(1, 1.0)), B)  # in another member's name
    assert c._reports == {}
    c.on_norm_report(norm_report(RUN, 6, A, _record(1, 1.0)), A)
    assert c.direct_records(6) == {A: _record(1, 1.0)}


def test_a_data_nodes_direct_report_stands_in_for_its_iteration_done(dht):
    node = FakeNode(TrainerConfig(run_id=RUN, done_poll_s=0.0))
    c = commit_for(node)
    st = IterationState()
    c.on_norm_report(norm_report(RUN, 5, A, _record(0, 1.0, dropped=2)), A)
    asyncio.run(c.maybe_done_from_norms(5, st, 0.0))
    assert st.done[A].dropped == 2 and node.checked == 1
    assert dht.reads == 0  # the report sufficed


def test_averaging_is_padded_to_the_emulated_allreduce_time():
    import torch

    from node.dataplane.emulation import LinkSpec

    fast, slow = LinkSpec(0.01, 1e6), LinkSpec(0.05, 1e5)
    links = {frozenset((ME, A)): fast, frozenset((ME, B)): slow, frozenset((A, B)): fast}
    emulation = SimpleNamespace(link_emulator=object(), link_between=lambda a, b, me: links[frozenset((a, b))])
    node = FakeNode(TrainerConfig(run_id=RUN))
    node.runtime = SimpleNamespace(grads=lambda: [torch.zeros(1000), torch.zeros(250), None])  # 5000 bytes
    node.emulation = emulation
    c = commit_for(node)
    assert c.emulated_allreduce_s([ME]) == 0.0
    assert c.emulated_allreduce_s([ME, A]) == pytest.approx(5000 / 1e6 + 0.02)
    # three replicas: the slow link to B decides
    assert c.emulated_allreduce_s([ME, A, B]) == pytest.approx(2 * 2 / 3 * 5000 / 1e5 + 0.1)
    asyncio.run(c._pad_averaging([ME, A], 0.0))
    assert c.averaging_padded_s == pytest.approx(0.025) and c.averaging_overrun_s == 0.0
    asyncio.run(c._pad_averaging([ME, A], 1.0))
    assert c.averaging_overrun_s == pytest.approx(1.0 - 0.025)
    c.emulation = SimpleNamespace(link_emulator=None)  # no link emulation: no padding
    assert c.emulated_allreduce_s([ME, A, B]) == 0.0
