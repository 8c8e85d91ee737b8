"""Gradient averaging between the replicas of one stage, over hivemind's DecentralizedAverager.

One averager per (run, stage, schedule epoch): the prefix names exactly that group, and the group
size is the number of replicas the epoch gives the stage, so matchmaking never mixes stages or
epochs and a full group starts all-reduce at once. Each replica passes the *mean* gradient of the
microbatches that visited it with ``weight`` = how many did; hivemind computes
``sum(w_i * g_i) / sum(w_i)``, i.e. the mean over every visiting microbatch of the stage (not the
reference implementation's divide-by-replica-count). A replica that processed nothing joins with
weight 0 so the others are not left waiting.

Pitfalls handled here (see docs/training.md): the averager must be constructed and started on the
main thread (``run_in_background`` calls ``signal.signal``) and it sets SIGINT to SIG_IGN in our
process, so the previous handler is restored; its blocking calls run in an executor. A peer killed
mid-all-reduce would leave the survivors with slightly different values: a round whose results did not
all come back fails (:func:`whole_round_averager`), and
:func:`node.train.runtime.StageRuntime.checksum` is compared across replicas every iteration, and a
diverged replica copies the canonical one's state (:class:`node.train.commit.IterationCommit`).

Matchmaking (DHT declarations and join requests among the replicas) costs seconds, several times
the all-reduce of a small stage. :meth:`StageAverager.prepare` starts it when the iteration starts,
with the all-reduce held until :meth:`StageAverager.average` loads the gradients and releases it, so
the group is usually formed by the time the last backward is done. A prepared round that fails
(a groupmate died or skipped) falls back to the windowed rounds below.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from dataclasses import dataclass
from typing import Awaitable, Callable, Dict, List, Optional, Sequence

import torch

from protocol.compression import wire_format

__all__ = ["AveragingConfig", "StageAverager", "averager_prefix", "groupmates_went_on", "AveragingGroup",
           "averaging_group", "AVERAGING_COMPRESSIONS",
           "averaging_compression_for_wire", "hivemind_compression"]


def import_hivemind():
    """hivemind, imported on first use: modules that only need :class:`AveragingConfig` (the
    single-process reference, the GPU bench without the carried wheels) must import without it."""
    from node.compat import import_hivemind as _import_hivemind

    return _import_hivemind()


#: ``AveragingConfig.compression`` -> the hivemind.compression class that carries the all-reduce traffic.
#: No 8-bit entry: hivemind 1.1.12's BlockwiseQuantization needs bitsandbytes (not installed), and its
#: Uniform8BitQuantization/Quantile8BitQuantization cannot *decode* under numpy >= 2.4 (``extract`` calls
#: ``int()`` on a one-element array: "TypeError: only 0-dimensional arrays can be converted to Python
#: scalars", measured with numpy 2.4.6 here), so every all-reduce part would fail on the receiving side.
AVERAGING_COMPRESSIONS = {"none": "NoCompression", "fp16": "Float16Compression",
                          "scaled-fp16": "ScaledFloat16Compression"}


def averaging_compression_for_wire(wire: str) -> str:
    """The averaging compression that goes with wire format ``wire`` (the wire table,
    :data:`protocol.compression.WIRE_TABLE`: fp32 -> none, bf16/fp16/int8 -> fp16; see above why not 8 bits)."""
    return wire_format(wire).averaging


def hivemind_compression(name: str):
    """A hivemind compression instance for ``AveragingConfig.compression``."""
    if name not in AVERAGING_COMPRESSIONS:
        raise ValueError(f"unknown averaging compression {name!r}; expected one of {sorted(AVERAGING_COMPRESSIONS)}")
    hivemind = import_hivemind()
    return getattr(hivemind.compression, AVERAGING_COMPRESSIONS[name])()

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AveragingConfig:
    #: how long a replica waits for its group before giving up on this round (seconds)
    matchmaking_timeout_s: float = 60.0
    #: hivemind's min_matchmaking_time: how long a leader gathers followers before starting; our
    #: groups are always full (target = min = replica count), so all-reduce starts as soon as the
    #: last replica arrives and this only needs to exceed request_timeout (hivemind's advice)
    min_matchmaking_time_s: float = 5.0
    request_timeout_s: float = 3.0
    #: how long an all-reduce may take once its group formed (seconds); None: sized from the stage's
    #: gradient bytes (:func:`allreduce_timeout_for`). hivemind cannot stop a running all-reduce early, so
    #: a groupmate that skips a round it was matched into (its view of us flapped) costs this replica this
    #: long, and the whole swarm waits on its step meanwhile: it must fit the stage, not the largest model
    allreduce_timeout_s: Optional[float] = None
    #: one hivemind step's time limit; a round is a series of such windows (see
    #: StageAverager.average). After each window without a group the replica checks whether its
    #: groupmates went on without it, so this bounds what a round nobody else joins costs. Two
    #: matchmaking periods: long enough that a groupmate arriving a little later is still met
    #: in the same window, short next to ``matchmaking_timeout_s``
    round_window_s: float = 10.0
    #: how the replicas' gradients travel in the all-reduce (see AVERAGING_COMPRESSIONS); part of the
    #: run configuration every member compares, like the rest of this class
    compression: str = "none"
    #: start matchmaking when the iteration starts (see :meth:`StageAverager.prepare`)
    prepare_early: bool = True


#: Smallest weight a replica averages with (see StageAverager.average).
MIN_WEIGHT = 1e-6

#: Shortest all-reduce limit (seconds), one round window. A round of a small stage on loopback takes well
#: under a second. The wait must stay below a microbatch's deadline (about 18 s in the in-process swarm):
#: the other nodes cannot start the next iteration's microbatches while one data node is stuck in its
#: round, and 20 s was measured to drop every microbatch of that next iteration, 10 s none.
MIN_ALLREDUCE_TIMEOUT_S = 10.0
#: Slowest uplink the limit allows for (bytes/s): 10 Mbit/s, a modest home uplink.
ALLREDUCE_MIN_BANDWIDTH_BPS = 1.25e6
#: An all-reduce sends and receives about twice the tensor bytes per replica (reduce-scatter then
#: all-gather); the limit allows twice that again for a loaded or lossy link.
ALLREDUCE_TRAFFIC_FACTOR = 4.0


def allreduce_timeout_for(nbytes: int, cfg: "AveragingConfig") -> float:
    """The all-reduce limit for a stage whose gradients are ``nbytes`` (float32): the configured one,
    or the time its traffic takes at :data:`ALLREDUCE_MIN_BANDWIDTH_BPS`, at least
    :data:`MIN_ALLREDUCE_TIMEOUT_S`."""
    if cfg.allreduce_timeout_s is not None:
        return float(cfg.allreduce_timeout_s)
    return max(MIN_ALLREDUCE_TIMEOUT_S, ALLREDUCE_TRAFFIC_FACTOR * nbytes / ALLREDUCE_MIN_BANDWIDTH_BPS)


def groupmates_went_on(me: str, groupmates: Sequence[str], records: Dict[str, dict], epoch: int,
                       alive: Callable[[str], bool]) -> bool:
    """True when no groupmate can still be in an averaging round with ``me``.

    Asked only after our own step ended without a result (a window without a group, a failed
    prepared round). ``records`` are the iteration's published norm records (peer id -> record); a
    replica publishes its record right after its round, with ``avg_group`` = the peers it averaged
    with (empty when it skipped or failed the round). A groupmate can still be averaging with us
    only if it is alive and has no record yet. A record naming us counts as gone on too: the round
    it names is one whose result never reached us (that step is over), so nothing more of it is on
    the way; waiting for it can cost a whole iteration the matchmaking timeout (a likely cause of the
    77-79 s rounds seen in the 12-daemon chaos test). Records of another epoch belong to another averaging group. A record
    without ``avg_group`` is not understood, so it never lets us give up."""
    for peer in groupmates:
        if peer == me or not alive(peer):
            continue
        record = records.get(peer)
        if record is None:
            return False  # still working or still averaging: maybe with us
        if int(record.get("epoch", epoch)) != epoch:
            continue  # another epoch's prefix: it cannot be in our group
        if record.get("avg_group") is None:
            return False
    return True


@dataclass(frozen=True)
class AveragingGroup:
    """The replicas of our stage that this replica averages with (itself included), whether it joins
    hivemind's all-reduce in client mode (see :func:`averaging_group`), and the stage's reducer: a dialable
    node of another stage that reduces every part when no replica can be dialled (None: the replicas do)."""

    peers: tuple
    client_mode: bool
    reducer: Optional[str] = None

    @property
    def size(self) -> int:
        """Peers in the hivemind group: the replicas, and the reducer when there is one."""
        return len(self.peers) + (self.reducer is not None)


def averaging_group(me: str, replicas: Sequence[str], reaches: Optional[Callable[[str], bool]] = None,
                    reducer: Optional[str] = None) -> AveragingGroup:
    """Whom replica ``me`` averages with: the stage's ``replicas`` that a connection can exist to
    (``reaches(peer)``: False for a peer behind NAT when we are behind NAT too; None: every peer).

    A replica left out this way is never waited for (it could only cost a matchmaking timeout every
    iteration). When some replica is left out, this one is outbound-only and shares the stage with another
    outbound-only replica that the same hivemind group may take in through a dialable replica; hivemind's
    butterfly all-reduce has every non-client peer reduce a part that every other peer sends it, which would
    need a connection between the two. So this replica joins in client mode: it reduces no part, only sends
    its tensors to the dialable peers (over connections it opens) and receives the means back. With only
    dialable groupmates it stays a normal peer: the dialable ones reach it over the connections it opened
    (measured in the NAT lab: every round averaged), and it reduces its share of the parts instead of sending
    all of its tensors to others and taking all of the means back.

    With a ``reducer`` (:func:`scheduler.reachability.averaging_reducers`: no replica of the stage can be
    dialled), every replica averages with every other in client mode, and the reducer, an auxiliary peer
    they all dial, reduces every part (:meth:`StageAverager.assist`)."""
    if reducer is not None and reducer != me:
        return AveragingGroup(tuple(dict.fromkeys([*replicas, me])), client_mode=True, reducer=reducer)
    group = tuple(p for p in dict.fromkeys(replicas) if p == me or reaches is None or reaches(p))
    return AveragingGroup(group, client_mode=len(group) < len(set(replicas) | {me}))


_WHOLE_ROUND_AVERAGER = None


def whole_round_averager():
    """hivemind's ``DecentralizedAverager``, except that a round whose results did not all come back fails.

    Why: when a peer that reduces a part of the all-reduce fails mid-round, hivemind keeps this peer's own
    values for that part, logs "Averaging: received N% results" and reports the round as a success. Replicas
    of one stage then step on different gradients while both record an averaged round (measured behind NAT:
    a client whose reducer's stream broke diverged from its stage-mate by about one learning-rate step, and
    the stage's replicas then disagreed about its state, so no joiner could take it). A failed round is
    handled (the next window, or the local gradient and a re-sync by :mod:`node.train.resync`); a silently
    partial one is not."""
    global _WHOLE_ROUND_AVERAGER
    if _WHOLE_ROUND_AVERAGER is None:
        hivemind = import_hivemind()
        from hivemind.averaging.allreduce import AllreduceException, AveragingMode

        class WholeRoundAverager(hivemind.DecentralizedAverager):
            @classmethod
            def _get_handle_name(cls, namespace, method_name):
                # hivemind names its protocols after the class: keep the base's, so that every averager meets
                return hivemind.DecentralizedAverager._get_handle_name(namespace, method_name)

            async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
                await super()._run_allreduce_inplace_(tensors, group_info, group_id=group_id, **kwargs)
                runner = self._running_groups[group_info.group_id if group_id is None else group_id].result()
                if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
                    return
                parts = runner.tensor_part_container
                if parts.failed_size:
                    raise AllreduceException(f"only {parts.total_size - parts.failed_size} of {parts.total_size} "
                                             "averaged values came back")

        _WHOLE_ROUND_AVERAGER = WholeRoundAverager
    return _WHOLE_ROUND_AVERAGER


def averager_prefix(run_id: str, stage: int, epoch: int) -> str:
    """DHT prefix of one averaging group; hivemind forbids '.' in it."""
    safe_run = "".join(c if c.isalnum() or c in "-_" else "_" for c in run_id)
    return f"{safe_run}_stage{stage}_epoch{epoch}"


class StageAverager:
    """Weighted all-reduce of one stage's gradient tensors among that stage's replicas."""

    def __init__(self, dht, like: Sequence[torch.Tensor], *, prefix: str, group_size: int,
                 cfg: AveragingConfig = AveragingConfig(), client_mode: bool = False, auxiliary: bool = False,
                 replicas: Sequence[str] = (), reducer: Optional[str] = None):
        """``like``: tensors shaped like the stage's gradients. ``auxiliary``: this node only reduces (the
        stage's reducer, see :meth:`assist`). ``replicas``/``reducer``: the group it was built for."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("DecentralizedAverager must be created on the main thread")
        self.prefix, self.group_size, self.cfg = prefix, group_size, cfg
        self.replicas, self.reducer = tuple(replicas), reducer
        self.allreduce_timeout_s = allreduce_timeout_for(sum(t.numel() * 4 for t in like), cfg)
        self._avg = whole_round_averager()(
            averaged_tensors=[torch.zeros_like(t, device="cpu") for t in like],
            dht=dht,
            start=False,
            prefix=prefix,
            target_group_size=group_size,
            # a dead replica must not block the others: after min_matchmaking_time the live ones
            # (at least two) average without it; a full group still starts at once. A reducer leads
            # every group of its stage (the replicas are clients) and contributes nothing, so it
            # waits for two replicas besides itself: a group of one replica would average nothing
            min_group_size=min(3 if auxiliary else 2, group_size),
            auxiliary=auxiliary,
            min_matchmaking_time=cfg.min_matchmaking_time_s,
            request_timeout=cfg.request_timeout_s,
            allreduce_timeout=self.allreduce_timeout_s,
            allow_state_sharing=False,
            compression=hivemind_compression(cfg.compression),
            client_mode=client_mode,  # see averaging_group
        )
        self._started = False
        self.last_group: tuple = ()
        #: norm of the last averaged result refused for exceeding ``max_norm`` (None: not refused)
        self.last_outlier: Optional[float] = None
        self._pending = None  # hivemind StepControl of a prepared round: matchmaking, all-reduce held
        #: prepared rounds that averaged / that fell back to the windowed rounds (the tests read them)
        self.prepared_ok = 0
        self.prepared_failed = 0

    async def start(self) -> None:
        """Fork the averager process without blocking the loop for long; keep our SIGINT handler."""
        # a window without a group is routine here (see average), but hivemind logs each one as
        # an error with a traceback from the averager process; our own warning says when a whole
        # round failed. Set before the fork, so the averager process inherits it.
        logging.getLogger("hivemind.averaging.averager").setLevel(logging.CRITICAL)
        previous = signal.getsignal(signal.SIGINT)
        try:
            self._avg.run_in_background(await_ready=False)
        finally:
            signal.signal(signal.SIGINT, previous)
        await self._avg._ready  # MPFuture, awaitable
        self._started = True
        logger.debug("averager %s ready (group of %d)", self.prefix, self.group_size)

    def prepare(self, expected_s: float) -> None:
        """Start matchmaking for the next :meth:`average` now; its all-reduce waits for that call.

        ``expected_s`` is how long until then (the last iteration's microbatch phase): a group that
        is not complete by then plus one round window (a replica died) is given up, and
        :meth:`average` runs the windowed rounds instead. Call on the event loop thread."""
        if self._pending is not None and self._pending.done():
            self._pending = None  # a round prepared for an iteration that never averaged
        if not self._started or self._pending is not None or not self.cfg.prepare_early:
            return
        import_hivemind()
        from hivemind.utils import get_dht_time

        now = get_dht_time()
        timeout = max(float(expected_s), self.cfg.min_matchmaking_time_s) + self.cfg.round_window_s
        try:
            self._pending = self._avg.step(weight=1.0, scheduled_time=now + self.cfg.min_matchmaking_time_s,
                                           timeout=timeout, allow_retries=False, require_trigger=True, wait=False)
        except Exception as e:  # noqa: BLE001 - the windowed rounds still run
            logger.debug("could not prepare an averaging round of %s: %r", self.prefix, e)
            self._pending = None

    def cancel_prepared(self) -> None:
        """Withdraw a prepared round that :meth:`average` will not run (its groupmates then fail fast)."""
        control, self._pending = self._pending, None
        if control is not None and not control.done():
            try:
                control.cancel()
            except Exception:  # noqa: BLE001 - already finished
                pass

    async def _run_prepared(self, control, tensors: List[torch.Tensor], weight: float):
        """Release a prepared round with our gradients; hivemind's result, or None if it failed."""
        if control.done():  # matchmaking gave up before we got here
            return None
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._load, tensors)
        control.weight = weight
        control.allow_allreduce()
        try:
            return await asyncio.wait_for(control, self.cfg.matchmaking_timeout_s)
        except Exception as e:  # noqa: BLE001 - hivemind raises assorted errors on failed rounds
            logger.debug("prepared averaging round of %s failed: %r", self.prefix, e)
            return None

    async def average(self, tensors: List[torch.Tensor], weight: float,
                      abandon_when: Optional[Callable[[], Awaitable[bool]]] = None,
                      max_norm: Optional[float] = None) -> bool:
        """Replace ``tensors`` in place by the group's weighted mean; False if the round failed.

        The round runs as hivemind steps of at most ``round_window_s`` each, until one finds the
        group or ``matchmaking_timeout_s`` is spent. Between two windows ``abandon_when`` is
        asked, and True ends the round as failed. Why: two replicas can disagree about whether
        the other is alive (a late advert refresh on a loaded host). The one that thinks its
        partner gone skips the round and goes on; without this the other would wait the whole
        matchmaking timeout for a group that cannot form. (Cancelling a running hivemind step is
        not an option: hivemind 1.1.12 retries a cancelled step until its deadline, and the next
        round queues behind it.) After a successful round :attr:`last_group` holds the peer ids
        the round averaged with, this one included. ``max_norm``: a result whose norm exceeds it is
        refused like a non-finite one (one groupmate's poisoned contribution, node.train.screening);
        :attr:`last_outlier` then holds that norm."""
        assert self._started, "call start() first"
        self.last_group = ()
        self.last_outlier = None
        # hivemind divides by the sum of the group's weights: if no replica was visited this
        # iteration all weights would be 0 and the mean 0/0 = NaN; a tiny floor gives the zero
        # gradient of unvisited replicas instead and is negligible next to one visit
        weight = max(float(weight), MIN_WEIGHT)
        loop = asyncio.get_running_loop()
        control, self._pending = self._pending, None
        result = await self._run_prepared(control, tensors, weight) if control is not None else None
        if control is not None:
            if result is not None:
                self.prepared_ok += 1
            else:
                self.prepared_failed += 1
                if await self._abandoned(abandon_when):
                    return False
        deadline = loop.time() + self.cfg.matchmaking_timeout_s
        while result is None:
            # every window starts from our own values (a failed all-reduce may have written some parts);
            # copied in a worker thread: from a GPU the copy waits for the device, which the loop must not
            await loop.run_in_executor(None, self._load, tensors)
            window = max(0.0, min(self.cfg.round_window_s, deadline - loop.time()))
            try:
                # on the loop thread: the returned MPFuture binds to the loop that creates it (blocks ~ms)
                result = await self._avg.step(weight=weight, wait=False, timeout=window)
                error = None if result is not None else "found no group"
            except Exception as e:  # hivemind raises assorted errors on failed rounds
                result, error = None, repr(e)
            if result is not None:
                break
            if loop.time() >= deadline:
                logger.warning("averaging round of %s failed: %s", self.prefix, error)
                return False
            if await self._abandoned(abandon_when):
                return False
            logger.debug("averaging window of %s ended without a group (%s); trying again", self.prefix, error)
        if not await loop.run_in_executor(None, self._store, tensors, max_norm):
            # never let a bad round poison the stage: keep our own gradient instead
            if self.last_outlier is not None:
                logger.warning("averaging round of %s returned a gradient of norm %.3g (bound %.3g); keeping the "
                               "local gradient", self.prefix, self.last_outlier, max_norm)
            else:
                logger.warning("averaging round of %s returned non-finite values; keeping the local gradient",
                               self.prefix)
            return False
        self.last_group = tuple(sorted(str(p) for p in result)) if isinstance(result, dict) else ()
        return True

    async def assist(self) -> bool:
        """As the stage's reducer (built ``auxiliary``): take part in one window's round, reducing the parts the
        replicas send; True if a group averaged. The caller repeats it for as long as it serves the stage."""
        assert self._started, "call start() first"
        try:
            # on the loop thread: the returned MPFuture binds to the loop that creates it
            result = await self._avg.step(wait=False, timeout=self.cfg.round_window_s)
        except Exception as e:  # noqa: BLE001 - hivemind raises assorted errors on failed rounds
            logger.debug("reducer window of %s ended: %r", self.prefix, e)
            return False
        self.last_group = tuple(sorted(str(p) for p in result)) if isinstance(result, dict) else ()
        return result is not None

    async def _abandoned(self, abandon_when: Optional[Callable[[], Awaitable[bool]]]) -> bool:
        """Whether to give the round up (the groupmates went on without this replica); says so."""
        if abandon_when is None or not await self._ask(abandon_when):
            return False
        logger.warning("averaging round of %s abandoned: the groupmates went on without this replica", self.prefix)
        return True

    async def _ask(self, abandon_when: Callable[[], Awaitable[bool]]) -> bool:
        """``abandon_when()``, where a failed check (a DHT read timing out under load) means "not
        yet": the round goes on to its next window instead of failing the iteration."""
        try:
            return bool(await abandon_when())
        except Exception as e:  # noqa: BLE001 - any failure of the check is a "don't know"
            logger.debug("give-up check of %s failed: %r; trying another window", self.prefix, e)
            return False

    def _load(self, tensors: List[torch.Tensor]) -> None:
        """Our tensors (any device) into the averager's CPU buffers."""
        with self._avg.get_tensors() as buffers:
            for buf, t in zip(buffers, tensors):
                buf.copy_(t.detach(), non_blocking=False)

    def _store(self, tensors: List[torch.Tensor], max_norm: Optional[float] = None) -> bool:
        """The averaged buffers back into our tensors; False (and ours untouched) if any is not finite
        or their norm exceeds ``max_norm`` (then recorded in :attr:`last_outlier`)."""
        with self._avg.get_tensors() as buffers:
            if not all(bool(torch.isfinite(buf).all()) for buf in buffers):
                return False
            if max_norm is not None:
                norm = float(torch.sqrt(sum(buf.double().pow(2).sum() for buf in buffers)))
                if norm > max_norm:
                    self.last_outlier = norm
                    return False
            for buf, t in zip(buffers, tensors):
                t.copy_(buf)
        return True

    def shutdown(self) -> None:
        """Blocking (up to hivemind's 5 s grace, then kill): call it from an executor thread."""
        self._pending = None
        if self._started and self._avg.is_alive():
            self._avg.shutdown()
            if self._avg.is_alive():  # forked child may ignore SIGTERM (inherited handlers)
                self._avg.kill()
                self._avg.join(5)
        self._started = False
