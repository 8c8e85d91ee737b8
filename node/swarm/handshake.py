"""Which run a node serves and which stages it holds: founding, the ``hello`` handshake, stage choice.

A founding node fixes the run configuration from its flags; a joiner asks an initial peer for it
(``hello``), so every member trains the same stage count and path length, and a wrong run id or
protocol version stops the joiner with one clear line instead of a swarm that silently disagrees.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Sequence

from hivemind.p2p import P2P, PeerID

from node.errors import UserError
from node.net.access import HELLO_PROOF_PARAM, SwarmAccess
from node.net.rpc import RpcCallError, call_p2p
from node.net.runconfig import summary_differences
from node.swarm.config import DaemonConfig
from node.swarm.coordinator import RunConfig
from node.swarm.replan import auto_stage
from node.swarm.view import SwarmView
from protocol.messages import Reachability
from scheduler.reachability import stranded_stages

__all__ = ["DEFAULT_NUM_STAGES", "HelloReply", "founding_run_config", "handshake", "check_training_summary",
           "choose_stages", "services_summary", "stage_reachability", "stranded_warning", "complete_the_view"]

logger = logging.getLogger(__name__)

#: Default number of stages of a new swarm when neither --stages nor --num-stages says.
DEFAULT_NUM_STAGES = 2
#: Extra DHT reads an ``--auto`` joiner makes while a model stage looks unheld. A read right after joining
#: can miss a stage's record (a NATed joiner saw ``[2, 1, 2, 0]`` where stage 3 had a replica, took the
#: stage and could reach nobody to download it from); an empty stage in a running swarm is rare, so a miss
#: is likelier than the truth until a few reads agree.
AUTO_VIEW_REREADS = 3
#: Seconds between those reads: a DHT lookup retried at once tends to ask the same peers.
AUTO_VIEW_REREAD_PAUSE_S = 2.0
#: Rounds of ``hello`` over all initial peers before a joiner gives up. A busy initial peer (a founder
#: on two cores beside five other starting daemons) has closed a hello stream unanswered; a round later
#: it answers. A refusal (access denied, wrong run, wrong version) is an answer and is never retried.
HELLO_ROUNDS = 3
#: Seconds between rounds: long enough for a peer that is starting its services to finish.
HELLO_ROUND_PAUSE_S = 2.0


@dataclass(frozen=True)
class HelloReply:
    """What the initial peer said: the run configuration, who said it, and the training summary it trains
    (None when it does not train, or for a founding node, which asked nobody)."""

    run: RunConfig
    peer_id: str = ""
    training: dict | None = None


def check_training_summary(mine: dict | None, reply: HelloReply) -> None:
    """Refuse to join a run that trains something else: one error line naming every differing field,
    before this node announces itself (so it never becomes a candidate member, let alone stops the run)."""
    if mine is None or reply.training is None:
        return
    diff = summary_differences(mine, reply.training)
    if diff:
        raise UserError(f"training configuration differs from the run's (as {reply.peer_id[-8:] or 'the initial peer'} "
                        f"trains it): " + "; ".join(diff) + " (pass the flags the founder's banner prints)")


def services_summary(services: Sequence, run: RunConfig, reply: HelloReply | None) -> dict | None:
    """What this node trains in ``run`` (the first service with a ``run_summary(run)``; None: nothing),
    checked against the initial peer's (:func:`check_training_summary`) when it joined through one."""
    summaries = [s.run_summary(run) for s in services if callable(getattr(s, "run_summary", None))]
    summary = summaries[0] if summaries else None
    if reply is not None:
        check_training_summary(summary, reply)
    return summary


def founding_run_config(cfg: DaemonConfig) -> RunConfig:
    """The run configuration a founding node chooses from its flags."""
    if cfg.num_stages is not None:
        num_stages = cfg.num_stages
    elif cfg.stages:
        num_stages = max(max(cfg.stages) + 1, DEFAULT_NUM_STAGES)
    else:
        num_stages = DEFAULT_NUM_STAGES
    if num_stages < 1:
        raise UserError("--num-stages must be at least 1")
    path_length = cfg.path_length if cfg.path_length is not None else num_stages
    if not 1 <= path_length <= num_stages:
        raise UserError(f"--path-length must be between 1 and the number of stages ({num_stages})")
    if cfg.microbatches_per_data_node < 1:
        raise UserError("--microbatches must be at least 1")
    return RunConfig(num_stages, path_length, cfg.microbatches_per_data_node, cfg.schedule_policy, cfg.location_cost)


