"""A candidate's proof that it holds its stage: the stage's verified state, held before any epoch names it.

Admission (:mod:`node.swarm.admission`) asks a candidate to run its stage on a probe input
(:mod:`node.dataplane.probe`) and compares the answer with a live replica's. A fresh joiner holds only
the run's initial weights, so it first takes its stage's state from the replicas of the adopted epoch,
checked against the other replicas exactly as a join does (``fetch_verified_state``), and keeps it
fresh: it downloads again each time the replicas should have trained :data:`PROOF_MAX_LAG_STEPS` steps
since (at the pace measured between its downloads, at most every :data:`PROOF_REFRESH_S`) while it waits
to be admitted, because the replicas train on and the probe admits only a few dozen steps of lag. Once
a trainer of this node trains the stage, the trainer's own weights answer and the proof is not refreshed.

This costs the replicas one state download per candidate per refresh while it waits; the state servers
bound that per requester and in total (:mod:`node.dataplane.state_transfer`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, List, Optional, Sequence

from node.train.common import NodeLog
from node.dataplane.probe import stage_sketch
from node.train.relay_link import reaches_or_relayed, state_route

__all__ = ["StageAccess", "StageProof", "PROOF_REFRESH_S", "PROOF_MAX_LAG_STEPS", "stage_replicas", "proof_for",
           "held_sketch"]

logger = logging.getLogger(__name__)

#: Optimizer steps the proof state may fall behind the replicas before it is downloaded again: the probe
#: admits about 20-40 steps of lag (:data:`node.dataplane.probe.PROBE_TOLERANCE`; 10 steps measured at most
#: 0.2 of it), so 10 leaves room for the download itself and for the time until the next challenge.
PROOF_MAX_LAG_STEPS = 10
#: Fewest seconds between two downloads (a small model trains several steps per second: without a floor
#: a candidate would download continuously).
PROOF_REFRESH_S = 3.0
#: Most seconds between two downloads, whatever the measured pace (a stalled run still moves on later).
MAX_PROOF_REFRESH_S = 300.0
#: Seconds between two looks at the adopted epoch while no replica of the stage is known.
IDLE_POLL_S = 1.0


def stage_replicas(epoch, stage: int, exclude: str = "") -> List[str]:
    """Peer ids of ``epoch``'s members that hold ``stage`` (by its schedule), without ``exclude``."""
    if epoch is None:
        return []
    stages = (epoch.schedule or {}).get("stages") or []
    if not 0 <= stage < len(stages):
        return []
    members = list(epoch.members)
    return [members[v] for v in stages[stage] if isinstance(v, int) and 0 <= v < len(members)
            and members[v] != exclude]


