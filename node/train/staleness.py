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

The crawl is also cut short by what the swarm itself wrote: members of the epoch that left this node out
store a norm record for every iteration they train (``node.net.records``). A record of an iteration
:data:`FAR_BEHIND_ITERATIONS` past both that epoch's start and where this trainer is proves that the swarm
trained on without it, which an in-step member (at most an iteration or two behind) can never see; so
while such an epoch is adopted the watch looks for one every :data:`PASSED_CHECK_S` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Awaitable, Callable, Collection, Optional

from node.net.records import read_norm_records

__all__ = ["FAR_BEHIND_ITERATIONS", "PASSED_CHECK_S", "STALE_AFTER_S", "left_out", "norm_record_reader",
           "run_unless_stale", "stale_reason", "swarm_went_past"]

#: Reads the norm records of one iteration by the given members (``node.net.records.read_norm_records``).
RecordReader = Callable[[int, Collection[str]], Awaitable[Optional[dict]]]

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
#: Seconds between two looks at the swarm's norm records while an epoch leaves this node out (one DHT
#: read each, only then): a woken trainer spends at least one averaging window per old iteration.
PASSED_CHECK_S = 5.0
#: Bound (seconds) on one such read: a DHT under load answers "don't know", never a hang of the watch.
PASSED_READ_TIMEOUT_S = 10.0


def norm_record_reader(dht, run_id: str) -> RecordReader:
    """The :data:`RecordReader` of run ``run_id``'s norm records in ``dht`` (owner-signed: only members' count)."""
    return lambda it, members: read_norm_records(dht, run_id, it, members=set(members))


def left_out(epoch, peer_id: str, trainer_epoch: int) -> bool:
    """Whether the host's adopted ``epoch`` is newer than the trainer's and leaves ``peer_id`` out."""
    return epoch is not None and int(epoch.epoch) > trainer_epoch and peer_id not in epoch.members


def stale_reason(epoch, peer_id: str, trainer_epoch: int, current_iteration: int, idle_s: float,
                 paused: bool = False) -> Optional[str]:
    """Why a trainer at ``current_iteration`` of epoch ``trainer_epoch``, idle for ``idle_s`` seconds
    (``paused``: waiting for a stage without a live replica), is out of step with the host's adopted
    ``epoch``; None when it is not."""
    if not left_out(epoch, peer_id, trainer_epoch):
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


async def swarm_went_past(read: RecordReader, epoch, current_iteration: int) -> Optional[str]:
    """Why the swarm trained on without a trainer at ``current_iteration`` that ``epoch`` left out: a member
    of ``epoch`` stored a norm record :data:`FAR_BEHIND_ITERATIONS` past both that epoch's start and
    ``current_iteration``; None when none is found (or the read failed: no verdict)."""
    it = max(int(epoch.start_iteration), current_iteration) + FAR_BEHIND_ITERATIONS
    try:
        records = await asyncio.wait_for(read(it, tuple(epoch.members)), PASSED_READ_TIMEOUT_S)
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - a failed read is "don't know"; the idle clock still decides
        return None
    if not records:
        return None
    return (f"out of step: still at iteration {current_iteration}, while the swarm trained iteration {it} without "
            f"this node (schedule epoch {epoch.epoch} left it out from iteration {int(epoch.start_iteration)}); "
            f"re-joining with fresh state")


async def run_unless_stale(trainer, iterations: int, adopted: Callable[[], object], peer_id: str,
                           read: Optional[RecordReader] = None) -> None:
    """``trainer.run(iterations)``, ended with ``trainer.left`` set once the trainer is stale. ``read``: the
    swarm's norm records (:func:`swarm_went_past`); None: only the epoch and the idle clock decide."""
    run = asyncio.ensure_future(trainer.run(iterations))
    watch = asyncio.ensure_future(_wait_until_stale(trainer, adopted, peer_id, read))
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


async def _wait_until_stale(trainer, adopted: Callable[[], object], peer_id: str,
                            read: Optional[RecordReader] = None) -> str:
    last, since, looked = trainer.committed_iteration, time.monotonic(), -PASSED_CHECK_S
    while True:
        await asyncio.sleep(POLL_S)
        now = time.monotonic()
        if trainer.committed_iteration != last:
            last, since = trainer.committed_iteration, now
        epoch, current = adopted(), int(trainer.current_iteration)
        why = stale_reason(epoch, peer_id, int(trainer.epoch.epoch), current, now - since,
                           paused=trainer.paused_reason is not None)
        if why is None and read is not None and now - looked >= PASSED_CHECK_S \
                and left_out(epoch, peer_id, int(trainer.epoch.epoch)):
            looked = now
            why = await swarm_went_past(read, epoch, current)
        if why is not None:
            return why
