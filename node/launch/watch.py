"""Watching a local swarm of daemons: who died, how far training got, whether it stalled.

:class:`DeathWatch` reports dead daemons once each (a death is news, not the end, while every stage still has a
live replica); :class:`TrainingWatch` follows a training run through the nodes' ``training`` RPC and says when it
is over, and why it must be given up (a stage without a replica, a node in error, no start, a stall).
``skippipe up`` runs one; ``skippipe swarm local`` runs the death watch alone.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from node.errors import UserError
from node.launch.process_swarm import training_state

__all__ = ["DeathWatch", "TrainingWatch", "FULL_CHECK_S"]

#: Seconds between two polls of every node (in between, only the data nodes are asked: they report progress)
FULL_CHECK_S = 5.0


class DeathWatch:
    """Dead daemons of a local swarm, reported once each, as the swarm itself treats them: a death
    is news, not the end, while every stage still has a live replica (the coordinator issues an
    epoch without the dead node and training goes on)."""

    def __init__(self, swarm, stream=None):
        self.swarm, self._stream = swarm, stream
        self.dead: Dict[int, str] = {}

    @property
    def stream(self):
        """The given stream, or the process's stderr *now* (a default bound at import time outlives a
        replaced stderr, e.g. pytest's per-test capture, and printing to it raises)."""
        return self._stream if self._stream is not None else sys.stderr

    def check(self) -> List[int]:
        """Report nodes that died since the last call; returns the stages left without a live replica."""
        for node in self.swarm.nodes:
            if node.index not in self.dead and node.proc is not None and not node.alive:
                self.dead[node.index] = self.swarm.last_error(node)
                code = node.proc.poll()
                print(f"node {node.index} (stage {node.stage}) died (exit code {code}); the others go on while "
                      f"every stage has a live replica (its last log line: {self.dead[node.index]})",
                      file=self.stream, flush=True)
        return self.orphaned_stages()

    def orphaned_stages(self) -> List[int]:
        stages = sorted({n.stage for n in self.swarm.nodes if n.stage >= 0})
        return [k for k in stages if not any(n.alive for n in self.swarm.nodes if n.stage == k)]

    def alive(self) -> list:
        return [n for n in self.swarm.nodes if n.index not in self.dead and n.alive]


@dataclass
class TrainingWatch:
    """Follows the training of a started :class:`node.launch.process_swarm.ProcessSwarm` until every live node
    is done. Progress (the iterations' statistics) comes from one live data node, the *lead*; the others are
    asked every :data:`FULL_CHECK_S` seconds. :meth:`poll` raises :class:`UserError` when the run cannot finish."""

    swarm: object
    start_timeout_s: float
    stall_timeout_s: float
    logs: str  # where the user finds the daemons' logs (named in the errors)
    on_iteration: Callable[[dict], None] = lambda h: None
    stream: object = None  # None: the process's stderr at the time of printing
    history: List[dict] = field(default_factory=list)
    states: Dict[int, dict] = field(default_factory=dict)
    first: Optional[int] = None  # the iteration the run started (or resumed) at
    t_first: Optional[float] = None  # perf_counter of the first committed iteration

    def __post_init__(self):
        self.deaths = DeathWatch(self.swarm, stream=self.stream)
        self.lead = next(n for n in self.swarm.nodes if n.stage == 0)
        self._last_progress = time.monotonic()
        self._last_full_check = 0.0

    def poll(self) -> bool:
        """One look at the swarm; True when every live node is done."""
        deaths = self.deaths
        orphaned = deaths.check()
        if orphaned:
            raise UserError(f"stage(s) {orphaned} have no live replica left (dead nodes: "
                            f"{sorted(deaths.dead)}): the run cannot finish; continue it with --resume")
        alive = deaths.alive()
        data_nodes = [n for n in alive if n.stage == 0]
        for idx in deaths.dead:
            self.states.pop(idx, None)
        if self.lead.index in deaths.dead:  # progress comes from another data node from now on
            self.lead = data_nodes[0]
        self._ask(alive, data_nodes)
        for idx, st in self.states.items():
            if st.get("state") == "error":
                raise UserError(f"training failed on node {idx}: {st.get('error')}")
        self._take_progress()
        if all(self.states.get(n.index, {}).get("state") == "done" for n in alive):
            return True
        if all(self.states.get(n.index, {}).get("state") == "done" for n in data_nodes):
            self._last_full_check = 0.0  # the others finish the same iteration: ask them at once
        self._check_stall()
        return False

    def _ask(self, alive: list, data_nodes: list) -> None:
        check_all = time.monotonic() - self._last_full_check > FULL_CHECK_S
        for node in (alive if check_all else data_nodes):
            if node is self.lead:
                st = training_state(node, since=self.history[-1]["iteration"] if self.history else -1)
            else:
                st = training_state(node, limit=1)
            if st is not None:  # a busy node answers next time
                self.states[node.index] = st
        if check_all:
            self._last_full_check = time.monotonic()

    def _take_progress(self) -> None:
        lead_state = self.states.get(self.lead.index, {})
        if self.first is None and lead_state.get("start_iteration") is not None:
            self.first = int(lead_state["start_iteration"])
        for h in lead_state.get("history", []):
            if not self.history or h["iteration"] > self.history[-1]["iteration"]:
                self.history.append(h)
                self._last_progress = time.monotonic()
                self.t_first = self.t_first or time.perf_counter()
                self.on_iteration(h)
        lead_state["history"] = []

    def _check_stall(self) -> None:
        waited = time.monotonic() - self._last_progress
        if not self.history and waited > self.start_timeout_s:
            raise UserError(f"training did not start within {self.start_timeout_s:.0f} s "
                            f"(states: {self.state_line()}); see the logs in {self.logs}")
        if self.history and waited > self.stall_timeout_s:
            raise UserError(f"training stalled at iteration {self.history[-1]['iteration'] + 1}: no progress for "
                            f"{waited:.0f} s (states: {self.state_line()}); logs in {self.logs}")

    def state_line(self) -> str:
        parts = []
        for n in self.swarm.nodes:
            st = self.states.get(n.index)
            parts.append(f"node{n.index}=" + (f"{st.get('state')}@{st.get('committed_iteration')}" if st else "?"))
        return " ".join(parts)
