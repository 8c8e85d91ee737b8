"""A trainer that fell out of step with its swarm leaves its run, to re-join with verified state.

A node frozen for a while (a suspended process, a machine that slept, a long stall of its host) wakes
up in the middle of an iteration the swarm finished long ago: nobody sends it that iteration's
microbatches any more, and it would wait for them until the iteration timeout. Meanwhile the other
members found it silent (:mod:`node.swarm.admission`) and issued an epoch without it; while it still
trains its old iteration it is refused as a stale candidate. So, once the host has adopted an epoch
that leaves this node out and starts well past where this trainer is, and the trainer has committed
nothing for :data:`STALE_AFTER_S` (or at once, when that epoch starts :data:`FAR_BEHIND_ITERATIONS` or more
past where an in-step member could be), it leaves (``trainer.left``): the training service then waits for
an epoch that admits it again and joins it like any joiner, taking its stage's state from the
replicas and checking it against them before it trains (``StageState.join``).

An in-step member never meets all three conditions: it commits every iteration, and an epoch that
drops it starts within a couple of iterations of where it is (it trains up to that boundary).
The idle clock alone is not enough: a woken trainer does commit its old iterations, one every round
window or so (each waits out an averaging round its groupmates left long ago), so while the swarm went
on for a dozen iterations without it, it would crawl through them all, never idle for long, before it
reached the epoch's start and left.

A *paused* trainer (a stage of its epoch has no live replica in its view) trains up to no boundary at
all, so "in step" does not protect it: woken just before the boundary of the epoch that dropped it, it
finds its old stage-mates silent (they no longer answer a non-member's probes), pauses for want of
them and would wait there for ever. Paused, it leaves once the idle clock runs out, however near the
boundary is.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Callable, Optional

__all__ = ["FAR_BEHIND_ITERATIONS", "STALE_AFTER_S", "run_unless_stale", "stale_reason"]

#: Seconds without a commit before a trainer that an epoch left out counts as stale: the members'
#: silence window (``node.swarm.admission.SILENT_AFTER_S``), after which they have dropped it anyway;
#: far longer than an iteration of a trainer in step.
STALE_AFTER_S = 30.0
#: Seconds between two checks (a stale trainer leaves within about this much after it qualifies).
POLL_S = 1.0
#: How far past our next iteration an epoch leaving us out may start and still be one we train up to:
#: a coordinator in step with us announces it two iterations ahead (``TrainerNode.switch_iteration``).
SWITCH_AHEAD_ITERATIONS = 2
#: How many iterations further still an epoch leaving us out may start before we count as stale at once,
#: idle or not: a member in step is at most an iteration or two behind the coordinator (one in flight, one
#: committing); twice that leaves no doubt that the swarm trained on without us.
FAR_BEHIND_ITERATIONS = 4


def stale_reason(epoch, peer_id: str, trainer_epoch: int, current_iteration: int, idle_s: float,
                 paused: bool = False) -> Optional[str]:
    """Why a trainer at ``current_iteration`` of epoch ``trainer_epoch``, idle for ``idle_s`` seconds
    (``paused``: waiting for a stage without a live replica), is out of step with the host's adopted
    ``epoch``; None when it is not."""
    if epoch is None or int(epoch.epoch) <= trainer_epoch or peer_id in epoch.members:
        return None
    start = int(epoch.start_iteration)
    behind = start - (current_iteration + SWITCH_AHEAD_ITERATIONS)
    if paused:
        if idle_s < STALE_AFTER_S:
            return None
    elif behind <= 0 or (idle_s < STALE_AFTER_S and behind < FAR_BEHIND_ITERATIONS):
        return None
    state = "paused" if paused else "still"
    return (f"out of step: {state} at iteration {current_iteration} ({idle_s:.0f} s since its last commit), while "
            f"schedule epoch {epoch.epoch} left this node out from iteration {start}; re-joining with fresh state")


async def run_unless_stale(trainer, iterations: int, adopted: Callable[[], object], peer_id: str) -> None:
    """``trainer.run(iterations)``, ended with ``trainer.left`` set once the trainer is stale."""
    run = asyncio.ensure_future(trainer.run(iterations))
    watch = asyncio.ensure_future(_wait_until_stale(trainer, adopted, peer_id))
    try:
        await asyncio.wait({run, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not run.done() and not watch.done():  # we were cancelled
            run.cancel()
        watch.cancel()
    if run.done():
        run.result()
        return
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await run
    trainer.left = watch.result()
    trainer.log.warning("leaves training: %s", trainer.left)


async def _wait_until_stale(trainer, adopted: Callable[[], object], peer_id: str) -> str:
    last, since = trainer.committed_iteration, time.monotonic()
    while True:
        await asyncio.sleep(POLL_S)
        now = time.monotonic()
        if trainer.committed_iteration != last:
            last, since = trainer.committed_iteration, now
            continue
        why = stale_reason(adopted(), peer_id, int(trainer.epoch.epoch), int(trainer.current_iteration), now - since,
                           paused=trainer.paused_reason is not None)
        if why is not None:
            return why
