"""Earning membership: who may enter a schedule epoch, and who is dropped from one.

An advert is cheap: anyone can sign one for a made-up identity, and a schedule epoch that names a
peer nobody can reach stalls every iteration routed through it. So a live advert only makes a peer a
*candidate*; the coordinator puts it into an epoch only once it was **admitted**:

* it trains this run's configuration (its advert's ``config_digest`` equals ours);
* it answered an **admission challenge**: an ``admit`` RPC with a fresh random nonce, sent over a
  libp2p stream to the peer id of its advert, through the addresses its advert names. libp2p's
  secure handshake authenticates that peer id, so only a process holding the advert's private key and
  running a daemon can echo the nonce, and it answers with its configuration digest and stages;
* it does not hold a **stale state**: the answer carries the iteration its trainer last committed
  (none when it is not training: a fresh joiner, or a node that left to catch up); a candidate still
  training an iteration more than :data:`MAX_LAG_ITERATIONS` behind ours (a node frozen for a while,
  then continued) is refused until it has left its old run; it then enters as a joiner, which takes
  its stage's state from the replicas and checks it against them (``fetch_verified_state``) before it
  trains its first iteration;
* while a schedule epoch trains (the challenger's trainer has committed iterations), it **proves it holds
  its stage**: the challenge names the one stage its
  advert holds, and the candidate runs that stage on a probe input derived from the nonce and answers a
  short sketch of the output (:mod:`node.dataplane.probe`); a live replica of the stage (this node when it
  holds the stage, else the adopted epoch's replicas, asked by the ``stage_probe`` RPC until one agrees)
  computes the same on its current weights, and they must agree within :data:`node.dataplane.probe.PROBE_TOLERANCE`
  (a joiner a dozen steps behind passes, re-initialised or zeroed weights do not; the figures are in that
  module). So a joiner takes its stage's verified state *before* an epoch names it
  (:mod:`node.train.proof`), and the replicas' state servers serve candidates, not only members. With no
  live replica answering, the candidate is admitted on its answer's shape (finite, the right length) and
  this node logs whom it trusted (``trusted_alone`` in its status). A candidate that holds no state yet
  is asked again after :data:`PROOF_PENDING_RETRY_S`, unless no live replica holds its stage (the stage
  went missing and training paused for it): there is then no state to take or compare with, and the node
  that brings the stage back (from its checkpoint) is admitted alone, logged the same way. Why before, and not at the join's download: the
  probe must be answered by a node that *already* holds the weights, else an epoch names it (and waits
  for it) on its word; the epoch's own download at its first iteration still follows, since the proof is
  stale by then. A candidate advertising several stages is not probed (the epoch picks its stage).
  Sketches (in a challenge's answer and by ``stage_probe``) answer members of the adopted epoch only:
  else a candidate could pass by relaying its challenger's nonce to a replica;
* a peer that was a member and is not in the current epoch (its advert lapsed, it went silent) must
  answer a fresh challenge before an epoch names it again: its earlier answer says nothing about its
  progress now;
* at most :data:`MAX_NEW_MEMBERS_PER_EPOCH` candidates are added to a running epoch at a time, and
  at most :data:`MAX_CHALLENGES_PER_ROUND` are challenged per round (round-robin), so many adverts
  slow down only their own admission, never the probes of the members.

Epoch members are probed the same way every :data:`MEMBER_PROBE_EVERY_S`; a member that fails every
probe for :data:`SILENT_AFTER_S` (and at least :data:`SILENT_AFTER_PROBES` in a row) counts as
**silent**: gone for the trainer (:meth:`node.swarm.daemon.Daemon.peer_alive`, so training routes
around it) and for the coordinator (the next epoch leaves it out), even while its adverts stay fresh,
at most :func:`silent_drop_bound_s` after it went silent.
A member that answers but does not **train** counts the same as one that does not answer: once this
node has committed the epoch's first iteration, a member whose committed iteration lags ours by more
than :data:`MAX_LAG_ITERATIONS` fails its probe (a joiner that could not verify any state, a node
stuck on an old iteration); every iteration would otherwise wait for its missing norm until the norm
timeout. A peer dropped this way is asked again only after a back-off that doubles with each drop
(:data:`DROPPED_RETRY_S`), so a joiner that never manages to train costs the swarm a bounded share
of its time. A node that knows it cannot train (its join found its stage's replicas disagreeing) answers
``ready: false``: it is not admitted, and as a member it is dropped at its next probe, without the wait
for proof a silent member gets. Its advert says the same (``StageAdvert.ready``), for the members that
cannot probe it (both behind NAT): their trainers stop waiting for its norms at once, not after the norm
timeout of every iteration until the next epoch. A member left out at the start barrier because it pinned another run
(:meth:`Admission.leave_out`) is never admitted again by this process.

Not covered: a challenge proves a live daemon behind the identity with the right configuration holding
its stage's weights, not that it will compute honestly; many real daemons that download the state can
still join (at the capped rate), and what a bad member sends is checked by the data plane's guards.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable

__all__ = ["Admission", "ADMIT_METHOD", "STAGE_PROBE_METHOD", "rpc_over_p2p", "MAX_NEW_MEMBERS_PER_EPOCH",
           "SILENT_AFTER_S", "new_members_allowed",
           "silent_drop_bound_s"]

logger = logging.getLogger(__name__)

#: The RPC method of the challenge.
ADMIT_METHOD = "admit"
#: The RPC method by which a challenger that does not hold a candidate's stage asks a replica for its sketch.
STAGE_PROBE_METHOD = "stage_probe"
#: Most peers one epoch adds to a swarm that already has an epoch. Each addition costs the members a
#: join lead (training planned around the joiner) and a stage download; volunteers arrive a few at a
#: time, so 4 per epoch (one epoch every few heartbeats) takes them all in within a minute, while a
#: burst of identities (real daemons, each answering its challenge) grows the epoch only this fast.
MAX_NEW_MEMBERS_PER_EPOCH = 4
#: Seconds one challenge (connect + RPC round trip) may take: an honest peer on a loaded box answers
#: in well under a second; more than this and it is asked again later.
CHALLENGE_TIMEOUT_S = 5.0
#: A candidate that failed its challenge is asked again no sooner than this: an advert with no node
#: behind it costs each member one timed-out challenge per this many seconds, not one per heartbeat.
RETRY_AFTER_S = 15.0
#: Most peers remembered per table (admitted, retry times, probe failures); the oldest go first.
MAX_TRACKED = 1024
#: Seconds between two probes of the same epoch member: every node probes every member, so this sets
#: the probe traffic (20 members: about 2 small RPCs per second per node); a third of SILENT_AFTER_S
#: gives the 3 failed probes that make a member silent.
MEMBER_PROBE_EVERY_S = 10.0
#: Most members probed per round (oldest probe first): every node probes the members, so this bounds
#: the swarm's probe traffic to members x this per heartbeat whatever the epoch's size.
MAX_PROBES_PER_ROUND = 4
#: Most candidates challenged per round (the longest unasked first): a launch of up to 17 nodes is
#: admitted in one round, a larger one 16 per heartbeat. A round that challenged every due candidate
#: would let adverts set its length (1000 made-up ones: 125 waves of 8 timed-out challenges, ten
#: minutes), and the members' probes, hence a silent member's drop, would wait behind them.
MAX_CHALLENGES_PER_ROUND = 16
#: Most challenges in flight at once: one round's challenges and probes, so a round is one wave and
#: lasts at most :data:`CHALLENGE_TIMEOUT_S` whatever the number of adverts (each is one small RPC).
MAX_CONCURRENT_CHALLENGES = MAX_CHALLENGES_PER_ROUND + MAX_PROBES_PER_ROUND
#: A member failing every probe this long is silent: longer than the pauses of an honest node on an
#: overloaded machine (its adverts lapse after about as long), short enough that the swarm does not
#: wait for a vanished member much longer than for one whose advert expired.
SILENT_AFTER_S = 30.0
#: ... and at least this many failed probes in a row (one lost probe never drops a member).
SILENT_AFTER_PROBES = 3
#: Longest nonce echoed back (the caller's nonce is 32 hex characters).
MAX_NONCE_CHARS = 64
#: Iterations a training peer may be behind us and still count as in step: an iteration commits only
#: once every member published its gradient norm, so an honest member is at most one iteration behind
#: the iteration we had committed when we sent the challenge; two or more means the swarm went on
#: without it (or it is training a run it fell out of).
MAX_LAG_ITERATIONS = 1
#: Seconds before a peer dropped as silent or not training is asked again, doubled with each further
#: drop up to :data:`MAX_DROPPED_RETRY_S`: a returning honest node is back within a minute, a joiner
#: that enters and never trains re-enters ever more rarely.
DROPPED_RETRY_S = 15.0
#: Longest back-off of :data:`DROPPED_RETRY_S` (ten minutes: an honest node that failed to join many
#: times still gets a try every few minutes).
MAX_DROPPED_RETRY_S = 600.0
#: Seconds one stage probe (a forward of 1 x a few tokens on the stage) may take on the node that runs it:
#: it waits for the compute thread's current work (an iteration's forward or backward), which on a loaded
#: box takes a few seconds at most; within :data:`CHALLENGE_TIMEOUT_S` so the challenge itself can answer.
STAGE_PROBE_TIMEOUT_S = 4.0
#: Stage probes this node runs at once (for challengers and for replicas' references): each is a small
#: forward, but one identity asking many at once must not queue the trainer's compute behind them.
MAX_CONCURRENT_STAGE_PROBES = 2
#: Other replicas asked for a reference sketch (until one agrees) before a candidate is refused, or admitted on
#: its answer's shape alone when none answers: two cover one replica that just left, or one that lies.
MAX_REFERENCE_ASKS = 2
#: Seconds a challenge answered for the state server vouches for a candidate: its proof downloads come
#: every few seconds while it waits for admission, and each would otherwise cost it a challenge.
VOUCHED_FOR_S = 300.0
#: Largest stage index a probe request may name (a sanity bound: runs have a handful of stages).
MAX_STAGE_INDEX = 1024
#: Why a candidate that holds no state of its stage yet (it is still downloading it) is not admitted now.
PROOF_PENDING = "it holds no verified state of its stage yet"
#: Seconds before such a candidate is asked again: its download takes a few seconds, and waiting the
#: full :data:`RETRY_AFTER_S` would add that much to every join; it is a live daemon that answered the
#: challenge (an advert with nothing behind it still waits the full time).
PROOF_PENDING_RETRY_S = 3.0
#: Why a peer that answered ``ready: false`` is refused (and dropped at once as a member).
NOT_READY = "not ready: it says it cannot train (its stage's replicas disagree)"


def rpc_over_p2p(daemon, method: str = ADMIT_METHOD) -> Callable[[str, dict], Awaitable[object]]:
    """``daemon``'s call of ``method`` (the challenge, or a stage probe reference) to a peer, through the
    addresses of the peer's advert."""
    from hivemind.p2p import PeerID

    from node.net.rpc import call_p2p

    async def call(peer_id: str, params: dict) -> object:
        if not await daemon.ensure_connected(peer_id, timeout=CHALLENGE_TIMEOUT_S):
            raise ConnectionError("unreachable at its advertised addresses")
        return await call_p2p(daemon.p2p, PeerID.from_base58(peer_id), method, params,
                              timeout=CHALLENGE_TIMEOUT_S)

    return call



