"""Polling helpers for elasticity and chaos tests on real ``skippipe node run --train`` daemons."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Callable, Dict, Iterable

from node.launch.process_swarm import ProcessSwarm, training_state
from node.spec import TrainSpec

__all__ = ["training_state", "wait_for", "train_args", "assert_each_step_committed_once",
           "assert_no_step_missed_or_repeated", "RUN_UNTIL_STOPPED"]

#: ``--iterations`` of a run the test stops itself once it has seen what it checks: a fixed length races
#: whatever the test waits for mid-run (a re-plan, a move, a join), and CI's box is slower than any margin.
RUN_UNTIL_STOPPED = 100000


def wait_for(swarm: ProcessSwarm, nodes: Iterable[int], predicate: Callable[[dict], bool], timeout: float,
             what: str, poll_s: float = 1.0, state_of: Callable = None, fail_on_error: bool = True) -> Dict[int, dict]:
    """Poll until ``predicate(state)`` holds for every node index in ``nodes``; fail on a training
    error or a node that exits (with its last log line), or after ``timeout`` seconds.

    ``state_of(node)`` reads a node's ``training`` RPC (default :func:`training_state`; a swarm whose
    nodes live in network namespaces passes its own)."""
    state_of = state_of or (lambda node: training_state(node, limit=1000))
    want = list(nodes)
    deadline = time.monotonic() + timeout
    states: Dict[int, dict] = {}
    while True:
        for i in want:
            node = swarm.nodes[i]
            assert node.alive, f"node {i} exited while waiting for {what}: {swarm.last_error(node)}"
            s = state_of(node)
            if s is not None:
                states[i] = s
                assert not fail_on_error or s.get("state") != "error", f"node {i} failed: {s.get('error')}"
        if len(states) == len(want) and all(predicate(states[i]) for i in want):
            # on stderr: pytest shows it with a failure, so a slow step stands out in CI's output
            print(f"{time.strftime('%H:%M:%S')} waited {timeout - (deadline - time.monotonic()):.1f} s for {what}",
                  file=sys.stderr, flush=True)
            return states
        if time.monotonic() > deadline:
            summary = {i: (s.get("state"), s.get("committed_iteration"), s.get("epoch")) for i, s in states.items()}
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; states: {summary}")
        time.sleep(poll_s)


#: The run of the daemon tests (tiny model, one torch thread, no checkpoints, waits a loaded CI box keeps).
TEST_RUN = TrainSpec(train=True, threads=1, microbatches=2, microbatch_size=4, checkpoint_every=0,
                     iteration_timeout=240.0, agreement_timeout=300.0)


def train_args(iterations: int, min_members: int, *extra: str) -> list:
    """``--train`` flags shared by the daemon tests: :data:`TEST_RUN` for ``iterations`` with ``min_members``,
    then ``extra``."""
    run = replace(TEST_RUN, iterations=iterations, min_members=min_members)
    return [*run.to_argv(), "--log-level", "INFO", *extra]



def assert_each_step_committed_once(done: Dict[int, dict], data_nodes: Iterable[int], survivors: Iterable[int],
                                    iterations: int, context: str = "") -> None:
    """Every step committed, none twice: by the data nodes together (one may have been left out of an
    epoch for a while by a view that lost it under load, and re-joined), each in increasing order; every
    survivor's history ends at the last iteration."""
    data_nodes, survivors = list(data_nodes), list(survivors)
    assert_no_step_missed_or_repeated(done, data_nodes, survivors, context)
    committed = max(h["iteration"] for i in data_nodes for h in done[i]["history"])
    assert committed == iterations - 1, f"steps never committed: {set(range(committed + 1, iterations))}; {context}"
    for i in survivors:
        its = [h["iteration"] for h in done[i]["history"]]
        assert its[-1] == iterations - 1, (i, its, context)


def assert_no_step_missed_or_repeated(states: Dict[int, dict], data_nodes: Iterable[int], survivors: Iterable[int],
                                      context: str = "") -> None:
    """For a run stopped mid-way: the data nodes together committed every step up to the last one any of
    them committed, none twice, each in increasing order; every survivor trained, in increasing order with
    no repeat."""
    committed: set = set()
    for i in data_nodes:
        its = [h["iteration"] for h in states[i]["history"]]
        assert its == sorted(set(its)), f"data node {i} committed {its}; {context}"
        committed |= set(its)
    assert committed and committed == set(range(max(committed) + 1)), \
        f"steps never committed: {set(range(max(committed, default=0) + 1)) - committed}; {context}"
    for i in survivors:
        its = [h["iteration"] for h in states[i]["history"]]
        assert its and its == sorted(set(its)), (i, its, context)
