"""Agreeing on one schedule per epoch without a leader election.

Rule (see ``docs/daemon.md``): the *coordinator candidates* are the ONLINE data nodes (holders of
stage 0) sorted by peer id. Candidate 0 computes the schedule for the current ONLINE membership
with :func:`scheduler.paths.schedule_paths`, signs it with its RSA identity and publishes it as a
:class:`ScheduleEpoch` on gossip and in the DHT. Candidate ``r`` only steps in when membership has
been out of date for ``debounce + r x coordinator_timeout`` (the earlier candidates are dead or
stuck; a dead one also leaves the candidate list when its advert expires).

Candidates that are members of the current epoch rank before those that are not (each group by
peer id): a node that joins a run in progress never outranks a member data node just because its
peer id sorts first. And a node only issues an epoch while its ``blocker`` hook (set by the local
trainer) says nothing against it: a joiner whose data plane is not up yet does not coordinate
while a member data node is ONLINE, since the start iteration it would compute knows nothing of
the run's progress (with no member data node left it goes ahead: someone has to include it).

Membership is earned (:mod:`node.swarm.admission`): an epoch names only peers that train this
node's configuration (their advert's ``config_digest``) and that were admitted (answered a challenge)
or are members already; silent members and peers left out at the start barrier are dropped; a running
swarm adds at most ``MAX_NEW_MEMBERS_PER_EPOCH`` peers per epoch.

With the same members, the first candidate also re-plans when the members' measured compute speeds moved
away from those the current epoch was planned with (:mod:`node.swarm.replan`: a margin, a minimum interval
and a minimum predicted gain keep noise from making epochs churn).

Every node validates an epoch before adopting it: right run, signed by the key behind a known
ONLINE data node's advert, coordinator and members training this node's configuration, every member
known, and ``validate_schedule`` passes. Among valid
epochs the winner is the highest epoch number, ties broken by the lowest coordinator id, so all
nodes converge on the same one even if two coordinators raced.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Awaitable, Callable

from node.net.identity import NodeIdentity, verify_rsa_signature
from node.swarm.admission import Admission, new_members_allowed
from node.swarm.replan import ReplanPolicy, StageMove, planning_compute, propose_move, replan_reason, worth_switching
from node.swarm.states import NodeState
from node.swarm.view import PeerEntry, SwarmView
from protocol.messages import ScheduleEpoch
from scheduler.baselines import full_pipeline, random_skip
from scheduler.cost import CostMatrix, ModelShape, cost_from_measurements
from scheduler.reachability import apply_reachability, check_reachable, choose_relays
from scheduler.errors import ScheduleError
from scheduler.paths import schedule_paths_report
from scheduler.schedule import Schedule
from scheduler.simulator import simulate
from scheduler.validate import validate_schedule

__all__ = ["RunConfig", "Coordinator", "assign_stages", "epoch_membership", "rank_candidates"]

logger = logging.getLogger(__name__)

#: Link assumptions for pairs nobody has measured yet (the scheduler's same-location default).
DEFAULT_LATENCY_MS = 1.0
DEFAULT_BANDWIDTH_Bps = 2.0 * 2**30
#: Seconds of training between announcing an epoch that adds a node and its first iteration. What must fit
#: in it is the joiner's adoption of the epoch: a gossip hop (measured 0.06-0.1 s, on loopback and behind
#: NAT on a loaded 2-core box), else its DHT poll at the next heartbeat; the joiner built its stage already
#: (its admission proof), queues the data plane's messages for its first iteration, and can only download
#: the state of the iteration before the boundary once the replicas reach it, so a longer lead only delays
#: every join (it was 30 s: each daemon test's join waited about 40 s for its boundary).
DEFAULT_JOIN_LEAD_S = 10.0
#: Seconds of training between announcing an epoch that moves a member to another stage and its first
#: iteration: the mover's process, network and data plane are up, so it only builds the new stage and
#: downloads that stage's state (about a second for small stages on a LAN; a few on a loaded box).
DEFAULT_MOVE_LEAD_S = 5.0
#: How many unadopted epochs a node keeps to re-check once its view catches up.
MAX_PENDING_EPOCHS = 8


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What every node of a run must agree on; the founding node's values travel in ``hello``."""

    num_stages: int
    path_length: int
    microbatches_per_data_node: int
    #: How epochs route microbatches: "skippipe" (scheduler.paths), "full" (aligned full pipelines,
    #: scheduler.baselines.full_pipeline) or "random" (network-blind skipping, baselines.random_skip).
    schedule_policy: str = "skippipe"
    #: Cost by location for emulated runs (their link probes measure loopback, not the emulated
    #: links): {"locations": [...], "compute_s": [...], "link_s": [[...]]}; None = measurements.
    location_cost: dict | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "RunConfig":
        policy = str(data.get("schedule_policy") or "skippipe")
        location_cost = data.get("location_cost")
        return cls(int(data["num_stages"]), int(data["path_length"]), int(data["microbatches_per_data_node"]),
                   policy, dict(location_cost) if isinstance(location_cost, dict) else None)

    def expected_microbatches(self) -> int | None:
        """Microbatches each data node must dispatch (None: the policy decides, as "full" does)."""
        return None if self.schedule_policy == "full" else self.microbatches_per_data_node

    def cost_by_location(self, locations: list) -> CostMatrix | None:
        """The cost matrix of nodes at ``locations`` from ``location_cost``; None without one or
        when a location is not in it (the coordinator then uses the measurements)."""
        table = self.location_cost
        if not table:
            return None
        try:
            where = {loc: i for i, loc in enumerate(table["locations"])}
            idx = [where[loc] for loc in locations]
            link = [[0.0 if u == v else float(table["link_s"][a][b]) for v, b in enumerate(idx)]
                    for u, a in enumerate(idx)]
            return CostMatrix(tuple(float(table["compute_s"][a]) for a in idx), tuple(map(tuple, link)))
        except (KeyError, IndexError, TypeError, ValueError):
            return None