class StageProof:
    """The verified state of one stage, downloaded and refreshed while this node is a candidate."""

    def __init__(self, cfg, stage: int, *, peer_id: str, p2p, dht, epoch: Callable[[], object],
                 node_name: Optional[str] = None, wanted: Callable[[], bool] = lambda: True,
                 stage_now: Optional[Callable[[], Optional[int]]] = None,
                 reaches: Optional[Callable[[str], bool]] = None, via: Optional[Callable[[str], Optional[str]]] = None):
        """``epoch()``: the host's adopted schedule epoch (whose replicas of ``stage`` serve the state);
        ``wanted()``: False while no proof is needed (a trainer of this node holds the stage, or the epoch
        names this node): nothing is downloaded then; ``stage_now()``: the stage the node advertises now (a
        moved node proves its new stage; the old stage's state is dropped); ``reaches(peer)``: False for a replica
        no connection to can exist (behind NAT like this node): asked last, as it can only back a state by its
        sketch in the DHT, never hand one over, unless ``via(peer)`` names a relay to ask it through."""
        self.cfg, self.stage, self.peer_id = cfg, stage, peer_id
        self.p2p, self.dht, self._epoch, self._wanted = p2p, dht, epoch, wanted
        self._stage_now = stage_now
        self._reaches = reaches or (lambda peer: True)
        self._via = via
        self.log = NodeLog(logger, node_name)
        self.module = None  # the stage with the last verified state, None until one was taken
        self.iteration: Optional[int] = None
        self.fetched_at: Optional[float] = None
        self.last_error: Optional[str] = None
        self._task: Optional[asyncio.Task] = None
        self._pace: Optional[float] = None  # the replicas' steps per second, from the last two downloads
        self._lock = asyncio.Lock()  # a sketch never reads weights a refresh is loading

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._keep_fresh(), name="stage-proof")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping
                pass
            self._task = None
        self.module = None

    async def sketch(self, nonce: bytes) -> Optional[List[float]]:
        """The probe's sketch on the proof state (off the event loop), None while no state is held."""
        module = self.module
        if module is None:
            return None
        d_model = self.cfg.model.d_model
        async with self._lock:
            return await asyncio.get_running_loop().run_in_executor(None, stage_sketch, module, nonce, d_model)

    def _follow_stage(self) -> None:
        stage = self._stage_now() if self._stage_now is not None else self.stage
        if stage is not None and stage != self.stage:
            self.stage, self.module, self.iteration, self.fetched_at, self._pace = stage, None, None, None, None

    def sources(self, epoch) -> List[str]:
        """The replicas of our stage in ``epoch`` to download from, those we can be connected to first."""
        fetchable = reaches_or_relayed(self._reaches, self._via)
        return sorted(stage_replicas(epoch, self.stage, exclude=self.peer_id), key=lambda p: not fetchable(p))

    async def _keep_fresh(self) -> None:
        while True:
            self._follow_stage()
            epoch = self._epoch()
            replicas = self.sources(epoch)
            if not replicas or not self._wanted() or self.peer_id in getattr(epoch, "members", ()):
                await asyncio.sleep(IDLE_POLL_S)
                continue
            try:
                await self.refresh(replicas)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - retried at the next refresh; admission waits meanwhile
                self.last_error = str(e)[:300]
                self.log.info("no proof state for stage %d yet: %s", self.stage, self.last_error)
            await asyncio.sleep(self.refresh_after_s())

    def refresh_after_s(self) -> float:
        """Seconds until the next download: the time the replicas take for :data:`PROOF_MAX_LAG_STEPS` steps
        at the pace measured between the last two downloads, within [:data:`PROOF_REFRESH_S`,
        :data:`MAX_PROOF_REFRESH_S`] (the floor before two downloads): a large model, whose steps take
        long, is downloaded rarely."""
        if self._pace is None or self._pace <= 0:
            return PROOF_REFRESH_S
        return min(max(PROOF_MAX_LAG_STEPS / self._pace, PROOF_REFRESH_S), MAX_PROOF_REFRESH_S)

    async def refresh(self, replicas: Sequence[str]) -> None:
        """Download the stage's state from ``replicas`` (verified against the others) and hold it."""
        from node.dataplane.state_codec import ExpectedState
        from node.dataplane.state_transfer import fetch_verified_state
        from node.train.model import build_stage

        module, stage = self.module, self.stage
        if module is None:
            module = await asyncio.get_running_loop().run_in_executor(
                None, build_stage, self.cfg.model, stage, self.cfg.seed)
        snap, verdict = await fetch_verified_state(
            self.p2p, self.cfg.run_id, list(replicas), stage, -1, expected=ExpectedState.of_module(module),
            timeout_s=self.cfg.state_fetch_timeout_s, dht=self.dht, via=self._via)
        async with self._lock:
            if stage != self.stage:
                return  # the node moved to another stage meanwhile: this state proves nothing now
            await self._load(module, snap.state["model"])
        first, now = self.module is None, time.monotonic()
        if self.iteration is not None and self.fetched_at is not None and now > self.fetched_at:
            self._pace = max(snap.iteration - self.iteration, 0) / (now - self.fetched_at)  # steps per second
        self.module, self.iteration, self.fetched_at, self.last_error = module, snap.iteration, now, None
        (self.log.info if first else self.log.debug)(
            "holding stage %d's state of iteration %d from %s as admission proof (backed by %d replica(s))",
            self.stage, snap.iteration, verdict.source[-8:], len(verdict.agree))

    async def _load(self, module, weights: dict) -> None:
        await asyncio.get_running_loop().run_in_executor(None, module.load_state_dict, weights)


def advertised_stage(cfg, host) -> Optional[int]:
    """The one stage ``host`` advertises now (an ``--auto`` node's changes when an epoch moves it), or None when
    it advertises several (such a candidate is not probed, see :mod:`node.swarm.admission`)."""
    stages = tuple(getattr(host, "stages", ()) or ())
    if len(stages) != 1 or not 0 <= int(stages[0]) < cfg.model.n_stages:
        return None
    return int(stages[0])


def proof_for(cfg, host, node_name: Optional[str], wanted: Callable[[], bool]) -> Optional[StageProof]:
    """The proof of the stage ``host`` advertises, following it when it changes (None: it advertises several)."""
    stage = advertised_stage(cfg, host)
    if stage is None:
        return None
    return StageProof(cfg, stage, peer_id=str(host.peer_id), p2p=host.p2p, dht=host.dht,
                      epoch=lambda: host.current_epoch, node_name=node_name, wanted=wanted,
                      stage_now=lambda: advertised_stage(cfg, host), reaches=host.reaches_directly,
                      via=state_route(host))


async def held_sketch(stage: int, nonce: bytes, trainer, trains: bool, proof: Optional[StageProof],
                      d_model: int) -> Optional[List[float]]:
    """This node's probe sketch of ``stage``: its trainer's weights while it ``trains`` that stage (on the
    trainer's compute thread, between its steps), else its proof state, else None."""
    runtime = trainer.runtime if trainer is not None and trains else None
    if runtime is not None and runtime.stage == stage:
        return await trainer.pipeline.compute(lambda: stage_sketch(runtime.module, nonce, d_model))
    if proof is not None and proof.stage == stage:
        return await proof.sketch(nonce)
    return None


class StageAccess:
    """Who may talk to this trainer (``host.is_peer_allowed``, called per stream and frame), plus ``vouch``:
    whether a non-member passed the host's admission challenge (the state server serves such a candidate its
    stage's state as proof; :mod:`node.dataplane.state_transfer`). Hosts without admission vouch for nobody."""

    def __init__(self, host):
        self._host = host

    def __call__(self, peer_id: str) -> bool:
        return self._host.is_peer_allowed(peer_id)

    async def vouch(self, peer_id: str) -> bool:
        admission = getattr(self._host, "admission", None)
        return bool(await admission.vouch(peer_id)) if admission is not None else False