async def handshake(p2p: P2P, cfg: DaemonConfig, access: SwarmAccess, peer_id: str, protocol_version: int,
                    initial_ids: Sequence[PeerID], log: logging.LoggerAdapter | logging.Logger = logger,
                    rounds: int = HELLO_ROUNDS, round_pause_s: float = HELLO_ROUND_PAUSE_S) -> HelloReply:
    """Ask the initial peers which run they serve; refuse a wrong run id or protocol version.

    Peers that fail to answer (closed stream, timeout, unreachable) are asked again, up to ``rounds``
    rounds ``round_pause_s`` apart; the error line names each peer's last failure.
    """
    errors: dict[str, str] = {}
    for round_no in range(max(1, rounds)):
        if round_no:
            log.info("no initial peer answered hello (%s); asking again in %.0f s",
                     "; ".join(errors.values()), round_pause_s)
            await asyncio.sleep(round_pause_s)
        for maddr, initial_id in zip(cfg.initial_peers, initial_ids):
            try:
                return await _hello(p2p, cfg, access, peer_id, protocol_version, maddr, initial_id, log)
            except _NoAnswer as e:
                errors[maddr] = f"{maddr}: {e}"
    raise UserError("no initial peer answered the handshake: " + "; ".join(errors.values()))


class _NoAnswer(Exception):
    """An initial peer gave no usable answer (worth asking again, or asking another)."""


async def _hello(p2p: P2P, cfg: DaemonConfig, access: SwarmAccess, peer_id: str, protocol_version: int,
                 maddr: str, initial_id: PeerID, log: logging.LoggerAdapter | logging.Logger) -> HelloReply:
    """One ``hello`` to one initial peer: its reply, a :class:`UserError` for a refusal, or :class:`_NoAnswer`."""
    try:
        params = {"run_id": cfg.run_id, "protocol_version": protocol_version}
        proof = access.hello_proof(peer_id) if cfg.access_handshake else None
        if proof is not None:
            params[HELLO_PROOF_PARAM] = proof
        info = await call_p2p(p2p, initial_id, "hello", params, timeout=cfg.hello_timeout_s)
    except RpcCallError as e:
        if "access denied" in str(e):
            if not cfg.access_handshake:  # test knob: a modified client pushes on regardless
                log.warning("hello refused (%s); joining anyway without the handshake", e)
                return HelloReply(founding_run_config(cfg))
            raise UserError(f"{maddr} refused this node: {str(e).split('access denied: ', 1)[-1]}") from None
        raise _NoAnswer(str(e)) from None
    if not isinstance(info, dict) or "run_id" not in info:
        raise _NoAnswer("not a skippipe node")
    if info.get("protocol_version") != protocol_version:
        raise UserError(
            f"incompatible protocol version: {maddr} speaks v{info.get('protocol_version')}, "
            f"this node speaks v{protocol_version}; upgrade the older side"
        )
    if info["run_id"] != cfg.run_id:
        raise UserError(
            f"wrong run id: {maddr} serves run {info['run_id']!r}, not {cfg.run_id!r} (pass --run-id {info['run_id']})"
        )
    if not isinstance(info.get("run"), dict):
        raise _NoAnswer("it has no run configuration yet")
    try:
        run = RunConfig.from_json(info["run"])
    except (KeyError, TypeError, ValueError) as e:
        raise _NoAnswer(f"unreadable run configuration ({type(e).__name__})") from None
    if cfg.num_stages is not None and cfg.num_stages != run.num_stages:
        raise UserError(f"run {cfg.run_id!r} has {run.num_stages} stages, not {cfg.num_stages}")
    training = info.get("training")
    return HelloReply(run, str(info.get("peer_id") or "")[:100], training if isinstance(training, dict) else None)


def stage_reachability(view: SwarmView, num_stages: int) -> list[list[str]]:
    """Per stage, the advertised reachability of each live replica of it in ``view`` (this node left out)."""
    out: list[list[str]] = [[] for _ in range(num_stages)]
    for entry in view.alive():
        if entry.peer_id == view.self_id:
            continue
        for s in entry.advert.stages:
            if 0 <= s < num_stages:
                out[s].append(entry.advert.reachability)
    return out