def new_members_allowed(current_members: Iterable[str] | None) -> int | None:
    """How many non-members a new epoch may add: unlimited (None) for the first epoch of a swarm,
    whose founders start together, else :data:`MAX_NEW_MEMBERS_PER_EPOCH`."""
    return None if current_members is None else MAX_NEW_MEMBERS_PER_EPOCH


def silent_drop_bound_s(members: int, heartbeat_s: float) -> float:
    """Longest time from a member's going silent to its drop, with ``members`` other epoch members and
    a round every ``heartbeat_s``: a round lasts at most ``heartbeat_s`` + :data:`CHALLENGE_TIMEOUT_S`
    (one wave, whatever the number of candidates), a member is probed at least every
    ``P = max(MEMBER_PROBE_EVERY_S + round, ceil(members / MAX_PROBES_PER_ROUND) * round)``, and it is
    dropped at the first probe that finds :data:`SILENT_AFTER_PROBES` failures spanning
    :data:`SILENT_AFTER_S`: ``P + max((SILENT_AFTER_PROBES - 1) * P, SILENT_AFTER_S + P)``."""
    round_s = heartbeat_s + CHALLENGE_TIMEOUT_S
    every = max(MEMBER_PROBE_EVERY_S + round_s, math.ceil(members / MAX_PROBES_PER_ROUND) * round_s)
    return every + max((SILENT_AFTER_PROBES - 1) * every, SILENT_AFTER_S + every)


