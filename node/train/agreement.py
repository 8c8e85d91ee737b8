"""Run agreement: which epoch a daemon's trainer pins, and the checks that all members train the same run.

The service pins one schedule epoch to start on: the host's *current* epoch once that epoch
(a) contains this peer, (b) has at least ``min_members`` members and (c) has stayed the current
epoch for the start debounce (default 3 heartbeats). It then builds its stage and publishes one
:class:`node.net.records.StartRecord` ``{epoch, config, start}`` under ``<run>:trainstart``. Each
node pins exactly once, and nobody runs an iteration before *every* member of its pinned epoch has
confirmed that same epoch, the same training configuration (:func:`training_summary`) and the same
start iteration. So if any node trains on epoch E, all members of E train on E. A member that
pinned something else never stops the others: the largest group of members that agree goes on and
leaves the rest out of the run (the coordinator issues an epoch without them, which the group pins
next), while a node of a minority stops with a :class:`TrainingDisagreement` naming who and what
differs, never a silent split. Confirmations made before the pinned epoch was issued (an earlier
session) are ignored. Most mismatches never get this far: a joiner compares its configuration with
the run's in the ``hello`` handshake, and epochs only admit peers advertising the same digest.

A node joining a run in progress skips the barrier but must match the run's configuration; one that
comes after the run's end learns from a :class:`node.net.records.FinishedRecord` there is nothing left.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict
from typing import Dict, List, Optional, Tuple

from node.errors import UserError
from node.net.runconfig import summary_differences
from node.net.records import (FinishedRecord, StartRecord, read_finished_records, read_start_records,
                              write_finished_record, write_start_record)
from node.train.common import NodeLog, TrainerConfig, TrainingStalled
from node.train.host import TrainerHost

__all__ = ["RunAgreement", "RepinEpoch", "TrainingDisagreement", "training_summary", "summary_differences"]

logger = logging.getLogger(__name__)


class TrainingDisagreement(UserError):
    """This node pinned another epoch, configuration or start iteration than the run's majority."""


class RepinEpoch(Exception):
    """Pin a newer epoch: members that pinned another run were left out (or members moved on)."""


def _pin_key(record: StartRecord) -> str:
    """Records with equal keys pinned the same run (epoch, configuration, start iteration)."""
    return json.dumps([int(record.epoch), record.config, int(record.start)], sort_keys=True, default=str)


def training_summary(config: TrainerConfig, iterations: int) -> dict:
    """The hyper-parameters every member of a run must share (compared before training starts)."""
    return {"model": config.model.to_dict(), "optim": asdict(config.optim), "data": asdict(config.data),
            "averaging": asdict(config.averaging), "seed": config.seed, "iterations": int(iterations),
            "memory_slots": config.memory_slots, "precision": config.precision, "wire": config.wire,
            "branch_scaling": config.branch_scaling}


