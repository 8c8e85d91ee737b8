"""Where training stands on one node, kept in one place: the trainer's parts read it, and only the
trainer (at a commit), the commit (at a resync) and the stage state (at a resume or a join) move it.

Also the small holders the parts share instead of a reference to the trainer: what the trainer
builds for its stage at set-up (:class:`StageResources`) and its life (:class:`LifeView`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from node.train.common import IterationState, IterationStats, Lifecycle

__all__ = ["IterationProgress", "StageResources", "LifeView", "begun_elsewhere"]


def begun_elsewhere(iterations: Dict[int, IterationState], iteration: int, me: str) -> bool:
    """Has another data node already finished this iteration? Its view still held every stage when it
    began; pausing now would leave it waiting for our IterationDone, so this node runs the iteration too,
    skipping or dropping what it cannot route, and the next boundary pauses everyone alike."""
    state = iterations.get(iteration)
    return state is not None and any(peer != me for peer in state.done)


class IterationProgress:
    """The iteration this node runs, the last it committed, the one its weights belong to, and what it
    knows about the open iterations (who finished them)."""

    def __init__(self, data_nodes: Callable[[], List[str]], is_alive: Callable[[str], bool]):
        """``data_nodes()``: the data nodes of the current epoch; ``is_alive(peer)``: peer health."""
        self._data_nodes, self._is_alive = data_nodes, is_alive
        self.current = -1
        self.committed = -1
        #: the iteration the runtime's weights belong to (set on the compute thread)
        self.state_iteration = -1
        self.first = -1  # the first iteration this trainer ran
        self.history: List[IterationStats] = []
        self.iterations: Dict[int, IterationState] = {}

    def state(self, iteration: int) -> IterationState:
        if iteration not in self.iterations:
            self.iterations[iteration] = IterationState()
        return self.iterations[iteration]

    def open_state(self, iteration: int) -> Optional[IterationState]:
        return self.iterations.get(iteration)

    def on_iteration_done(self, msg) -> None:
        """A data node's ``IterationDone`` arrived (the caller checked its run)."""
        if msg.iteration <= self.committed:
            return
        st = self.state(msg.iteration)
        st.done[msg.data_node] = msg
        self.check_done(st)

    def check_done(self, st: IterationState) -> None:
        """Iteration over: every data node of the epoch reported, or is gone."""
        if all(p in st.done or not self._is_alive(p) for p in self._data_nodes()):
            st.all_done.set()

    def committed_at(self, iteration: int, stats: IterationStats) -> None:
        """Iteration ``iteration`` committed: the next one is current, the closed ones are forgotten."""
        self.committed = iteration
        self.current = iteration + 1
        for old in [k for k in self.iterations if k <= iteration]:
            del self.iterations[old]
        self.history.append(stats)

    def first_running(self) -> bool:
        """This trainer's first iteration is the current one (its deadlines are longer)."""
        return not (self.history or self.current != self.first)

    def begun_elsewhere(self, me: str) -> bool:
        return begun_elsewhere(self.iterations, self.current, me)


@dataclass
class StageResources:
    """What the trainer builds for its stage at set-up and rebuilds at an epoch switch: the parts read
    them here (a runtime, an averager, a data shard, hop deadlines), each None until built."""

    runtime: Optional[object] = None  # node.train.runtime.StageRuntime
    averager: Optional[object] = None  # node.train.averaging.StageAverager (None: no other replica)
    shard: Optional[object] = None  # node.train.data.DataShard (data nodes only)
    deadlines: Optional[object] = None  # node.train.deadlines.HopDeadlines


@dataclass
class LifeView:
    """The trainer's :class:`Lifecycle` as its parts see it (read-only), plus the one way to die."""

    read: Callable[[], Lifecycle]
    kill: Callable[[], None] = field(default=lambda: None)

    @property
    def killed(self) -> bool:
        return self.read() is Lifecycle.KILLED

    @property
    def closed(self) -> bool:
        """No new work: shut down or killed."""
        return self.read() in (Lifecycle.CLOSED, Lifecycle.KILLED)
