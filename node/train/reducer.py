"""Reducer duties: a dialable node reduces the gradient all-reduce of a stage whose replicas nobody can dial.

Two replicas of one stage behind NAT (no port forward) can never be connected to each other, and hivemind's
all-reduce needs every part reduced by a peer that every sender reaches. When no replica of the stage can be
dialled, :func:`scheduler.reachability.averaging_reducers` names a dialable member of another stage as the
stage's reducer. It runs an auxiliary ``DecentralizedAverager`` on the stage's averaging prefix: it
contributes nothing, leads every group (the replicas join in client mode, over connections they open) and
reduces every part. What it holds is a zero tensor per parameter of that stage (float32), so the duty costs
the stage's gradient size in host memory, and its uplink carries the stage's all-reduce.

Every node computes the same reducers from the same epoch and adverts, so the replicas and the reducer agree
without a message; the duties are rebuilt at each epoch switch, like the replicas' averagers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Dict, List, Optional

import torch

from node.train.averaging import StageAverager, averager_prefix
from scheduler.reachability import averaging_reducers

__all__ = ["stage_reducers", "gradient_shapes", "StageReducers", "REDUCER_RETRY_PAUSE_S"]

logger = logging.getLogger(__name__)

#: Pause after a reducer window that failed at once (hivemind refusing a step, not a window without a
#: group, which already took its round window): keeps a broken averager from spinning the loop.
REDUCER_RETRY_PAUSE_S = 1.0


def stage_reducers(epochs, reachability_of: Optional[Callable[[str], str]]) -> Dict[int, str]:
    """Stage -> reducer of the current epoch (:func:`scheduler.reachability.averaging_reducers`) from its
    stage assignment and each member's advertised reachability (None: unknown, so no stage needs one)."""
    if reachability_of is None:
        return {}
    stage_of = {epochs.members[n]: s for s, nodes in enumerate(epochs.plan.stages) for n in nodes}
    return averaging_reducers(stage_of, {p: reachability_of(p) for p in stage_of})


def gradient_shapes(model_cfg, stage: int) -> List[torch.Tensor]:
    """Float32 tensors on the meta device shaped like ``stage``'s gradients, in ``parameters()`` order (the
    order the replicas average in); built without allocating the stage."""
    from node.train.model import StageModule

    with torch.device("meta"):
        module = StageModule(model_cfg, stage)
    return [torch.empty(p.shape, dtype=torch.float32, device="meta") for p in module.parameters()]


class _Duty:
    """One stage reduced in one epoch: its auxiliary averager and the task that keeps it in matchmaking."""

    def __init__(self, stage: int, epoch: int, averager: StageAverager):
        self.stage, self.epoch, self.averager = stage, epoch, averager
        self.rounds = 0  # windows in which a group averaged through us
        self.task: Optional[asyncio.Task] = None

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            if await self.averager.assist():
                self.rounds += 1
                logger.debug("reduced stage %d for %s", self.stage, ", ".join(p[-8:] for p in self.averager.last_group))
            elif loop.time() - started < REDUCER_RETRY_PAUSE_S:
                await asyncio.sleep(REDUCER_RETRY_PAUSE_S)


class StageReducers:
    """The reducer duties of this node for the current epoch (usually none)."""

    def __init__(self, dht, peer_id: str, cfg, reachability_of: Optional[Callable[[str], str]] = None, log=logger):
        """``cfg``: the trainer's configuration (run id, model, averaging); ``reachability_of(peer)``: a member's
        advertised reachability (None: unknown, so this node never reduces)."""
        self.dht, self.peer_id, self.run_id = dht, peer_id, cfg.run_id
        self.model_cfg, self.averaging_cfg, self.log = cfg.model, cfg.averaging, log
        self.reachability_of = reachability_of
        self.duties: Dict[int, _Duty] = {}
        #: rounds reduced by duties already ended (with the running ones: :attr:`rounds`)
        self._past_rounds = 0

    @property
    def rounds(self) -> int:
        return self._past_rounds + sum(d.rounds for d in self.duties.values())

    @property
    def stages(self) -> List[int]:
        return sorted(self.duties)

    async def update(self, epochs) -> Dict[int, str]:
        """Serve exactly the stages this node reduces in the current epoch (called at set-up and at each epoch
        switch): end the duties of another epoch or stage, start the new ones. Returns every stage's reducer
        (:func:`stage_reducers`), ours or not."""
        epoch = epochs.epoch.epoch
        reducers = stage_reducers(epochs, self.reachability_of)
        wanted = {s for s, p in reducers.items() if p == self.peer_id}
        for stage in [s for s, d in self.duties.items() if s not in wanted or d.epoch != epoch]:
            await self._stop(stage)
        for stage in sorted(wanted - set(self.duties)):
            replicas = epochs.replicas(stage)
            averager = StageAverager(self.dht, gradient_shapes(self.model_cfg, stage),
                                     prefix=averager_prefix(self.run_id, stage, epoch), group_size=len(replicas) + 1,
                                     cfg=self.averaging_cfg, auxiliary=True, replicas=replicas, reducer=self.peer_id)
            await averager.start()
            duty = self.duties[stage] = _Duty(stage, epoch, averager)
            duty.task = asyncio.create_task(duty.serve(), name=f"reducer-stage{stage}")
            self.log.info("reducing stage %d's averaging in epoch %d: its %d replicas cannot be dialled (%s)",
                          stage, epoch, len(replicas), ", ".join(p[-8:] for p in replicas))
        return reducers

    async def _stop(self, stage: int) -> None:
        duty = self.duties.pop(stage)
        self._past_rounds += duty.rounds
        if duty.task is not None:
            duty.task.cancel()
            await asyncio.gather(duty.task, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, duty.averager.shutdown)

    async def close(self) -> None:
        for stage in list(self.duties):
            await self._stop(stage)
