"""Which schedule epoch a trainer applies at which iteration.

The host adopts epochs whenever the coordinator issues them; each names the iteration it starts at.
A trainer applies an epoch only at that boundary, so all members switch together; it remembers
epochs announced for later boundaries (a newer one may arrive before an older one starts, and every
member must still pass through the older one), tells the other members about them in its norm
records, and learns theirs the same way, so a member that missed an announcement still switches.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

from node.errors import UserError
from node.train.common import LeftSchedule, NodeLog, StageMoved
from scheduler.errors import ScheduleError
from scheduler.schedule import Schedule

__all__ = ["EpochTracker", "parse_schedule", "stage_index", "routes_for"]

logger = logging.getLogger(__name__)

EpochSource = Union["ScheduleEpoch", Callable[[], "ScheduleEpoch"]]  # noqa: F821


def parse_schedule(schedule: dict) -> Schedule:
    """The scheduler's JSON as a :class:`Schedule`, with the checks a trainer relies on (each node in
    one stage; each path starts at its data node and visits a stage at most once); ``memory`` and
    ``path_length`` default to 1 and the number of stages. Raises :class:`UserError`."""
    try:
        if isinstance(schedule, dict):
            schedule = dict(schedule)
            schedule.setdefault("memory", 1)
            schedule.setdefault("path_length", len(schedule.get("stages") or ()))
        plan = Schedule.from_json(schedule)
    except ScheduleError as e:
        raise UserError(f"malformed schedule: {e}") from None
    stage_of: Dict[int, int] = {}
    for s, nodes in enumerate(plan.stages):
        for n in nodes:
            if n in stage_of:
                raise UserError(f"schedule node {n} is in stages {stage_of[n]} and {s}")
            stage_of[n] = s
    for p in plan.paths:
        route = p.route
        if not route or route[0] != p.data_node or route[0] not in plan.data_nodes:
            raise UserError(f"schedule path {p.to_json()} does not start at its data node")
        if any(n not in stage_of for n in route) or any(stage_of[n] == 0 for n in route[1:]):
            raise UserError(f"schedule path {p.to_json()} visits an unknown node or stage 0 twice")
        if len({stage_of[n] for n in route}) != len(route):
            raise UserError(f"schedule path {p.to_json()} visits a stage more than once")
    return plan


def stage_index(plan: Schedule) -> Dict[int, int]:
    """Node index -> its stage."""
    return {n: s for s, nodes in enumerate(plan.stages) for n in nodes}


def routes_for(plan: Schedule, data_node: int) -> List[List[int]]:
    """One node-index route per microbatch of ``data_node``, in dispatch order."""
    return [list(r) for r in plan.dispatch_order().get(data_node, [])]


class EpochTracker:
    """The epoch a trainer trains on now, and the ones it knows are coming."""

    def __init__(self, peer_id: str, run_id: str, source: EpochSource, *,
                 verify: Optional[Callable[[object], bool]] = None, fetch=None, node_name: Optional[str] = None):
        """``source``: an epoch, or a callable returning the host's adopted one. ``verify(epoch)``: the
        signature check of epochs learnt from members' records (None: trust members). ``async fetch()``:
        the signed epochs stored in the DHT, for a node that fell behind a switch."""
        self.peer_id, self.run_id = peer_id, run_id
        self._source = source
        self._verify, self._fetch = verify, fetch
        self.log = NodeLog(logger, node_name)
        self._offered: Dict[int, object] = {}  # epoch number -> adopted epoch not applied yet
        self.epoch = None
        self.plan: Optional[Schedule] = None
        self.stage_of: Dict[int, int] = {}
        self.members: Tuple[str, ...] = ()
        self.index = -1
        self.data_node_peers: List[str] = []

    def follow(self, source: EpochSource) -> None:
        """From now on, take the adopted epoch from ``source``."""
        self._source = source

    def adopted(self):
        return self._source() if callable(self._source) else self._source

    def bind(self, epoch) -> None:
        """Train on ``epoch`` from now on (this node must hold a stage in it)."""
        plan = parse_schedule(epoch.schedule)
        stage_of = stage_index(plan)
        members = tuple(epoch.members)
        if self.peer_id not in members:
            raise UserError(f"peer {self.peer_id} is not a member of schedule epoch {epoch.epoch}")
        index = members.index(self.peer_id)
        if index not in stage_of:
            raise UserError(f"node index {index} holds no stage in schedule epoch {epoch.epoch}")
        self.epoch, self.plan, self.stage_of, self.members, self.index = epoch, plan, stage_of, members, index
        self.data_node_peers = [members[n] for n in plan.data_nodes]

    @property
    def stage(self) -> int:
        return self.stage_of[self.index]

    def replicas(self, stage: int) -> List[str]:
        """Peer ids of the nodes holding ``stage`` in the current epoch."""
        return [self.members[n] for n in self.plan.stages[stage]]

    def routes(self) -> List[List[int]]:
        """This data node's planned routes (node indices), one per microbatch."""
        return routes_for(self.plan, self.index)

    def offer(self, epoch) -> None:
        """Remember an adopted epoch: a newer one may arrive before this one's start iteration, and
        every member must still switch to this one at its boundary."""
        if epoch is not None and epoch.run_id == self.run_id:
            self._offered[int(epoch.epoch)] = epoch

    def knows(self, number: int) -> bool:
        return number in self._offered

    def senders(self) -> set:
        """Members of the current epoch and of announced ones (valid senders at a switch boundary)."""
        return set(self.members).union(*(e.members for e in self._offered.values()))

    def due(self, iteration: int):
        """The newest known epoch whose start iteration has been reached, if newer than ours."""
        self.offer(self.adopted())
        due = [e for n, e in self._offered.items() if n > self.epoch.epoch
               and int(e.start_iteration) <= iteration]
        for n in [n for n in self._offered if n <= self.epoch.epoch]:
            del self._offered[n]
        return max(due, key=lambda e: e.epoch) if due else None

    def switch(self, iteration: int) -> bool:
        """Bind the newest epoch due at ``iteration``; False when none is due.

        Raises :class:`LeftSchedule` when that epoch leaves this node out, and :class:`StageMoved` (without
        binding it) when it puts this node in another stage: this stage's state is no use there, so the trainer
        is rebuilt on the new stage and joins it with that stage's state."""
        epoch = self.due(iteration)
        if epoch is None:
            return False  # nothing new, or announced for a later boundary: every member switches there
        if self.peer_id not in epoch.members:
            raise LeftSchedule(f"schedule epoch {epoch.epoch} (from iteration {iteration}) does not include this node")
        old, old_stage = self.epoch, self.stage
        self.bind(epoch)
        if self.stage != old_stage:
            new_stage = self.stage
            self.bind(old)
            raise StageMoved(f"schedule epoch {epoch.epoch} moves this node from stage {old_stage} to {new_stage} "
                             f"at iteration {iteration}", epoch, old_stage, new_stage)
        return True

    def to_announce(self, iteration: int) -> List[bytes]:
        """Encoded epochs a member may not know yet: those announced to start after ``iteration``, and
        ours if it began at ``iteration`` or just before (a member that missed the switch learns it here)."""
        from protocol import encode

        out = [e for n, e in self._offered.items() if n > self.epoch.epoch and int(e.start_iteration) > iteration]
        if int(self.epoch.start_iteration) >= iteration - 1 and self.epoch.epoch > 0:
            out.append(self.epoch)
        return [encode(e) for e in out]

    def learn(self, announced: Iterable[Iterable[bytes]]) -> None:
        """Offer the epochs other members announced in their norm records (checked by ``verify``)."""
        from protocol import ProtocolError, ScheduleEpoch, decode

        for epochs in announced:
            for data in epochs:
                try:
                    epoch = decode(data, expect=ScheduleEpoch)
                except (ProtocolError, TypeError, ValueError):
                    continue
                if epoch.epoch <= self.epoch.epoch or epoch.epoch in self._offered:
                    continue
                if self._verify is not None and not self._verify(epoch):
                    continue
                self.log.info("learnt schedule epoch %d (from iteration %d) from a member's record", epoch.epoch,
                              epoch.start_iteration)
                self.offer(epoch)

    async def catch_up(self, ahead: int) -> None:
        """Members are on epoch ``ahead`` and we never saw it: look for it in the DHT."""
        if self._fetch is None:
            return
        with contextlib.suppress(Exception):
            for epoch in await self._fetch():
                if epoch.epoch > self.epoch.epoch and epoch.run_id == self.run_id:
                    self.offer(epoch)
        if ahead not in self._offered:
            self.log.warning("members train on schedule epoch %d, which this node cannot find yet", ahead)
