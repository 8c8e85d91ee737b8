"""What the trainer's collaborators share: configuration, per-iteration records, errors, small helpers.

The trainer is split by job (see :mod:`node.train.trainer`); these are the types every part speaks.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from node.spec import DEFAULT_ITERATION_TIMEOUT_S
from node.train.averaging import AveragingConfig
from node.train.branch_scaling import DEFAULT_BRANCH_SCALING
from node.train.data import DataConfig
from node.train.deadlines import DeadlineConfig, ObservedDeadlineConfig
from node.train.hedging import HedgeConfig
from node.train.model import MODEL_SIZES, ModelConfig
from node.train.runtime import OptimConfig

__all__ = [
    "TrainerConfig",
    "IterationStats",
    "TrainingStalled",
    "JoinFailed",
    "NodeKilled",
    "LeftSchedule",
    "StageMoved",
    "Lifecycle",
    "IterationState",
    "Pending",
    "DoneFromNorm",
    "MbKey",
    "mb_key",
    "mb_name",
    "arrival_time",
    "NodeLog",
]


class TrainingStalled(RuntimeError):
    """An iteration could not complete in time even with recovery (e.g. a member hangs without dying)."""


class JoinFailed(TrainingStalled):
    """No live replica handed over the stage's state for a mid-run join (and no checkpoint).
    ``disputed``: replicas answered but disagree with each other, so a retry soon would fail the same way."""

    def __init__(self, message: str, disputed: bool = False):
        super().__init__(message)
        self.disputed = disputed


@dataclass(frozen=True)
class TrainerConfig:
    run_id: str = "skippipe"
    model: ModelConfig = MODEL_SIZES["tiny"]
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    averaging: AveragingConfig = AveragingConfig()
    seed: int = 0  # model initialisation; the data seed is ``data.seed``
    device: str = "cpu"
    #: compute precision and wire format; every member of a run must use the same ones
    precision: str = "fp32"  # fp32 | bf16 | fp16 (node.train.precision)
    wire: str = "fp32"  # fp32 | bf16 | fp16 | int8 (protocol.compression)
    #: how a visited stage's residual branches are scaled in training (node.train.branch_scaling); a run's
    #: members must agree, and a full pipeline trains the same under either
    branch_scaling: str = DEFAULT_BRANCH_SCALING.value  # inverse | none
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 10  # iterations; 0 = only on clean shutdown
    resume: bool = False
    memory_slots: Optional[int] = None  # in-flight microbatches per node; default: the schedule's
    #: a forward blocked by full memory slots this long with nothing else to do is admitted anyway:
    #: reordered paths can form a cycle of full nodes waiting on each other (see docs/training.md)
    memory_deadlock_grace_s: float = 5.0
    iteration_timeout_s: float = DEFAULT_ITERATION_TIMEOUT_S
    norm_exchange_timeout_s: float = 120.0
    #: the norm exchange polls the DHT for the members' records, first after ``norm_poll_s``, then
    #: at intervals doubling up to ``norm_poll_max_s``. Each poll is a ``latest=True`` DHT read that
    #: asks other peers; a fixed 20 ms poll on 9 daemons sharing 2 cores was a load of its own
    norm_poll_s: float = 0.02
    norm_poll_max_s: float = 0.25
    #: members send their numbers directly (``NormReport`` over the data plane); the DHT records
    #: are read only for members whose report has not come this long after ours was sent (a lost
    #: report, a member without our data plane), then polled as above
    norm_direct_grace_s: float = 1.0
    #: at most ``node.net.records.NORM_RECORD_TTL_S``: readers ignore records set to live longer
    norm_record_ttl_s: float = 300.0
    #: per-hop budgets from the cost model (node.train.deadlines); the data node fails a microbatch past them
    deadlines: DeadlineConfig = DeadlineConfig()
    #: budgets from the round trips a data node measured on each route, once it has enough (median + k x MAD)
    observed_deadlines: ObservedDeadlineConfig = ObservedDeadlineConfig()
    #: a microbatch late at its data node is sent again on other replicas before it is given up
    hedging: HedgeConfig = HedgeConfig()
    #: deadlines of a trainer's first iteration are this many times longer: every stream to a
    #: neighbour is opened then and allocators warm up; on a loaded box that took ~3x a steady hop
    first_iteration_deadline_factor: float = 3.0
    #: a microbatch whose forward failed is recomputed on a fresh path at most this often, then dropped
    max_retries: int = 1
    #: stages a path may lose to recovery beyond the schedule's own skips (the paper's omission
    #: results: a skip-trained model tolerates missing stages; 1 keeps paths within one of k)
    max_extra_skips: int = 1
    #: first back-off of a suspected peer (doubles per repeat up to ban_max_s); long enough to outlast
    #: the advert TTL, so a dead peer is out of the view before the ban ends
    ban_s: float = 30.0
    ban_max_s: float = 300.0
    liveness_poll_s: float = 0.25  # how often deadlines and membership are re-checked in an iteration
    #: a data node gives up the microbatches routed through a peer once that peer has been out of the
    #: view this long. On an overloaded host (20 daemons on 2 cores) a live peer's advert can lapse for
    #: a moment; failing its microbatches at once recomputes all of them while the originals still hold
    #: memory slots along their routes (a 20-daemon full-pipeline run lost 190 s that way). A peer that
    #: is really gone was already out of the view for a whole advert TTL; the microbatch deadlines
    #: still catch a hop that never answers.
    left_grace_s: float = 10.0
    #: a microbatch budget is capped at this fraction of ``iteration_timeout_s``: on an overloaded box
    #: the cost-model budget can exceed the iteration timeout, and then a lost microbatch would stop
    #: training (TrainingStalled) instead of being recomputed or dropped
    max_budget_fraction: float = 0.4
    #: an iteration still open after this long logs what it waits for (pending microbatches, queues,
    #: missing IterationDones), then again at this interval: a stall must be diagnosable from the log
    stall_report_s: float = 60.0
    #: how often a node still waiting for a data node's IterationDone looks for that data node's
    #: norm record in the DHT instead (a lost IterationDone must not stall the swarm)
    done_poll_s: float = 1.0
    pause_poll_s: float = 1.0  # how often a paused node re-checks for the missing stage
    state_fetch_timeout_s: float = 180.0  # joiners and re-syncs wait this long for a replica's state
    #: a joiner asks the live replicas this many times before giving up on the epoch (each ask waits
    #: up to the replica's own limit for the iteration before the join to be committed)
    state_fetch_attempts: int = 4
    #: relative checksum difference above which a replica counts as diverged. Not 0: hivemind's
    #: all-reduce applies the mean as local + (mean - local), so replicas of one round can differ in
    #: the last bit. Measured on `skippipe up`: such noise stays below 5e-7 on checksums of ~130, a
    #: failed round leaves ~0.07. At 1e-9 the noise alone forced a state download every iteration.
    resync_tolerance: float = 1e-6


@dataclass
class IterationStats:
    iteration: int
    epoch: int
    loss: float  # mean over all microbatches of all data nodes
    microbatches: int
    tokens: int
    seconds: float  # this node's wall time for the iteration, step included
    grad_norm: float  # global, before clipping
    clip_coef: float
    active_nodes: int  # members that published their norm this iteration
    local_visits: int
    averaged: Optional[bool]  # None: nothing to average (single replica or no visits)
    microbatch_s: float = 0.0  # until IterationDone from every data node
    averaging_s: float = 0.0
    norm_exchange_s: float = 0.0
    step_s: float = 0.0
    dropped: int = 0  # microbatches given up this iteration (all data nodes)
    retried: int = 0  # recomputations on a fresh path (this data node)
    resynced: bool = False  # this replica copied its state from the canonical replica instead of stepping
    # emulation only (0 otherwise): how far this node's real work fell behind the emulated timeline in the
    # microbatch phase (compute steps past their target; stamped frames received after their delivery time)
    compute_overrun_s: float = 0.0
    late_frames_s: float = 0.0


class NodeKilled(RuntimeError):
    """This trainer was killed by fault injection (in-process harness stand-in for a dead machine)."""


class LeftSchedule(RuntimeError):
    """The epoch that starts now no longer includes this node (it drained or was dropped)."""


class StageMoved(LeftSchedule):
    """The epoch that starts now moves this node to another stage: it leaves its old stage here and joins the new
    one at ``epoch.start_iteration`` with that stage's verified state, as a joiner does."""

    def __init__(self, message: str, epoch, old_stage: int, new_stage: int):
        super().__init__(message)
        self.epoch, self.old_stage, self.new_stage = epoch, old_stage, new_stage