@dataclass
class _Failures:
    count: int
    since: float


class Admission:
    """Challenges candidates, probes members, and answers other nodes' challenges."""

    def __init__(self, self_id: str, config_digest: str, call: Callable[[str, dict], Awaitable[object]],
                 stages: Callable[[], tuple], log: logging.LoggerAdapter | logging.Logger = logger,
                 iteration: Callable[[], int | None] = lambda: None, epoch_start: Callable[[], int] = lambda: 0,
                 ready: Callable[[], bool] = lambda: True, reachable: Callable[[str], bool] = lambda peer: True,
                 sketch: Callable[[int, bytes], Awaitable[list | None]] | None = None,
                 replicas: Callable[[int], list] = lambda stage: [],
                 ask_replica: Callable[[str, dict], Awaitable[object]] | None = None,
                 is_member: Callable[[str], bool] = lambda peer: True):
        """``call(peer, params)``: the ``admit`` RPC to ``peer`` (raises on failure); ``iteration()``: the
        iteration this node's trainer last committed, None when it is not training; ``epoch_start()``: the
        first iteration of the current epoch (members are held to our progress only past it); ``ready()``:
        False while this node knows it cannot train (its last join found no state it could verify);
        ``reachable(peer)``: False when no connection between us can exist (both behind NAT, no relay).
        Such a member is not probed: its failed probe would say nothing about whether it is alive (the
        nodes that can reach it probe it), and counting it silent would make this node's trainer wait
        for a stage replica that is training all along. ``sketch(stage, nonce)``: this node's stage probe
        sketch (:mod:`node.dataplane.probe`) of ``stage``, None when it holds no such stage (None: no stage
        probe at all); ``replicas(stage)``: the peers of the adopted epoch holding ``stage``;
        ``ask_replica(peer, params)``: the ``stage_probe`` RPC to one of them (raises on failure);
        ``is_member(peer)``: whether ``peer`` is a member of the adopted epoch (only members get sketches)."""
        self.self_id, self.config_digest = self_id, config_digest
        self._call, self._stages, self._log = call, stages, log
        self._iteration, self._epoch_start, self._ready = iteration, epoch_start, ready
        self._reachable = reachable
        self._sketch, self._replicas, self._ask_replica, self._is_member = sketch, replicas, ask_replica, is_member
        self._probe_slots = asyncio.Semaphore(MAX_CONCURRENT_STAGE_PROBES)
        self._vouched: dict[str, float] = {}  # peer -> when it answered a challenge the state server asked for
        self._vouch_failed: dict[str, float] = {}
        #: candidate -> the stage it was admitted on its probe's shape alone (no replica to compare with)
        self.trusted_alone: dict[str, int] = {}
        self._drops: dict[str, int] = {}  # peer -> times dropped as silent or not training
        self._members: set[str] = set()  # the epoch members of the last round
        self.admitted: dict[str, float] = {}  # peer -> when it answered its first challenge
        self.silent: set[str] = set()
        self.left_out: dict[str, str] = {}  # peer -> why (never admitted again)
        self._retry_at: dict[str, float] = {}
        self._failures: dict[str, _Failures] = {}
        self._probed_at: dict[str, float] = {}
        self._asked_at: dict[str, float] = {}  # candidate -> when its last challenge was sent
        self._in_flight: set[str] = set()
        self._semaphore = asyncio.Semaphore(MAX_CONCURRENT_CHALLENGES)
        #: Challenges answered / failed (status and tests).
        self.answered = 0
        self.failed = 0
        #: Candidates refused because their stage probe disagreed with a live replica's (status and tests).
        self.probe_refused = 0

    # ------------------------------------------------------------------ verdicts
    def same_config(self, advert) -> bool:
        return str(getattr(advert, "config_digest", "")) == self.config_digest

    def may_join(self, peer_id: str, advert) -> bool:
        """May this advert's peer be in an epoch this node issues (as a member it already is, or admitted)?
        Not while its advert says it cannot train (``ready``), which reaches even a coordinator that cannot probe it."""
        return (peer_id == self.self_id or peer_id not in self.silent and peer_id not in self.left_out
                and self.same_config(advert) and bool(getattr(advert, "ready", True)))

    def is_admitted(self, peer_id: str) -> bool:
        return peer_id == self.self_id or peer_id in self.admitted

    def leave_out(self, peer_id: str, reason: str) -> None:
        if peer_id != self.self_id and peer_id not in self.left_out:
            self.left_out[peer_id] = reason
            self.admitted.pop(peer_id, None)
            _bound(self.left_out)
            self._log.warning("leaving %s out of the run: %s", peer_id[-8:], reason)

    # ------------------------------------------------------------------ answering
    def answer(self, params: dict) -> dict:
        """The reply to another node's challenge (without its stage probe: :meth:`answer_challenge`)."""
        nonce = params.get("nonce") if isinstance(params, dict) else None
        return {"nonce": str(nonce)[:MAX_NONCE_CHARS], "peer_id": self.self_id, "config_digest": self.config_digest,
                "stages": list(self._stages()), "iteration": self._safe_iteration(), "ready": bool(self._ready())}

    async def answer_challenge(self, params: dict) -> dict:
        """The ``admit`` RPC: :meth:`answer`, and with ``probe: stage`` this node's stage probe sketch of that
        stage under the challenge's nonce (None when it holds no such stage)."""
        reply = self.answer(params)
        stage = params.get("probe") if isinstance(params, dict) else None
        if stage is not None:
            reply["probe"] = await self._own_sketch(stage, params.get("nonce")) if self._asked_by_member(params) \
                else None
        return reply

    async def reference(self, params: dict) -> dict:
        """The ``stage_probe`` RPC: this node's sketch of ``stage`` under ``nonce``, for a challenger that does
        not hold the stage itself (None when this node holds no such stage)."""
        if not isinstance(params, dict):
            raise ValueError("params must be a map")
        if not self._asked_by_member(params):
            raise PermissionError("stage probes answer members of the current epoch only")
        return {"sketch": await self._own_sketch(params.get("stage"), params.get("nonce"))}

    def _asked_by_member(self, params: dict) -> bool:
        """Is the libp2p caller a member of the adopted epoch (or the local operator, who has no caller id)?
        Sketches answer members only: a candidate that could ask a replica (or another candidate) for the
        sketch under its challenger's nonce would pass the probe by relaying, without holding the stage."""
        from node.net.rpc import CALLER_PARAM

        caller = params.get(CALLER_PARAM)
        return caller is None or (isinstance(caller, str) and self._is_member(caller))

    async def _own_sketch(self, stage: object, nonce: object) -> list | None:
        """This node's sketch of ``stage`` under the hex ``nonce``; None for anything malformed, a stage not
        held here, or a probe that fails or takes longer than :data:`STAGE_PROBE_TIMEOUT_S`."""
        raw = _nonce_bytes(nonce)
        if self._sketch is None or raw is None or isinstance(stage, bool) or not isinstance(stage, int) \
                or not 0 <= stage < MAX_STAGE_INDEX:
            return None
        try:
            async with self._probe_slots:
                sketch = await asyncio.wait_for(self._sketch(stage, raw), STAGE_PROBE_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a probe that cannot run answers nothing
            self._log.debug("stage probe of stage %s failed: %r", stage, e)
            return None
        return list(sketch) if sketch is not None else None

    def _safe_iteration(self) -> int | None:
        try:
            it = self._iteration()
        except Exception:  # noqa: BLE001 - a broken hook must not break admission
            return None
        return it if isinstance(it, int) and not isinstance(it, bool) and it >= 0 else None

    def _lag(self, reply: dict, ours: int | None, member: bool) -> str | None:
        """Why the peer's reported progress disqualifies it (stale or not training), or None.
        ``ours``: the iteration we had committed before asking."""
        if reply.get("ready") is False:
            return NOT_READY
        if ours is None:
            return None  # we are not training: nothing to compare with
        theirs = reply.get("iteration")
        if isinstance(theirs, bool) or not isinstance(theirs, int):
            theirs = None
        if member:
            if ours < self._epoch_start():
                return None  # the epoch's first iteration is not committed yet: a joiner may still be loading
            if theirs is None:
                return f"not training (we committed iteration {ours})"
        elif theirs is None:
            return None  # not training yet: a joiner, which takes verified state at its boundary
        if theirs < ours - MAX_LAG_ITERATIONS:
            return f"training iteration {theirs}, we committed {ours}: stale"
        return None

    # ------------------------------------------------------------------ asking
    async def round(self, candidates: list, members: Iterable[str]) -> bool:
        """Challenge due ``candidates`` (view entries not yet admitted) and probe due ``members``;
        True when a verdict changed (someone admitted, silent, or back)."""
        now = time.monotonic()
        members = [m for m in members if m != self.self_id]
        for gone in self._members.difference(members):  # out of the epoch: back in only by a fresh challenge
            self.admitted.pop(gone, None)
        self._members = set(members)
        asks = [(e.peer_id, e.advert) for e in candidates
                if e.peer_id != self.self_id and e.peer_id not in self.admitted and e.peer_id not in members
                and e.peer_id not in self.left_out and self.same_config(e.advert)
                and self._retry_at.get(e.peer_id, 0.0) <= now]  # a silent peer may earn its way back
        asks.sort(key=lambda a: (self._asked_at.get(a[0], -math.inf), secrets.randbits(32)))
        asks = asks[:MAX_CHALLENGES_PER_ROUND]  # round-robin over the candidates, never-asked first
        for peer_id, _ in asks:
            self._asked_at[peer_id] = now
        _bound(self._asked_at)
        unreachable = {m for m in members if not self._reachable(m)}
        cleared = unreachable & self.silent  # made silent before we knew no probe of ours could reach it
        for m in unreachable:
            self.silent.discard(m)
            self._failures.pop(m, None)
        probes = sorted((m for m in members if m not in unreachable
                         and now - self._probed_at.get(m, -1e9) >= MEMBER_PROBE_EVERY_S),
                        key=lambda m: self._probed_at.get(m, -1e9))[:MAX_PROBES_PER_ROUND]
        # an epoch trains (and so do we): a candidate proves its stage against the replicas; before the start
        # barrier, and after the run's end, there are no trained weights to prove
        running = bool(members) and self._safe_iteration() is not None
        jobs = [self._admit(p, a, running) for p, a in asks if p not in self._in_flight]
        jobs += [self._probe(m) for m in probes if m not in self._in_flight]
        if not jobs:
            return bool(cleared)
        return any(await asyncio.gather(*jobs)) or bool(cleared)

    async def _challenge(self, peer_id: str, member: bool = False, stage: int | None = None) -> str | None:
        """None when ``peer_id`` answered correctly (and its progress is in step with ours, and with ``stage``
        its stage probe agrees with a live replica's), else why not."""
        ours = self._safe_iteration()
        self._in_flight.add(peer_id)
        nonce = secrets.token_hex(16)
        params: dict = {"nonce": nonce} if stage is None else {"nonce": nonce, "probe": stage}
        try:
            async with self._semaphore:
                try:
                    reply = await asyncio.wait_for(self._call(peer_id, params), CHALLENGE_TIMEOUT_S)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - unreachable or lying peers are routine here
                    return f"no answer ({type(e).__name__})"
        finally:
            self._in_flight.discard(peer_id)
        if not isinstance(reply, dict) or reply.get("nonce") != nonce or reply.get("peer_id") != peer_id:
            return "wrong answer"
        if reply.get("config_digest") != self.config_digest:
            return "trains another configuration"
        why = self._lag(reply, ours, member)
        if why is None and stage is not None:
            why = await self._check_probe(peer_id, stage, nonce, reply.get("probe"))
        return why

    def _probed_stage(self, advert, running: bool) -> int | None:
        """The stage a candidate must prove (see the module docstring), or None."""
        if self._sketch is None or not running:
            return None
        stages = tuple(getattr(advert, "stages", ()) or ())
        return stages[0] if len(stages) == 1 and isinstance(stages[0], int) else None

    async def _check_probe(self, peer_id: str, stage: int, nonce: str, answer: object) -> str | None:
        """None when the candidate's stage probe sketch agrees with a live replica's, else why not. We are the
        reference when we hold the stage; else the epoch's other replicas are asked in peer-id order (at most
        :data:`MAX_REFERENCE_ASKS`) until one agrees: a lying replica can then vouch for a colluder (no worse
        than the liar itself, a member already) but cannot keep an honest candidate out."""
        from node.dataplane.probe import PROBE_TOLERANCE, check_sketch, sketches_close

        if answer is None:
            if stage in tuple(self._stages()) or any(p not in (peer_id, self.self_id) for p in self._replicas(stage)):
                return PROOF_PENDING
            # no live replica holds the stage (it is missing: training paused for it): there is no state to
            # take or to compare with, and a node that brings the stage back (from its checkpoint) is wanted
            return self._trust_alone(peer_id, stage, "no live replica holds the stage")
        theirs = check_sketch(answer)
        if theirs is None:
            self.probe_refused += 1
            return f"its stage {stage} probe answer is malformed or not finite"
        raw, compared = bytes.fromhex(nonce), []
        async for whom, ours in self._reference_sketches(stage, raw, peer_id):
            ok, distance = sketches_close(theirs, ours)
            if ok:
                self.trusted_alone.pop(peer_id, None)
                return None
            compared.append(f"{distance:.2f} from {whom[-8:]}'s")
        if compared:
            self.probe_refused += 1
            return (f"its stage {stage} probe is {', '.join(compared)} (tolerance {PROBE_TOLERANCE}): it does not "
                    "hold the stage's weights")
        return self._trust_alone(peer_id, stage, "no live replica of the stage answered a probe to compare with")

    def _trust_alone(self, peer_id: str, stage: int, why: str) -> None:
        """Admit ``peer_id`` on its word for ``stage`` (logged once, listed in ``trusted_alone``)."""
        if self.trusted_alone.get(peer_id) != stage:
            self._log.warning("admitting %s for stage %d without comparing its weights: %s", peer_id[-8:], stage, why)
        self.trusted_alone[peer_id] = stage
        _bound(self.trusted_alone)
        return None

    async def _reference_sketches(self, stage: int, nonce: bytes, candidate: str):
        """``(replica, sketch)`` of live replicas of ``stage`` under ``nonce``: ours alone when we hold the
        stage, else those of up to :data:`MAX_REFERENCE_ASKS` other replicas that answer (peer-id order)."""
        from node.dataplane.probe import check_sketch

        own = await self._own_sketch(stage, nonce.hex())
        if own is not None:
            yield self.self_id, own
            return
        if self._ask_replica is None:
            return
        # a replica no connection to can exist (behind NAT, like this node) could only time out
        others = sorted(p for p in set(self._replicas(stage)) if p not in (candidate, self.self_id) and self._reachable(p))
        for replica in others[:MAX_REFERENCE_ASKS]:
            try:
                reply = await asyncio.wait_for(self._ask_replica(replica, {"stage": stage, "nonce": nonce.hex()}),
                                               CHALLENGE_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - ask the next replica
                self._log.debug("no stage %d probe reference from %s: %r", stage, replica[-8:], e)
                continue
            sketch = check_sketch(reply.get("sketch")) if isinstance(reply, dict) else None
            if sketch is not None:
                yield replica, sketch

    async def vouch(self, peer_id: str) -> bool:
        """For the state server: did ``peer_id`` (no member) answer a challenge with this run's configuration
        within :data:`VOUCHED_FOR_S`? Asked now when not (at most once per :data:`RETRY_AFTER_S` after a
        failure); the stage probe is not part of it, since the state is what the candidate needs to answer one."""
        now = time.monotonic()
        if peer_id == self.self_id or peer_id in self.admitted or now - self._vouched.get(peer_id, -math.inf) \
                < VOUCHED_FOR_S:
            return True
        if peer_id in self.left_out or self._vouch_failed.get(peer_id, -math.inf) > now - RETRY_AFTER_S:
            return False
        why = await self._challenge(peer_id)
        table = self._vouched if why is None else self._vouch_failed
        table.pop(peer_id, None)
        table[peer_id] = time.monotonic()
        _bound(table)
        if why is not None:
            self._log.info("not serving stage state to %s: %s", peer_id[-8:], why)
        return why is None

    async def _admit(self, peer_id: str, advert, running: bool = False) -> bool:
        why = await self._challenge(peer_id, stage=self._probed_stage(advert, running))
        if why is not None:
            self.failed += 1
            self._retry_at[peer_id] = time.monotonic() + (PROOF_PENDING_RETRY_S if why == PROOF_PENDING
                                                          else RETRY_AFTER_S)
            _bound(self._retry_at)
            self._log.debug("not admitting %s: %s", peer_id[-8:], why)
            return False
        self.answered += 1
        self.silent.discard(peer_id)
        self.admitted[peer_id] = time.monotonic()
        self._retry_at.pop(peer_id, None)
        _bound(self.admitted)
        self._log.info("admitted %s (stages %s): it answered its challenge", peer_id[-8:], list(advert.stages))
        return True

    async def _probe(self, peer_id: str) -> bool:
        self._probed_at[peer_id] = time.monotonic()
        _bound(self._probed_at)
        why = await self._challenge(peer_id, member=True)
        now = time.monotonic()
        if why is None:
            self._failures.pop(peer_id, None)
            if peer_id in self.silent:
                self.silent.discard(peer_id)
                self._log.info("member %s answers again", peer_id[-8:])
                return True
            return False
        failures = self._failures.setdefault(peer_id, _Failures(0, now))
        failures.count += 1
        _bound(self._failures)
        own_word = why == NOT_READY  # "I cannot train", in its own signed-in answer: no need to wait for proof
        if peer_id not in self.silent and (own_word or failures.count >= SILENT_AFTER_PROBES
                                           and now - failures.since >= SILENT_AFTER_S):
            self.silent.add(peer_id)
            self.admitted.pop(peer_id, None)
            drops = self._drops[peer_id] = self._drops.pop(peer_id, 0) + 1
            _bound(self._drops)
            self._retry_at[peer_id] = now + min(DROPPED_RETRY_S * 2 ** (drops - 1), MAX_DROPPED_RETRY_S)
            self._log.warning("member %s is silent (%d probes failed over %.0f s, last: %s): leaving it out",
                              peer_id[-8:], failures.count, now - failures.since, why)
            return True
        return False

    def status(self) -> dict:
        return {"admitted": len(self.admitted), "silent": sorted(p[-8:] for p in self.silent)[:16],
                "left_out": sorted(p[-8:] for p in self.left_out)[:16], "answered": self.answered,
                "failed": self.failed, "probe_refused": self.probe_refused,
                "trusted_alone": sorted(p[-8:] for p in self.trusted_alone)[:16]}


def _nonce_bytes(nonce: object) -> bytes | None:
    """A challenge nonce (hex, at most :data:`MAX_NONCE_CHARS` characters) as bytes, or None."""
    if not isinstance(nonce, str) or not 0 < len(nonce) <= MAX_NONCE_CHARS:
        return None
    try:
        return bytes.fromhex(nonce)
    except ValueError:
        return None


def _bound(table: dict) -> None:
    """Forget the oldest entries (insertion order) beyond :data:`MAX_TRACKED`."""
    while len(table) > MAX_TRACKED:
        table.pop(next(iter(table)))