class RunAgreement:
    """Pins the epoch to train on and checks the other members' start and finished records."""

    def __init__(self, host: TrainerHost, run_id: str, summary: dict, *, min_members: int,
                 start_debounce_s: Optional[float], agreement_timeout_s: float, poll_s: float,
                 node_name: Optional[str] = None):
        self.host, self.run_id, self.summary = host, run_id, summary
        self.min_members, self.start_debounce_s = min_members, start_debounce_s
        self.agreement_timeout_s, self.poll_s = agreement_timeout_s, poll_s
        self.log = NodeLog(logger, node_name)
        #: why choose_epoch is still waiting (shown in the training RPC), None when it is not
        self.waiting: Optional[str] = None
        #: a member of the pinned epoch gone this long (out of the host's view, or OFFLINE) no longer holds
        #: up the start: longer than an advert lapse of a live node under load, far shorter than the timeout
        self.gone_grace_s = 15.0
        #: a node left out of a run in progress compares its configuration with the members' start records
        #: this often: epochs never admit a node with another configuration, so without the check one that
        #: joined through a peer that does not train would wait for ever instead of saying why
        self.config_check_s = 10.0

    @property
    def debounce_s(self) -> float:
        if self.start_debounce_s is not None:
            return self.start_debounce_s
        return 3.0 * float(self.host.config.heartbeat_s)

    async def choose_epoch(self, after: Optional[Tuple[int, int]] = None, stopping: Optional[asyncio.Event] = None):
        """The epoch to train on: the first time the host's current one (see the module docstring);
        after leaving (``after`` = (epoch we left, iteration)), the next one that includes us again.
        None when ``stopping`` is set while waiting for such a re-join."""
        me = str(self.host.peer_id)
        seen, since, said, checked = None, time.monotonic(), None, time.monotonic()
        while True:
            epoch = self.host.current_epoch
            if after is not None and epoch is not None and (
                    epoch.epoch <= after[0] or int(epoch.start_iteration) < after[1]):
                epoch = None  # not newer than the one we left, or it started before we left
            if after is not None and stopping is not None and stopping.is_set():
                return None
            number = epoch.epoch if epoch is not None else None
            if number != seen:
                seen, since = number, time.monotonic()
            joining = epoch is not None and int(epoch.start_iteration) > 0
            if epoch is not None and me in epoch.members and (joining or len(epoch.members) >= self.min_members):
                # a run in progress announced its boundary already; waiting would only make us late
                if joining or time.monotonic() - since >= self.debounce_s:
                    return epoch
            elif epoch is not None:
                if (me not in epoch.members and int(epoch.start_iteration) > 0
                        and time.monotonic() - checked >= self.config_check_s):
                    checked = time.monotonic()
                    await self.check_joining_config()
                self.waiting = (f"epoch {number} has {len(epoch.members)} members (need {self.min_members})"
                                + ("" if me in epoch.members else ", not including this node: waiting for an "
                                   "epoch that adds it"))
                if said != number:
                    said = number
                    self.log.info("training waits: %s", self.waiting)
            else:
                self.waiting = "no schedule epoch yet"
            await asyncio.sleep(self.poll_s)

    async def confirm(self, epoch, start: int) -> None:
        """Publish this node's pin, then wait until every member confirmed the same one.

        Once every member still alive has confirmed, members that pinned something else (another
        configuration or start iteration, an epoch nobody issued) are compared by group: the largest
        group trains (ties: the coordinator's group, then the lowest peer id). This node, if in the
        minority, stops with a :class:`TrainingDisagreement`; otherwise it asks the host to leave the
        others out and raises :class:`RepinEpoch`, to pin the epoch issued without them. A record of
        an older epoch is a member that has not re-pinned yet; one of a newer epoch this node adopted
        too means this node re-pins."""
        dht, me = self.host.dht, str(self.host.peer_id)
        await write_start_record(dht, self.run_id, me, StartRecord(int(epoch.epoch), self.summary, int(start),
                                                                   time.time()))
        deadline = time.monotonic() + self.agreement_timeout_s
        not_after = float(epoch.issued_at) - 5.0  # older confirmations belong to an earlier session
        gone_since: dict = {}  # member -> when it was first seen gone (not alive in the host's view)
        ahead_since: dict = {}  # member -> when it was first seen pinning an epoch this node has not adopted
        while True:
            records = await read_start_records(dht, self.run_id, members=set(epoch.members)) or {}
            found = {p: r for p, r in records.items() if p in epoch.members and r.time >= not_after
                     and r.epoch >= epoch.epoch}
            adopted = self.host.current_epoch
            if any(r.epoch > epoch.epoch and adopted is not None and adopted.epoch >= r.epoch for r in found.values()):
                raise RepinEpoch(f"members pinned schedule epoch {adopted.epoch}, newer than {epoch.epoch}")
            now = time.monotonic()
            for peer in [p for p, r in found.items() if r.epoch > epoch.epoch]:
                # a newer epoch reaches this node within seconds; one that never does was never issued
                if now - ahead_since.setdefault(peer, now) < self.gone_grace_s:
                    del found[peer]
            for peer in epoch.members:  # a member that died or left (e.g. its checkpoint failed) cannot confirm
                if peer in found or self.host.peer_alive(peer):
                    gone_since.pop(peer, None)
                else:
                    gone_since.setdefault(peer, now)
            excused = {p for p, t in gone_since.items() if now - t >= self.gone_grace_s}
            found[me] = StartRecord(int(epoch.epoch), self.summary, int(start), time.time())
            if len(found) == len(epoch.members) or (excused and len(found) + len(excused) >= len(epoch.members)):
                self._settle(epoch, found, start)
                if excused:
                    self.log.warning("starting without %s: gone before confirming epoch %d (training recovers "
                                     "around them)", [p[-8:] for p in sorted(excused)], epoch.epoch)
                return
            if time.monotonic() > deadline:
                missing = [p[-8:] for p in epoch.members if p not in found]
                raise TrainingStalled(f"members {missing} never confirmed epoch {epoch.epoch} "
                                      f"within {self.agreement_timeout_s:.0f}s (are they running --train?)")
            await asyncio.sleep(self.poll_s)

    def _settle(self, epoch, found: dict, start: int) -> None:
        """Every member confirmed: return if all agree, else let the largest group go on (see confirm)."""
        me = str(self.host.peer_id)
        groups: Dict[str, List[str]] = {}
        for peer, r in found.items():
            groups.setdefault(_pin_key(r), []).append(peer)
        if len(groups) == 1:
            return
        order = sorted(groups.values(), key=lambda g: (-len(g), epoch.coordinator not in g, min(g)))
        winners = order[0]
        if me not in winners:
            raise TrainingDisagreement(self._why(found[winners[0]], epoch, start, winners[0]))
        losers = sorted(p for g in order[1:] for p in g)
        for peer in losers:
            self.host.leave_out(peer, self._why(found[peer], epoch, start, peer))
        raise RepinEpoch(f"left {[p[-8:] for p in losers]} out of the run: they pinned another run "
                         f"({self._why(found[losers[0]], epoch, start, losers[0])})")

    def _why(self, record: StartRecord, epoch, start: int, peer: str) -> str:
        if record.epoch != epoch.epoch:
            return (f"members disagree on the training epoch: {peer[-8:]} pinned epoch {record.epoch}, "
                    f"this node epoch {epoch.epoch}")
        diff = summary_differences(self.summary, record.config)
        if diff:
            return f"training configuration differs from {peer[-8:]}: " + "; ".join(diff)
        return (f"checkpoints disagree on the iteration to start from: {peer[-8:]} starts at {record.start}, "
                f"this node at {start} (use --resume on all nodes or none)")

    def _run_members(self) -> set:
        """Whose records speak for the run: the members of the host's current epoch (a record of anyone
        else, e.g. a peer of the DHT that never joined, is ignored by the reader)."""
        epoch = self.host.current_epoch
        return set(epoch.members) if epoch is not None else set()

    async def say_finished(self, last_iteration: int) -> None:
        """Record in the DHT that this member finished the run (read by :meth:`run_finished`)."""
        try:
            await write_finished_record(self.host.dht, self.run_id, str(self.host.peer_id),
                                        FinishedRecord(self.summary, int(last_iteration), time.time()))
        except Exception:  # noqa: BLE001 - only late joiners read it; training is over either way
            self.log.debug("could not record the finished run", exc_info=True)

    async def run_finished(self) -> bool:
        """Whether another member already finished this run (same configuration, so the same iterations)."""
        try:
            records = await read_finished_records(self.host.dht, self.run_id, members=self._run_members()) or {}
        except Exception:  # noqa: BLE001 - unknown: go on as before
            return False
        me = str(self.host.peer_id)
        return any(not summary_differences(self.summary, r.config) for p, r in records.items() if p != me)

    async def check_joining_config(self) -> None:
        """A joiner skips the start barrier, but must still train with the run's hyper-parameters: it
        stops when no member's start record matches its configuration (one that does is this session's;
        a differing one may be a member's record of an earlier session), naming the newest record's
        differences."""
        me = str(self.host.peer_id)
        try:
            records = await read_start_records(self.host.dht, self.run_id, members=self._run_members()) or {}
        except Exception:  # noqa: BLE001 - unknown for now: asked again later
            self.log.debug("could not read the run's start records", exc_info=True)
            return
        others = sorted(((p, r) for p, r in records.items() if p != me), key=lambda pr: -pr[1].time)
        if not others or any(not summary_differences(self.summary, r.config) for _, r in others):
            return
        peer, record = others[0]
        diff = summary_differences(self.summary, record.config)
        raise TrainingDisagreement(f"training configuration differs from {peer[-8:]}: " + "; ".join(diff))