class Lifecycle(enum.Enum):
    """Where a trainer is in its life; it only moves forward (KILLED can follow any state)."""

    RUNNING = "running"
    #: SIGTERM: keep training until an epoch without this node starts, then leave
    DRAINING = "draining"
    #: finish the current iteration, then return from ``run``
    STOPPING = "stopping"
    #: shut down (checkpoint saved, data plane closed); no new work
    CLOSED = "closed"
    #: died by fault injection, without a word to anyone
    KILLED = "killed"


MbKey = Tuple[str, int, int, int, int]  # (data node peer id, epoch, iteration, index, attempt)


def mb_key(mb) -> MbKey:
    return (mb.data_node, mb.epoch, mb.iteration, mb.index, mb.attempt)


def mb_name(mb) -> str:
    return f"mb {mb.data_node[-6:]}/{mb.iteration}/{mb.index}.{mb.attempt}"


@dataclass
class Pending:
    """A data node's own microbatch in flight: which attempt, on which route, until when."""

    index: int
    attempt: int
    route: Tuple[str, ...]
    deadline: float
    loss_done: bool = False
    started: float = 0.0  # monotonic time of the attempt's first forward
    #: monotonic time at which it is hedged if not back (node.train.hedging); inf: never
    hedge_at: float = math.inf
    #: other live attempts of the same microbatch (hedges), by attempt number; the first back wins
    hedges: Dict[int, "Pending"] = field(default_factory=dict)
    hedged: int = 0  # hedges sent for this microbatch
    #: the highest attempt number used for this microbatch: a new attempt never reuses one whose
    #: frames may still be on their way (receivers refuse a frame id they have seen)
    highest_attempt: int = -1

    def next_attempt(self) -> int:
        return max(self.attempt, self.highest_attempt, *self.hedges) + 1

    def attempts(self) -> List["Pending"]:
        """This attempt and its live hedges."""
        return [self, *self.hedges.values()]