def stranded_warning(stage: int, replicas: int, relayed: bool = False) -> str:
    """The one start-up line for a node behind NAT whose stage is held only by nodes behind NAT too; ``relayed``:
    a public member relays, so the stage's state and averaging go through public members instead."""
    fix = ("forward this node's port on the router and pass --announce-maddrs (see the reachability line), or pick "
           "another stage (--stages) or --auto")
    if relayed:
        return (f"stage {stage}: its {replicas} live replica(s) are all behind NAT like this node, so no direct "
                f"connection to them can exist: the stage's state comes through a relay and its averaging through a "
                f"public member (slower, and both load public volunteers); {fix}")
    return (f"stage {stage}: its {replicas} live replica(s) are all behind NAT like this node, so no connection to "
            f"them can exist: this node cannot take the stage's state from them, nor average gradients or re-sync "
            f"with them; {fix}")


def choose_stages(cfg: DaemonConfig, run: RunConfig, view: SwarmView,
                  log: logging.LoggerAdapter | logging.Logger = logger,
                  own_reachability: str = Reachability.UNKNOWN.value) -> tuple[int, ...]:
    """``--stages`` checked against the run, or with ``--auto`` the bottleneck stage (:func:`node.swarm.replan.auto_stage`:
    with ``--replan on``, by the replicas' measured capacity where they all advertise one; else the fewest live
    replicas) among the stages this node is not stranded on (``own_reachability``: what its dial-back found; a
    node behind NAT cannot be connected to replicas that are all behind NAT too). A node that ends up stranded
    anyway (pinned there, or every stage is such) is told so in one warning line."""
    reach = stage_reachability(view, run.num_stages)
    stranded = stranded_stages(own_reachability, reach)
    if cfg.stages is not None:
        bad = [s for s in cfg.stages if not 0 <= s < run.num_stages]
        if bad:
            raise UserError(f"stage(s) {bad} out of range: run {cfg.run_id!r} has stages 0..{run.num_stages - 1}")
        chosen = tuple(sorted(set(cfg.stages)))
    else:
        chosen = (_auto_stage(cfg, run, view, log, stranded),)
    relayed = any(entry.advert.relay for entry in view.alive() if entry.peer_id != view.self_id)
    for s in chosen:
        if s in stranded:
            log.warning("%s", stranded_warning(s, len(reach[s]), relayed))
    return chosen


async def complete_the_view(view: SwarmView, fetch_all, num_stages: int, rereads: int = AUTO_VIEW_REREADS,
                            pause_s: float = AUTO_VIEW_REREAD_PAUSE_S) -> None:
    """Before an ``--auto`` stage choice trusts ``view``: while some stage past 0 has no live replica in it,
    read every stage's adverts again (``fetch_all(num_stages)``, merged in), up to ``rereads`` times, until
    a read finds nobody new (a swarm that is still filling up costs one read)."""
    def some_stage_unheld() -> bool:
        return not all(stage_reachability(view, num_stages)[1:])

    for _ in range(rereads):
        if not some_stage_unheld():
            return
        await asyncio.sleep(pause_s)
        known = {entry.peer_id for entry in view.alive()}
        view.update_from_dht(await fetch_all(num_stages))
        if {entry.peer_id for entry in view.alive()} <= known:
            return


def _auto_stage(cfg: DaemonConfig, run: RunConfig, view: SwarmView, log: logging.LoggerAdapter | logging.Logger,
                stranded: Sequence[int]) -> int:
    counts = [0] * run.num_stages
    capacity = [0.0] * run.num_stages
    unmeasured = set()  # stages with a replica that advertises no measurement (start-up figures: another scale)
    for entry in view.alive():
        measured = entry.advert.measured_compute_s_per_sample_per_layer
        for s in entry.advert.stages:
            if 0 <= s < run.num_stages:
                counts[s] += 1
                if measured:
                    capacity[s] += 1.0 / measured
                else:
                    unmeasured.add(s)
    # measured speeds only with re-planning on: daemons sharing a host measure each other's contention (the
    # reason re-planning is off by default), and the coordinator plans with start-up figures then too
    measured_all = cfg.replan.enabled and all(counts[s] and s not in unmeasured for s in range(1, run.num_stages))
    stage = auto_stage(counts, capacity if measured_all else None, stranded)
    log.info("--auto picked stage %d (replicas per stage: %s%s%s)", stage, counts,
             ", measured capacity per stage: " + ", ".join(f"{c:.3g}" for c in capacity) if measured_all else "",
             f"; stages {list(stranded)} held only by nodes behind NAT like this one" if stranded else "")
    return stage