def assign_stages(peers: list[PeerEntry], num_stages: int) -> dict[str, int]:
    """One stage per peer, deterministically: single-stage peers first, then each multi-stage
    peer (by id) takes the held stage with the fewest peers so far (ties: lowest stage)."""
    counts = [0] * num_stages
    out: dict[str, int] = {}
    multi = []
    for e in sorted(peers, key=lambda e: e.peer_id):
        held = sorted(s for s in set(e.advert.stages) if 0 <= s < num_stages)
        if len(held) == 1:
            out[e.peer_id] = held[0]
            counts[held[0]] += 1
        elif held:
            multi.append((e.peer_id, held))
    for peer_id, held in multi:
        stage = min(held, key=lambda s: (counts[s], s))
        out[peer_id] = stage
        counts[stage] += 1
    return out


def rank_candidates(data_nodes: list[str], current: ScheduleEpoch | None) -> list[str]:
    """Coordinator candidates in rank order: those in ``current``'s members first, then the others
    (joiners), each group sorted by peer id."""
    members = set(current.members) if current is not None else set()
    return sorted(set(data_nodes), key=lambda p: (p not in members, p))


def epoch_membership(epoch: ScheduleEpoch) -> frozenset:
    """(peer id, stage) pairs an epoch was computed for."""
    pairs = set()
    for stage, nodes in enumerate(epoch.schedule.get("stages", [])):
        for v in nodes:
            if 0 <= v < len(epoch.members):
                pairs.add((epoch.members[v], stage))
    return frozenset(pairs)


def _better(a: ScheduleEpoch, b: ScheduleEpoch | None) -> bool:
    """Is ``a`` preferred over ``b``: higher epoch, then lower coordinator id."""
    if b is None:
        return True
    return (a.epoch, _neg(a.coordinator)) > (b.epoch, _neg(b.coordinator))


def _neg(peer_id: str) -> tuple:
    return tuple(-ord(c) for c in peer_id)