@dataclass(frozen=True)
class DoneFromNorm:
    """Stand-in for an ``IterationDone`` learnt from a data node's norm record."""

    dropped: int = 0


@dataclass
class IterationState:
    """What one node knows about one iteration while it is open."""

    done: Dict[str, object] = field(default_factory=dict)  # data node peer id -> IterationDone
    all_done: asyncio.Event = field(default_factory=asyncio.Event)
    # data-node side
    remaining: int = 0
    losses: List[float] = field(default_factory=list)
    visits: Dict[str, int] = field(default_factory=collections.Counter)
    tokens: int = 0
    dropped: int = 0
    retried: int = 0


def arrival_time(now_mono: float, now_unix: float, deliver_at_unix: Optional[float], emulates_links: bool) -> float:
    """When a hop message's work could have started (monotonic clock).

    A node that emulates links held a stamped message until its emulated delivery time, so it
    arrived then, not now: compute padding counts from there. A node that does not emulate links
    delivered it at once and ignores the stamp (as its data plane does)."""
    if deliver_at_unix is None or not emulates_links:
        return now_mono
    return now_mono - max(0.0, now_unix - deliver_at_unix)


class NodeLog(logging.LoggerAdapter):
    """A module's logger that prefixes every message with the node's name (many nodes share one
    process in the local harness and the tests, and their lines interleave)."""

    def __init__(self, logger: logging.Logger, node_name: Optional[str]):
        super().__init__(logger, {"node": node_name})

    def process(self, msg, kwargs):
        node = self.extra["node"]
        return (f"{node}: {msg}" if node else msg), kwargs
