"""What a trainer builds for its stage, from explicit inputs: hop deadlines, the data-plane guard, the data
shard and the stage's averager. The trainer calls these at set-up and again at an epoch switch, and keeps
the results in its :class:`node.train.progress.StageResources`."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable, Optional, Tuple

from node.errors import UserError
from node.train.averaging import StageAverager, averager_prefix, averaging_group
from node.train.data import DataShard, TokenSplits, load_splits

__all__ = ["hop_deadlines", "microbatch_guard", "data_shard", "rebuild_averager", "rebuild_averaging",
           "close_averaging"]

#: bytes per element of an activation in the deadline model (fp32 on the wire bounds every codec)
ACTIVATION_ELEMENT_BYTES = 4


def hop_deadlines(cfg, epochs, forward_s: float, links):
    """The deadlines of the current epoch's hops (:class:`node.train.deadlines.HopDeadlines`), from the measured
    forward time of this stage and the link estimates (``links``: :func:`node.train.timing.deadline_links`)."""
    from node.train.deadlines import HopDeadlines

    act_bytes = ACTIVATION_ELEMENT_BYTES * cfg.data.microbatch_size * cfg.data.seq_len * cfg.model.d_model
    members = epochs.members
    return HopDeadlines(epochs.epoch.schedule, members, [forward_s] * len(members), act_bytes, links, cfg.deadlines)


def microbatch_guard(cfg, epochs, peer_id: str, progress):
    """Reject malformed, non-finite, replayed or out-of-epoch frames before they reach the worker."""
    from node.dataplane.guard import MicrobatchGuard, compressions_for_wire

    d, m = cfg.data, cfg.model

    def position():
        # newer epochs pass: a neighbour may switch at an iteration boundary before we do
        return epochs.epoch.epoch, progress.current

    # senders of the current epoch and of announced ones (valid at a switch boundary)
    return MicrobatchGuard(run_id=cfg.run_id, hidden_shape=(d.microbatch_size, d.seq_len, m.d_model),
                           position=position, self_id=peer_id, members=epochs.senders,
                           compressions=compressions_for_wire(cfg.wire))  # the run's wire codec only


def data_shard(cfg, epochs, splits: Optional[TokenSplits]) -> Tuple[Optional[DataShard], Optional[TokenSplits]]:
    """``(shard, splits)`` of a data node (the splits are loaded once and kept); ``(None, splits)`` elsewhere."""
    if epochs.stage != 0:
        return None, splits
    splits = splits if splits is not None else load_splits(cfg.data)
    if splits.vocab_size > cfg.model.vocab_size:
        raise UserError(f"tokenizer vocab {splits.vocab_size} exceeds model vocab {cfg.model.vocab_size}")
    data_nodes = list(epochs.plan.data_nodes)
    return DataShard(splits, cfg.data, data_nodes.index(epochs.index), len(data_nodes)), splits


async def rebuild_averager(old: Optional[StageAverager], dht, runtime, cfg, epochs,
                           reaches: Optional[Callable[[str], bool]] = None,
                           reducer: Optional[str] = None) -> Optional[StageAverager]:
    """Shut ``old`` down and start the averager of the current epoch's stage group: the replicas a connection can
    exist to (``reaches``, :func:`node.train.averaging.averaging_group`), or every replica when the stage has a
    ``reducer`` (:mod:`node.train.reducer`); None without another such replica."""
    if old is not None:
        await asyncio.get_running_loop().run_in_executor(None, old.shutdown)
    replicas = epochs.replicas(epochs.stage)
    group = averaging_group(epochs.peer_id, replicas, reaches, reducer)
    if len(group.peers) <= 1:
        return None
    assert runtime is not None
    averaging = cfg.averaging
    if group.reducer is not None:
        # no early matchmaking: the reducer leads the group and starts its all-reduce as soon as the group
        # is full, so a group formed when the iteration starts would wait for parts past its time limit
        averaging = dataclasses.replace(averaging, prepare_early=False)
    # the group size is every replica's (and the reducer's): a replica we cannot reach may still join our hivemind
    # group through a dialable one, and hivemind needs the target size to be at least that of any group it assembles
    averager = StageAverager(dht, runtime.grads(), prefix=averager_prefix(cfg.run_id, epochs.stage, epochs.epoch.epoch),
                             group_size=len(set(replicas)) + (group.reducer is not None), cfg=averaging,
                             client_mode=group.client_mode, replicas=group.peers, reducer=group.reducer)
    await averager.start()
    return averager


async def rebuild_averaging(resources, reducers, dht, cfg, epochs, reaches: Optional[Callable[[str], bool]] = None) -> None:
    """For the current epoch: this node's reducer duties (``reducers``: :class:`node.train.reducer.StageReducers`),
    then the averager of its own stage (kept in ``resources``), told its stage's reducer if it has one."""
    found = await reducers.update(epochs)
    resources.averager = await rebuild_averager(resources.averager, dht, resources.runtime, cfg, epochs, reaches,
                                                found.get(epochs.stage))


async def close_averaging(resources, reducers) -> None:
    """Shut the stage's averager and the reducer duties down (blocking parts in an executor thread)."""
    if resources.averager is not None:
        await asyncio.get_running_loop().run_in_executor(None, resources.averager.shutdown)
        resources.averager = None
    await reducers.close()
