"""Where a stage's weights come from and go to: checkpoints, a joiner's download, the state server.

A node resumes from its checkpoint (``--resume``); a node joining a run in progress takes the
stage's weights and optimizer state from a live replica, else from its checkpoint, never silently
from scratch; and every node serves its own state to joiners and to replicas that re-sync.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Optional

from node.dataplane.state_codec import ExpectedState, encode_state, weights_digest, weights_sketch
from node.train.checkpoint import CheckpointDiskFull, CheckpointStore, check_run_config
from node.train.common import JoinFailed, NodeLog
from node.train.relay_link import reaches_or_relayed


def checkpoint_run_config(cfg) -> dict:
    """What a checkpoint must have been trained under to be resumed here: the model, the data (corpus,
    tokenizer and its hash) and the initialisation seed. The learning rate may change between sessions."""
    from dataclasses import asdict

    return {"run_id": cfg.run_id, "model": cfg.model.to_dict(), "data": asdict(cfg.data), "seed": cfg.seed}

__all__ = ["StageState"]

logger = logging.getLogger(__name__)

#: Seconds a replica spends storing its signed state claim before it answers anyway (the verifier
#: counts the direct answer when the DHT has no record).
CLAIM_WRITE_TIMEOUT_S = 10.0
#: Bytes of the temp file an injected full disk (``diskfull@...``) still takes: a disk fills in the middle
#: of a write, so the partial temp file must be cleaned up, which this exercises.
INJECTED_FULL_AFTER_BYTES = 4096


class StageState:
    """Checkpoints, mid-run joins and the state server of one trainer."""

    def __init__(self, cfg, *, peer_id: str, node_name: str, epochs, progress, health, resources, life,
                 compute: Callable[..., Awaitable], p2p=None, dht=None, faults=None):
        """``epochs``, ``progress``, ``health``, ``resources``, ``life``: the trainer's epoch tracker,
        :class:`node.train.progress.IterationProgress` (a resume or a join moves it), peer health, stage resources
        (the runtime) and life; ``await compute(fn)`` runs device work on the compute thread; ``p2p``/``dht``:
        the state server, the download and the signed state claims; ``faults``: an optional
        :class:`node.train.faults.FaultInjector` (its ``diskfull`` rules fill the checkpoint disk)."""
        self.cfg = cfg
        self.peer_id, self.node_name = peer_id, node_name
        self.epochs, self.progress, self.health, self.resources, self.life = epochs, progress, health, resources, life
        self.compute, self.p2p, self.dht, self.faults = compute, p2p, dht, faults
        #: how to reach a replica's state handler (:data:`node.dataplane.state_transfer.Via`; None: directly)
        self.via: Optional[Callable[[str], Optional[str]]] = None
        #: why checkpoints stopped (the disk is full: one line), or None; no save is tried after that
        self.disk_full: Optional[str] = None
        self.log = NodeLog(logger, node_name)
        self.checkpoints: Optional[CheckpointStore] = None
        self.server = None
        self.last_saved = -1
        self.trusted = None  # the Verdict of the last downloaded state: whom it came from, who backed it
        # while this replica downloads its own state it has none to serve or back: two joiners of one stage
        # in one epoch each asked the other for a sketch and waited out the sketch timeout (60 s) in turn
        self.joining = False

    @property
    def state_iteration(self) -> int:
        """The iteration the runtime's weights belong to (kept by the progress)."""
        return self.progress.state_iteration

    @state_iteration.setter
    def state_iteration(self, it: int) -> None:
        self.progress.state_iteration = it

    def restore(self) -> bool:
        """Open the checkpoint store and, with ``resume``, load the last checkpoint; True if one was loaded."""
        if not self.cfg.checkpoint_dir:
            return False
        self.checkpoints = CheckpointStore(self.cfg.checkpoint_dir, self.cfg.run_id, self.epochs.stage, self.node_name)
        if not self.cfg.resume:
            return False
        ckpt = self.checkpoints.load(self.expected())  # CheckpointCorrupt/OldFormat: one line naming the file
        if ckpt is None:
            return False
        check_run_config(ckpt, checkpoint_run_config(self.cfg), self.checkpoints.path)
        self.resources.runtime.load_state_dict(ckpt.state)
        self.progress.committed = self.last_saved = self.state_iteration = ckpt.iteration
        self.log.info("resumed stage %d at iteration %d", self.epochs.stage, ckpt.iteration)
        return True

    async def serve(self, allow=None) -> None:
        """Hand this stage's state to joiners and re-syncing replicas."""
        from node.dataplane.state_transfer import StateServer

        # non-members are admission candidates, served as proof once admission vouches for them
        self.server = StateServer(self.p2p, self.cfg.run_id, self._snapshot, allow=allow, sketch=self._sketch,
                                  member=self._member, vouch=getattr(allow, "vouch", None))
        await self.server.start()

    def _member(self, peer: str) -> bool:
        """A member of the epoch this trainer runs, or of the adopted one (a joiner it names downloads before
        this trainer reaches the epoch's first iteration)."""
        return peer in self.epochs.members or peer in getattr(self.epochs.adopted(), "members", ())

    async def join(self, start: int, have_checkpoint: bool) -> None:
        """Mid-run join: take the stage's weights and optimizer state from a live replica (committed
        iteration ``start - 1``), else from our own checkpoint; never silently from scratch. The
        state is decoded without running code, checked against this stage's tensors, and taken only
        when the stage's other replicas back it (:func:`fetch_verified_state`)."""
        expected = self.expected()
        # live replicas we can be connected to first (then by peer id, so every joiner asks in the same order),
        # but ask the others too: under load a live peer's advert can lapse for a moment, and a dead one only
        # costs a failed dial; one behind NAT like us cannot hand its state over but can back it (its sketch)
        peers = sorted((p for p in self.epochs.replicas(self.epochs.stage) if p != self.peer_id),
                       key=lambda p: (not (self.health.is_alive(p) and self.health.reaches(p)), p))
        if self.via is not None:  # then those behind NAT like us, through a relay
            fetchable = reaches_or_relayed(self.health.reaches, self.via)
            peers.sort(key=lambda p: not (self.health.is_alive(p) and fetchable(p)))
        self.joining = True
        try:
            await self._download(start, have_checkpoint, peers, expected)
        finally:
            self.joining = False

    async def _download(self, start: int, have_checkpoint: bool, peers: list, expected) -> None:
        from node.dataplane.state_transfer import StateDisputed, StateTransferError, fetch_verified_state
        snap, error, peer = None, None, None
        for attempt in range(1, self.cfg.state_fetch_attempts + 1):
            try:
                snap, verdict = await fetch_verified_state(self.p2p, self.cfg.run_id, peers, self.epochs.stage, start - 1,
                                                           expected=expected, timeout_s=self.cfg.state_fetch_timeout_s,
                                                           dht=self.dht, via=self.via)
                peer, self.trusted = verdict.source, verdict
                break
            except StateTransferError as e:
                error = e
                # a live replica that is merely slow to commit ``start - 1`` (the swarm is busy with
                # another failure) hands the state over later: ask again, a bounded number of times
                if not any(self.health.is_alive(p) for p in peers) or attempt == self.cfg.state_fetch_attempts:
                    break
                self.log.warning("no state for stage %d yet (%s); asking again", self.epochs.stage, e)
                await asyncio.sleep(1.0)
        if snap is None:
            if not have_checkpoint:
                raise JoinFailed(f"{self.node_name}: cannot join stage {self.epochs.stage} at iteration {start}: {error}; "
                                 "no checkpoint either (--checkpoint-dir DIR --resume)",
                                 disputed=isinstance(error, StateDisputed)) from None
            self.log.warning("%s; continuing from the checkpoint of iteration %d", error, self.progress.committed)
            self.progress.committed = self.state_iteration = start - 1
            self.progress.current = start
            return
        state = snap.state
        await self.compute(lambda: self.resources.runtime.load_state_dict(state))
        self.progress.committed = self.state_iteration = snap.iteration
        self.progress.current = snap.iteration + 1
        self.log.info("joined stage %d with the state of iteration %d from %s (backed by %d other replica(s)%s)",
                      self.epochs.stage, snap.iteration, peer[-8:], len(self.trusted.agree),
                      f", disputed by {len(self.trusted.disagree)}" if self.trusted.disagree else "")

    async def _snapshot(self, stage: int, min_iteration: int, claim_nonce: Optional[bytes] = None):
        """State server callback: this stage's state once iteration ``min_iteration`` is committed. With
        ``claim_nonce`` (a request through a relay) also a signed claim of the same weights' sketch under it,
        stored in the DHT before the state is sent: the receiver checks what the relay piped against it."""
        from node.dataplane.state_transfer import StateSnapshot
        await self._wait_for(stage, min_iteration)

        def snap():
            state, it = self.resources.runtime.state_dict(), self.state_iteration
            blob = encode_state(state, {"stage": self.epochs.stage, "iteration": it})
            sketch = weights_sketch(state["model"], claim_nonce) if claim_nonce is not None else None
            return (StateSnapshot(self.epochs.stage, it, self.resources.runtime.checksum(), blob,
                                  weights_digest(state["model"])), sketch)

        snapshot, sketch = await self.compute(snap)
        if sketch is not None:
            await self._store_claim(snapshot.iteration, claim_nonce, sketch)
        return snapshot

    async def _sketch(self, stage: int, min_iteration: int, nonce: bytes):
        """State server callback: ``(iteration, weights_sketch)`` once ``min_iteration`` is committed."""
        await self._wait_for(stage, min_iteration)
        it, sketch = await self.compute(
            lambda: (self.state_iteration, weights_sketch(self.resources.runtime.module.state_dict(), nonce)))
        await self._store_claim(it, nonce, sketch)
        return it, sketch

    async def _store_claim(self, it: int, nonce: bytes, sketch) -> None:
        from node.net.records import StateClaimRecord, write_state_claim
        if it >= 0:  # the same word, signed, in the DHT (the verifier prefers it to the direct answer)
            try:
                await asyncio.wait_for(write_state_claim(self.dht, self.cfg.run_id, self.peer_id, nonce,
                                                         StateClaimRecord(self.epochs.stage, it, tuple(sketch))),
                                       CLAIM_WRITE_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the direct answer carries the claim too
                self.log.info("storing the state claim of iteration %d failed: %r", it, e)

    async def _wait_for(self, stage: int, min_iteration: int) -> None:
        if self.resources.runtime is None or stage != self.epochs.stage:
            raise ValueError(f"stage {stage} is not held here")
        while True:
            # refused while joining, before the iteration is compared (the state held then is the one being
            # replaced) and on every poll: a request that arrived just before our own download started would
            # otherwise wait for a state only that download brings (two joiners asking each other: 60 s each)
            if self.joining:
                raise ValueError(f"stage {stage}: this replica is joining, it has no state of its own yet")
            if self.state_iteration >= min_iteration:
                return
            if self.life.closed:
                raise ValueError("trainer is shutting down")
            await asyncio.sleep(0.05)

    def expected(self) -> ExpectedState:
        """What this node's stage holds: downloaded state must have exactly these tensors."""
        assert self.resources.runtime is not None
        return ExpectedState.of_module(self.resources.runtime.module)

    async def save(self, closing: bool = False) -> None:
        """Checkpoint the last committed iteration (once per iteration). A full disk raises
        :class:`CheckpointDiskFull` once (the last good checkpoint stays), or only logs it when ``closing``
        (a shutdown must still close everything else); later calls do nothing."""
        if self.checkpoints is None or self.disk_full is not None or self.progress.committed < 0 \
                or self.progress.committed == self.last_saved:
            return
        assert self.resources.runtime is not None
        it = self.progress.committed
        # the checksum reads every parameter (and on a GPU waits for it): compute thread, not the event loop
        state, checksum = await self.compute(lambda: (self.resources.runtime.state_dict(), self.resources.runtime.checksum()))
        meta = {"run_id": self.cfg.run_id, "epoch": self.epochs.epoch.epoch, "model": self.cfg.model.to_dict(),
                "peer_id": self.peer_id, "checksum": checksum, "branch_scaling": self.cfg.branch_scaling,
                "data": dict(vars(self.cfg.data))}  # tokenizer + hash: what eval/export/generate read back
        run_config = checkpoint_run_config(self.cfg)
        full = INJECTED_FULL_AFTER_BYTES if self.faults and self.faults.disk_full(it) else None
        try:
            await self.compute(lambda: self.checkpoints.save(it, state, meta, run_config=run_config, full_after=full))
        except CheckpointDiskFull as e:
            self.disk_full = str(e)
            if not closing:
                raise
            self.log.error("%s", e)
        self.last_saved = it

    def due(self, it: int) -> bool:
        """A periodic checkpoint is due after iteration ``it``."""
        every = self.cfg.checkpoint_every
        return self.checkpoints is not None and every > 0 and (it + 1) % every == 0

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
            self.server = None
