"""Polling helpers for elasticity and chaos tests on real ``skippipe node run --train`` daemons."""

from __future__ import annotations

import time
from typing import Callable, Dict, Iterable

from node.testing.process_swarm import ProcessSwarm, training_state

__all__ = ["training_state", "wait_for", "train_args"]


def wait_for(swarm: ProcessSwarm, nodes: Iterable[int], predicate: Callable[[dict], bool], timeout: float,
             what: str, poll_s: float = 1.0) -> Dict[int, dict]:
    """Poll until ``predicate(state)`` holds for every node index in ``nodes``; fail on a training
    error or a node that exits (with its last log line), or after ``timeout`` seconds."""
    want = list(nodes)
    deadline = time.monotonic() + timeout
    states: Dict[int, dict] = {}
    while True:
        for i in want:
            node = swarm.nodes[i]
            assert node.alive, f"node {i} exited while waiting for {what}: {swarm.last_error(node)}"
            s = training_state(node, limit=1000)
            if s is not None:
                states[i] = s
                assert s.get("state") != "error", f"node {i} failed: {s.get('error')}"
        if len(states) == len(want) and all(predicate(states[i]) for i in want):
            return states
        if time.monotonic() > deadline:
            summary = {i: (s.get("state"), s.get("committed_iteration"), s.get("epoch")) for i, s in states.items()}
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; states: {summary}")
        time.sleep(poll_s)


def train_args(iterations: int, min_members: int, *extra: str) -> list:
    """``--train`` flags shared by the daemon tests (tiny model, one torch thread, bounded waits)."""
    return ["--train", "--iterations", str(iterations), "--min-members", str(min_members), "--threads", "1",
            "--microbatches", "2", "--microbatch-size", "4", "--checkpoint-every", "0",
            "--iteration-timeout", "240", "--agreement-timeout", "300", "--log-level", "INFO", *extra]