class Coordinator:
    """Issues epochs when this node is the responsible candidate; validates and adopts epochs."""

    def __init__(
        self,
        *,
        run_id: str,
        identity: NodeIdentity,
        view: SwarmView,
        run: RunConfig,
        memory: int,
        debounce_s: float,
        takeover_s: float,
        budget_s: float,
        publish: Callable[[ScheduleEpoch], Awaitable[None]],
        on_adopt: Callable[[ScheduleEpoch], None],
        progress: Callable[[float], int | None] | None = None,
        join_lead_s: float = DEFAULT_JOIN_LEAD_S,
        move_lead_s: float = DEFAULT_MOVE_LEAD_S,
        admission: Admission | None = None,
        config_digest: str = "",
        replan: ReplanPolicy = ReplanPolicy(),
    ):
        self.run_id = run_id
        self.identity = identity
        self.self_id = identity.peer_id.to_base58()
        self.view = view
        self.run = run
        self.memory = memory
        self.debounce_s = debounce_s
        self.takeover_s = takeover_s
        self.budget_s = budget_s
        self._publish = publish
        self._on_adopt = on_adopt
        #: first iteration a new epoch may start at (the local trainer's view), None if not training
        self._progress = progress
        self.join_lead_s = join_lead_s
        self.move_lead_s = move_lead_s
        #: who may enter an epoch (None: every ONLINE peer with our configuration digest, as in unit tests)
        self.admission = admission
        self.config_digest = admission.config_digest if admission is not None else config_digest
        self.current: ScheduleEpoch | None = None
        self.status = "waiting for members"
        self._pending: dict[tuple[int, str], ScheduleEpoch] = {}
        self._stale_since: float | None = None
        self._stale_target: frozenset = frozenset()
        self._computing = False
        self.epochs_issued = 0
        self.replan = replan
        #: when a re-plan was last computed (monotonic; one not worth switching to waits min_interval_s again)
        self._replan_checked_at: float | None = None
        #: Why this node must not coordinate right now (e.g. "joining: data plane not up yet"), or None;
        #: set by the local trainer service (None: nothing against it).
        self.blocker: Callable[[], str | None] | None = None
        self._blocker_failed = False  # its first failure is a warning, the rest debug lines

    # ------------------------------------------------------------------ who coordinates
    def candidates(self) -> list[str]:
        """ONLINE data nodes in rank order: members of the current epoch first (see the module docstring)."""
        return rank_candidates([e.peer_id for e in self.eligible() if 0 in e.advert.stages], self.current)

    def eligible(self) -> list[PeerEntry]:
        """ONLINE peers that may be in the next epoch: our configuration, not silent or left out, and
        members already or admitted (see :mod:`node.swarm.admission`)."""
        members = set(self.current.members) if self.current is not None else set()
        out = []
        for e in self.view.online():
            if e.advert.config_digest != self.config_digest and e.peer_id != self.self_id:
                continue
            a = self.admission
            if a is not None and not (a.may_join(e.peer_id, e.advert)
                                      and (e.peer_id in members or a.is_admitted(e.peer_id))):
                continue
            out.append(e)
        return out

    def _blocked(self) -> str | None:
        if self.blocker is None:
            return None
        try:
            return self.blocker()
        except Exception:  # noqa: BLE001 - a broken hook must not stop coordination, nor pass unseen
            logger.log(logging.DEBUG if self._blocker_failed else logging.WARNING,
                       "coordination blocker failed (coordinating as if unblocked)", exc_info=True)
            self._blocker_failed = True
            return None

    def target_membership(self) -> tuple[list[PeerEntry], dict[str, int]]:
        online = self.eligible()
        members = set(self.current.members) if self.current is not None else None
        cap = new_members_allowed(members)
        if cap is not None and self.admission is not None:
            new = [e for e in online if e.peer_id not in members and e.peer_id != self.self_id]
            if len(new) > cap:  # the earliest admitted first; the rest wait for a later epoch
                new.sort(key=lambda e: (self.admission.admitted.get(e.peer_id, 0.0), e.peer_id))
                held = {e.peer_id for e in new[cap:]}
                online = [e for e in online if e.peer_id not in held]
        assignment = assign_stages(online, self.run.num_stages)
        movable = [e.peer_id for e in online if e.advert.movable and 0 not in e.advert.stages]
        if self.current is not None and movable:  # a moved --auto node stays where its epoch put it
            placed = dict(epoch_membership(self.current))
            assignment.update({p: placed[p] for p in movable if placed.get(p, 0) > 0})
        return online, assignment

    # ------------------------------------------------------------------ periodic work
    async def tick(self) -> None:
        """Called every heartbeat (and on view changes): re-check pending epochs, maybe issue."""
        for key in sorted(self._pending):
            epoch = self._pending[key]
            if self.consider(epoch, from_pending=True) != "pending":
                self._pending.pop(key, None)
        online, assignment = self.target_membership()
        target = frozenset(assignment.items())
        if self.current is not None and epoch_membership(self.current) == target:
            self._stale_since = None
            self.status = "up to date"
            if self.candidates()[:1] == [self.self_id] and not self._computing:  # the first candidate re-plans
                move = self._move_due(online)
                reason = None if move else self._replan_due(online)
                if (move or reason) and not self._blocked():
                    self._replan_checked_at = time.monotonic()
                    if move:
                        await self.issue(online, {**assignment, move.peer: move.to_stage}, move=move)
                    else:
                        await self.issue(online, assignment, replan=reason)
            return
        now = time.monotonic()
        if self._stale_since is None or target != self._stale_target:
            # Take-over delays count from the latest membership change, so a backup does not
            # pre-empt a primary that has only just become ONLINE.
            self._stale_since, self._stale_target = now, target
        missing = [s for s in range(self.run.num_stages) if s not in assignment.values()]
        if missing:
            self.status = f"waiting: no ONLINE node holds stage(s) {missing}"
            return
        candidates = self.candidates()
        if self.self_id not in candidates or self._computing:
            self.status = "waiting for coordinator" if candidates else "waiting: no ONLINE data node"
            return
        blocked = self._blocked()
        members = set(self.current.members) if self.current is not None else set()
        if blocked and any(c != self.self_id and c in members for c in candidates):
            # a member data node can do it; with none left, waiting for our data plane would deadlock
            # (it comes up only once an epoch includes us), so we go ahead
            self.status = f"not coordinating: {blocked}"
            return
        rank = candidates.index(self.self_id)
        stable_for = now - self.view.changed_at
        waited = now - self._stale_since
        if stable_for < self.debounce_s or waited < self.debounce_s + rank * self.takeover_s:
            self.status = f"debouncing (coordinator rank {rank})"
            return
        await self.issue(online, assignment)

    def member_compute(self, entries: dict[str, PeerEntry], members: tuple[str, ...]) -> list[float]:
        """Per member, the compute speed to plan with: measured while training where advertised (see
        :func:`node.swarm.replan.planning_compute`), the start-up benchmark with re-planning off. A data node's
        measurement is not used: its stage-0 steps (embedding, head, loss) per "layer" are on another scale than
        the transformer layers the others time (it read as a 2.5-56x change between two checks), and its
        microbatches are its own data, which no plan can hand to another node."""
        adverts = [entries[p].advert for p in members]
        measured = [None if 0 in a.stages else a.measured_compute_s_per_sample_per_layer for a in adverts]
        return planning_compute([a.compute_s_per_sample_per_layer for a in adverts], measured, self.replan.enabled)

    def _planning_inputs(self, online: list[PeerEntry], min_age_s: float = 0.0) -> tuple[dict, Schedule] | None:
        """The members' view entries and the current schedule, when a re-plan or a move may be weighed now:
        the policy on, the skippipe policy planned from measurements (a location table fixes compute by
        location), the last check at least ``min_interval_s`` and the epoch ``min_age_s`` old, every member
        ONLINE; else None."""
        current, now = self.current, time.monotonic()
        if (not self.replan.enabled or self.run.schedule_policy != "skippipe" or self.run.location_cost
                or time.time() - current.issued_at < min_age_s
                or (self._replan_checked_at is not None and now - self._replan_checked_at < self.replan.min_interval_s)):
            return None
        entries = {e.peer_id: e for e in online}
        if any(m not in entries for m in current.members):
            return None
        try:
            return entries, Schedule.from_json(current.schedule)
        except (ScheduleError, KeyError, TypeError, ValueError):
            return None

    def _replan_due(self, online: list[PeerEntry]) -> str | None:
        """Why the current epoch's members should get a new schedule for their measured speeds, or None."""
        inputs = self._planning_inputs(online)
        if inputs is None:
            return None
        (entries, plan), current = inputs, self.current
        return replan_reason(self.replan, plan.cost.compute_s if plan.cost is not None else None,
                             self.member_compute(entries, current.members), time.time() - current.issued_at)

    def _move_due(self, online: list[PeerEntry]) -> StageMove | None:
        """A movable member to move into the bottleneck stage at the next epoch (:func:`propose_move` over the
        members' planning compute and the current schedule's microbatches per stage), or None; under the same
        conditions as a re-plan (policy on, skippipe, measured costs, every member ONLINE, the epoch and the
        last check at least ``min_interval_s`` old), and only once every member outside stage 0 that the schedule
        sends microbatches advertises a speed measured while training."""
        inputs = self._planning_inputs(online, min_age_s=self.replan.min_interval_s)
        if inputs is None:
            return None
        (entries, plan), current = inputs, self.current
        stage_of = {current.members[v]: s for s, nodes in enumerate(plan.stages) for v in nodes}
        # start-up benchmarks are one short run each, skewed by whatever else ran then: no move on them. A
        # replica the schedule sends no microbatch measures nothing; its start-up figure stands in for it
        busy = {current.members[v] for path in plan.paths if path.microbatches for v in path.route}
        if any(entries[p].advert.measured_compute_s_per_sample_per_layer is None for p, s in stage_of.items()
               if s and p in busy):
            return None
        load = [0.0] * len(plan.stages)
        for path in plan.paths:
            for s in {stage_of[current.members[v]] for v in path.route}:
                load[s] += path.microbatches
        compute = dict(zip(current.members, self.member_compute(entries, current.members)))
        movable = [p for p in current.members if entries[p].advert.movable]
        reach = {p: entries[p].advert.reachability for p in current.members}  # never strand a NATed replica
        return propose_move(self.replan, stage_of, movable, compute, load, reach)

    async def issue(self, online: list[PeerEntry], assignment: dict[str, int],
                    replan: str | None = None, move: StageMove | None = None) -> ScheduleEpoch | None:
        """Compute, sign, adopt and publish a new epoch for ``online``; ``replan``: why the same members get a new
        schedule (it is then issued only if it beats the current one by the policy's ``min_gain``); ``move``: the
        stage move ``assignment`` makes (its epoch starts far enough ahead for the mover's state download)."""
        self._computing = True
        try:
            members = tuple(sorted(assignment, key=lambda p: (assignment[p], p)))
            index = {p: i for i, p in enumerate(members)}
            stages = [[index[p] for p in members if assignment[p] == s] for s in range(self.run.num_stages)]
            entries = {e.peer_id: e for e in online}
            compute = self.member_compute(entries, members)
            previous = self.current if replan and self.current is not None and self.current.members == members else None
            reach = [entries[p].advert.reachability for p in members]
            relay = bool(choose_relays({p: (entries[p].advert.reachability, entries[p].advert.relay)
                                        for p in members}, "", 1))  # a member relays: NATed pairs are relayed
            latency, bandwidth = self._link_matrices(members)
            number = (self.current.epoch + 1) if self.current is not None else 1
            loop = asyncio.get_running_loop()

            def _compute() -> dict:
                cost = self.run.cost_by_location([entries[p].advert.location for p in members])
                if cost is None:
                    cost = cost_from_measurements(compute, latency, bandwidth, ModelShape())
                cost = apply_reachability(cost, reach, relay=relay)  # relayed links cost more; impossible ones priced out
                path_length = min(self.run.path_length, self.run.num_stages)
                mb, policy = self.run.microbatches_per_data_node, self.run.schedule_policy
                if policy == "full":
                    schedule = full_pipeline(stages, cost, mb, self.memory)
                elif policy == "random":
                    schedule = random_skip(stages, cost, path_length, mb, self.memory, seed=number)
                else:
                    schedule, report = schedule_paths_report(stages, cost, path_length, mb, self.memory,
                                                             seed=number, budget_s=self.budget_s)
                    if report.budget_hit:  # the schedule now depends on this machine's speed: say so
                        logger.warning("epoch %d: path search stopped at its %.0f s safety cap", number,
                                       self.budget_s)
                validate_schedule(schedule, microbatches_per_data_node=self.run.expected_microbatches())
                check_reachable(schedule, reach, relay)  # never a hop between two nodes nobody can dial
                if previous is not None:  # a re-plan: only if it beats the current routes under the same costs
                    old_s = simulate(Schedule.from_json(previous.schedule), cost, record_timelines=False).iteration_time_s
                    new_s = simulate(schedule, cost, record_timelines=False).iteration_time_s
                    if not worth_switching(self.replan, old_s, new_s):
                        logger.info("not re-planning (%s): %.2f s per iteration predicted, %.2f s now", replan,
                                    new_s, old_s)
                        return None
                return schedule.to_json()

            try:
                schedule_json = await loop.run_in_executor(None, _compute)
            except ScheduleError as e:
                self.status = f"cannot schedule: {e}"
                logger.warning("cannot schedule epoch %d: %s", number, e)
                return None
            if schedule_json is None:
                return None
            unsigned = ScheduleEpoch(
                run_id=self.run_id,
                epoch=number,
                coordinator=self.self_id,
                issued_at=time.time(),
                members=members,
                schedule=schedule_json,
                signature=b"",
                start_iteration=self.start_iteration(members, moving=move is not None),
            )
            epoch = dataclasses.replace(unsigned, signature=self.identity.sign(unsigned.signing_payload()))
            self.epochs_issued += 1
            why = (f" (re-plan: {replan})" if replan else f" (moving {move.peer[-8:]} from stage {move.from_stage} to "
                   f"the bottleneck stage {move.to_stage}: {move.gain:.2f}x predicted throughput)" if move else "")
            logger.info("issuing schedule epoch %d for %d members%s", number, len(members), why)
            self._adopt(epoch)
            await self._publish(epoch)
            return epoch
        finally:
            self._computing = False

    def start_iteration(self, members: tuple[str, ...] = (), moving: bool = False) -> int:
        """Iteration boundary at which a new epoch takes effect on every member.

        The local trainer knows the earliest boundary no member has crossed yet (members are at
        most one iteration apart); never earlier than an epoch already announced but not started,
        so a quick second membership change does not pull the switch forward. When ``members``
        adds peers that are not in the current epoch, the boundary is at least ``join_lead_s``
        of training ahead: a joiner must adopt the epoch and download its stage's state of the
        iteration before it, and the swarm waits for its gradient norm at the boundary. An epoch ``moving``
        a member to another stage is ``move_lead_s`` ahead: the mover is up already and only builds its
        new stage and downloads that stage's state.
        0 = not training yet.
        """
        joining = self.current is not None and bool(set(members) - set(self.current.members))
        lead_s = self.join_lead_s if joining else self.move_lead_s if moving else 0.0
        start = self._progress(lead_s) if self._progress is not None else None
        pending = self.current.start_iteration if self.current is not None else 0
        if start is None:  # not training here: never before the boundary already announced
            return int(pending)
        return max(int(start), int(pending))

    def _link_matrices(self, members: tuple[str, ...]) -> tuple[list[list[float]], list[list[float]]]:
        n = len(members)
        latency = [[0.0] * n for _ in range(n)]
        bandwidth = [[DEFAULT_BANDWIDTH_Bps] * n for _ in range(n)]
        for u, a in enumerate(members):
            for v, b in enumerate(members):
                if u == v:
                    continue
                stat = self.view.link(a, b)
                latency[u][v] = stat.rtt_ms / 2.0 if stat is not None else DEFAULT_LATENCY_MS
                if stat is not None and stat.bandwidth_Bps:
                    bandwidth[u][v] = float(stat.bandwidth_Bps)
        return latency, bandwidth

    # ------------------------------------------------------------------ receiving
    def consider(self, epoch: ScheduleEpoch, from_pending: bool = False) -> str:
        """Validate and maybe adopt ``epoch``; returns "adopted", "pending", "stale" or a reason."""
        if epoch.run_id != self.run_id:
            return "wrong run"
        if not _better(epoch, self.current):
            return "stale"
        entry = self.view.get(epoch.coordinator)
        if entry is None or entry.state != NodeState.ONLINE or 0 not in entry.advert.stages:
            return self._park(epoch, "coordinator is not a known ONLINE data node")
        if not verify_rsa_signature(entry.public_key, epoch.signing_payload(), epoch.signature):
            return "bad signature"
        if entry.advert.config_digest != self.config_digest:
            return "coordinator trains another configuration"
        unknown = [m for m in epoch.members if self.view.get(m) is None or self.view.get(m).state == NodeState.OFFLINE]
        if unknown:
            return self._park(epoch, f"unknown members {unknown[:3]}")
        other = [m for m in epoch.members if m != self.self_id
                 and self.view.get(m).advert.config_digest != self.config_digest]
        if other:
            return f"members {[m[-8:] for m in other[:3]]} train another configuration"
        try:
            schedule = Schedule.from_json(epoch.schedule)
            validate_schedule(schedule, microbatches_per_data_node=self.run.expected_microbatches())
            if any(v >= len(epoch.members) for stage in schedule.stages for v in stage):
                raise ScheduleError("members", "schedule names a node index without a member")
        except (ScheduleError, KeyError, TypeError, ValueError) as e:
            return f"invalid schedule: {e}"
        self._adopt(epoch)
        return "adopted"

    def _park(self, epoch: ScheduleEpoch, reason: str) -> str:
        self._pending[(epoch.epoch, epoch.coordinator)] = epoch
        while len(self._pending) > MAX_PENDING_EPOCHS:
            self._pending.pop(min(self._pending))
        logger.debug("parking epoch %d from %s: %s", epoch.epoch, epoch.coordinator, reason)
        return "pending"

    def _adopt(self, epoch: ScheduleEpoch) -> None:
        self.current = epoch
        self._pending = {k: v for k, v in self._pending.items() if _better(v, epoch)}
        self.status = "up to date"
        self._stale_since = None
        logger.info("adopted schedule epoch %d from %s", epoch.epoch, epoch.coordinator)
        self._on_adopt(epoch)
