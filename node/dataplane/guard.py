"""Semantic checks on decoded data-plane messages, before they reach the trainer.

The wire decoder (:mod:`protocol`) only proves that a frame is *a* well-formed message. A peer
that is allowed into the swarm can still send one that is well formed but wrong for this run:
a tensor of another shape (a forward on it would raise deep inside the stage, or worse, broadcast),
NaN/inf activations (they would poison the averaged gradients of the whole stage), a frame of
an old schedule epoch or of an iteration that is long over, a microbatch addressed to another
node, a hop claimed by a peer that is not the previous (activation) or next (gradient) hop of
the route, a copy of a frame that was already processed (a replay would run the same backward
twice), an ``IterationDone`` in another data node's name (it would end an iteration early), or a
tensor in a dtype or wire codec this run does not send (``--wire``: every member of a run sends
its activations and gradients as float32 tensors under the one codec of the run's wire format).
A member can also send finite tensors far larger than anything honest (1e30, gradients x -1e6):
the last rule refuses a member's activation or gradient whose magnitude is far outside what this node
received of that kind lately (``out_of_range``, :mod:`node.dataplane.magnitude`).
:class:`MicrobatchGuard` rejects each of those with a short reason code (counted and logged by
:class:`node.dataplane.transport.DataPlane`), so none of them reaches the trainer's queues.

Honest peers always pass: senders re-route and skip by rewriting ``route`` so that the sender
stays ``route[hop - 1]`` (forward) or ``route[hop + 1]`` (backward); members are at most one
iteration apart (an iteration commits only after every member published its norm), so frames
of ``current`` and ``current + 1`` are all an honest peer sends; and a neighbour may switch to a
newer schedule epoch at an iteration boundary before we do, so newer epochs pass.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Collection, Dict, Hashable, Optional, Tuple

from node.dataplane.magnitude import OUT_OF_RANGE, Magnitude, MagnitudeScreen, measure
from protocol import NonFiniteTensor, ProtocolError
from protocol.compression import NO_COMPRESSION, wire_compression
from protocol.messages import ActivationMessage, GradientMessage, HopFailure, IterationDone, MicrobatchId, NormReport

__all__ = [
    "MicrobatchGuard",
    "Rejection",
    "Position",
    "REASONS",
    "DEFAULT_DTYPES",
    "DEFAULT_COMPRESSIONS",
    "compressions_for_wire",
    "FRAME_SIZE_FACTOR",
    "ENVELOPE_MARGIN_BYTES",
    "DEFAULT_MAX_REPLAY_ENTRIES",
    "CONTENT_FAULTS",
]

logger = logging.getLogger(__name__)

#: A stage hands out float32 activations and gradients whatever its compute precision
#: (``node.train.runtime.BOUNDARY_DTYPE``); the wire format is the frame's codec, not its dtype.
DEFAULT_DTYPES: Tuple[str, ...] = ("float32",)
#: Codecs accepted by default: the ``fp32`` wire format (raw bytes).
DEFAULT_COMPRESSIONS: Tuple[str, ...] = (NO_COMPRESSION,)
#: A frame may be at most this many times the fp32 tensor of ``hidden_shape``: the tensor is all
#: an honest frame carries, and 2x leaves room for any wire dtype (none is wider than 8 bytes).
FRAME_SIZE_FACTOR = 2
#: Plus this much for the envelope: microbatch id, a route of peer ids (~50 bytes each), or an
#: ``IterationDone`` with one visit count per member; 1 MiB is thousands of peers.
ENVELOPE_MARGIN_BYTES = 1 << 20
#: Replay memory keeps at most this many frame ids; beyond it the oldest are forgotten first
#: (bounded memory even if a peer invents fresh ids within the iteration window).
DEFAULT_MAX_REPLAY_ENTRIES = 200_000
#: Bytes per element of the fp32 tensor the frame cap is derived from.
_FP32_BYTES = 4

#: Reason codes (also the ``reason`` label of the rejection metric).
WRONG_RUN = "wrong_run"
WRONG_DTYPE = "wrong_dtype"
WRONG_SHAPE = "wrong_shape"
WRONG_COMPRESSION = "wrong_compression"
BAD_TENSOR = "bad_tensor"
NON_FINITE = "non_finite"
OUT_OF_EPOCH = "out_of_epoch"
STALE_ITERATION = "stale_iteration"
FUTURE_ITERATION = "future_iteration"
NOT_FOR_US = "not_for_us"
BAD_HOP = "bad_hop"
WRONG_SENDER = "wrong_sender"
NOT_MEMBER = "not_member"
REPLAYED = "replayed"
REASONS: Tuple[str, ...] = (WRONG_RUN, WRONG_DTYPE, WRONG_SHAPE, BAD_TENSOR, NON_FINITE, OUT_OF_EPOCH,
                            STALE_ITERATION, FUTURE_ITERATION, NOT_FOR_US, BAD_HOP, WRONG_SENDER, NOT_MEMBER,
                            REPLAYED, WRONG_COMPRESSION, OUT_OF_RANGE)
#: Reasons that say the *content* of a hop tensor is poison (not that it is late, misaddressed or
#: from an outsider): such a frame from a member counts as that member's fault, and its microbatch
#: is reported failed to its data node at once (node.train.screening.FrameRejections).
CONTENT_FAULTS = frozenset({NON_FINITE, OUT_OF_RANGE, BAD_TENSOR, WRONG_SHAPE, WRONG_DTYPE, WRONG_COMPRESSION})


def _frame_values(frame):
    """The frame's values as a 1-D float numpy array (decompressed; bfloat16 widened to float32)."""
    import numpy as np

    from protocol.tensor import DTYPES

    info = DTYPES[frame.dtype]
    raw = frame.raw_bytes()
    if info.float_numpy is not None:
        return np.frombuffer(raw, dtype=info.float_numpy)
    return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)  # bfloat16


def compressions_for_wire(wire: str) -> Tuple[str, ...]:
    """The frame codecs a run with wire format ``wire`` (``--wire``) accepts: exactly its own."""
    return (wire_compression(wire),)

#: ``position()`` result: (current epoch, current iteration). The epoch may also be given as a
#: set of epochs still accepted (its minimum is the current one).
Position = Tuple[object, int]


@dataclass(frozen=True)
class Rejection:
    """Why a message was refused: a stable ``reason`` code and a human ``detail`` for the log."""

    reason: str
    detail: str


class MicrobatchGuard:
    """Checks one node's incoming data-plane messages; see the module docstring for the rules.

    ``position()`` returns ``(current_epoch, current_iteration)`` at call time (None = not known
    yet: epoch and iteration rules are skipped). ``members()`` (optional) returns the peer ids
    allowed to send activations and gradients; None skips that rule.
    """

    def __init__(
        self,
        run_id: str,
        hidden_shape: Tuple[int, ...],
        position: Callable[[], Optional[Position]],
        self_id: str,
        dtypes: Collection[str] = DEFAULT_DTYPES,
        members: Optional[Callable[[], Collection[str]]] = None,
        compressions: Collection[str] = DEFAULT_COMPRESSIONS,
        max_replay_entries: int = DEFAULT_MAX_REPLAY_ENTRIES,
        envelope_margin_bytes: int = ENVELOPE_MARGIN_BYTES,
        screen_magnitudes: bool = True,
    ) -> None:
        self.run_id = run_id
        self.hidden_shape = tuple(int(d) for d in hidden_shape)
        if not self.hidden_shape or any(d <= 0 for d in self.hidden_shape):
            raise ValueError(f"hidden_shape must be positive dimensions, got {hidden_shape!r}")
        self.position = position
        self.self_id = self_id
        self.dtypes = frozenset(dtypes)
        self.compressions = frozenset(compressions)
        self.members = members
        self.max_replay_entries = int(max_replay_entries)
        self.max_frame_bytes = (FRAME_SIZE_FACTOR * math.prod(self.hidden_shape) * _FP32_BYTES
                                + int(envelope_margin_bytes))
        #: iteration -> {frame id: None} (dicts keep insertion order: the oldest is evicted first)
        self._seen: Dict[int, Dict[Hashable, None]] = {}
        self._n_seen = 0
        #: recent magnitudes of accepted activations and gradients (None: the check is off)
        self.magnitudes: Optional[MagnitudeScreen] = MagnitudeScreen() if screen_magnitudes else None

    # ------------------------------------------------------------------ public API
    def check(self, msg: object, sender: str) -> Optional[str]:
        """The reason code ``msg`` from ``sender`` is refused for, or None if it may be processed."""
        rejection = self.inspect(msg, sender)
        return None if rejection is None else rejection.reason

    def inspect(self, msg: object, sender: str, tensor_checked: bool = False,
                measured: Optional[Magnitude] = None) -> Optional[Rejection]:
        """Like :meth:`check`, with a detail for the log. An accepted hop is remembered (replays).
        ``tensor_checked``: the caller already ran :meth:`check_tensor` on the hop's tensor (in a worker
        thread, for a large frame), so it is not checked again here; ``measured``: the caller also took
        the tensor's :meth:`measure` there, so the magnitude rule reads no tensor on the loop."""
        pos = self._position()
        if isinstance(msg, (ActivationMessage, GradientMessage)):
            return self._check_hop(msg, sender, pos, tensor_checked, measured)
        if isinstance(msg, IterationDone):
            return self._check_done(msg, sender, pos)
        if isinstance(msg, HopFailure):
            return self._check_failure(msg, sender)
        if isinstance(msg, NormReport):  # the direct norm exchange (node.train.commit)
            return self._check_norm_report(msg, sender, pos)
        return Rejection(NOT_FOR_US, f"{type(msg).__name__} does not travel on the data plane")

    # ------------------------------------------------------------------ rules
    def _position(self) -> Optional[Tuple[int, int]]:
        pos = self.position()
        if pos is None:
            return None
        epoch, iteration = pos
        if isinstance(epoch, (set, frozenset, tuple, list)):
            epoch = min(epoch) if epoch else None
        if epoch is None:
            return None
        current = (int(epoch), int(iteration))
        self._forget_before(current[1] - 1)
        return current

    def _check_window(self, epoch: Optional[int], iteration: int, pos: Optional[Tuple[int, int]]) -> Optional[Rejection]:
        if pos is None:
            return None
        cur_epoch, cur_it = pos
        if epoch is not None and epoch < cur_epoch:
            return Rejection(OUT_OF_EPOCH, f"epoch {epoch} is older than the current epoch {cur_epoch}")
        if iteration < cur_it:
            return Rejection(STALE_ITERATION, f"iteration {iteration} is over (current {cur_it})")
        if iteration > cur_it + 1:
            return Rejection(FUTURE_ITERATION, f"iteration {iteration} is beyond {cur_it + 1}")
        return None

    def check_tensor(self, frame) -> Optional[Rejection]:
        """The rules on a hop's tensor alone (dtype, codec, shape, finiteness): they read only the frame and
        this guard's fixed settings, so they may run in a worker thread while the loop goes on."""
        return self._check_tensor(frame)

    def measure(self, frame) -> Optional[Magnitude | Rejection]:
        """The frame's magnitude for the magnitude rule (None when that rule is off), or the rejection of
        a payload that cannot be read. Reads only the frame, so it may run in a worker thread."""
        if self.magnitudes is None:
            return None
        try:
            return measure(_frame_values(frame))
        except (ProtocolError, ValueError, KeyError) as e:
            return Rejection(BAD_TENSOR, str(e)[:200])

    def _check_hop(self, msg, sender: str, pos: Optional[Tuple[int, int]],
                   tensor_checked: bool = False, measured: Optional[Magnitude] = None) -> Optional[Rejection]:
        mb: MicrobatchId = msg.mb
        forward = isinstance(msg, ActivationMessage)
        kind = "activation" if forward else "gradient"
        if mb.run_id != self.run_id:
            return Rejection(WRONG_RUN, f"{kind} of run {mb.run_id[:64]!r}")
        hop, route = msg.hop, msg.route
        if not 0 <= hop < len(route) or route[hop] != self.self_id:
            return Rejection(NOT_FOR_US, f"{kind} hop {hop} is addressed to another node")
        if (forward and hop < 1) or (not forward and hop > len(route) - 2):
            return Rejection(BAD_HOP, f"{kind} cannot arrive at hop {hop} of a route of {len(route)}")
        expected = route[hop - 1] if forward else route[hop + 1]
        if sender != expected:
            return Rejection(WRONG_SENDER, f"{kind} hop {hop} must come from {expected[-8:]}, not the sender")
        rejection = self._check_window(mb.epoch, mb.iteration, pos) or (
            None if tensor_checked else self._check_tensor(msg.tensor))
        if rejection is not None:
            return rejection
        key = (mb.data_node, mb.epoch, mb.iteration, mb.index, mb.attempt, hop, kind)
        bucket = self._seen.setdefault(mb.iteration, {})
        if key in bucket:
            return Rejection(REPLAYED, f"{kind} {mb.data_node[-6:]}/{mb.iteration}/{mb.index}.{mb.attempt} "
                                       f"hop {hop} was already received")
        # membership last, so a refused frame is named by what is wrong with its content too; and
        # only an accepted frame is remembered (an outsider must not pre-empt a member's frame id)
        if self.members is not None and sender not in self.members():
            return Rejection(NOT_MEMBER, f"{kind} from a peer outside the schedule")
        rejection = self._check_magnitude(msg.tensor, kind, measured)
        if rejection is not None:
            return rejection
        self._remember(bucket, key)
        return None

    def _check_tensor(self, frame) -> Optional[Rejection]:
        if frame.dtype not in self.dtypes:
            return Rejection(WRONG_DTYPE, f"dtype {frame.dtype} (this run sends {sorted(self.dtypes)})")
        if frame.compression not in self.compressions:
            return Rejection(WRONG_COMPRESSION, f"codec {str(frame.compression)[:40]!r} (this run sends "
                                                f"{sorted(self.compressions)})")
        if tuple(frame.shape) != self.hidden_shape:
            return Rejection(WRONG_SHAPE, f"shape {tuple(frame.shape)[:8]} (this run sends {self.hidden_shape})")
        try:
            frame.check_finite()
        except NonFiniteTensor as e:
            return Rejection(NON_FINITE, str(e)[:200])
        except ProtocolError as e:  # a compressed payload that does not match its shape
            return Rejection(BAD_TENSOR, str(e)[:200])
        return None

    def _check_done(self, msg: IterationDone, sender: str, pos: Optional[Tuple[int, int]]) -> Optional[Rejection]:
        if msg.run_id != self.run_id:
            return Rejection(WRONG_RUN, f"IterationDone of run {msg.run_id[:64]!r}")
        if sender != msg.data_node:
            return Rejection(WRONG_SENDER, f"IterationDone in the name of {msg.data_node[-8:]}")
        # no epoch rule: the trainer keys the done record by iteration only, and refusing one
        # would stall the iteration; the window bounds the per-iteration state a peer can create
        return self._check_window(None, msg.iteration, pos)

    def _check_failure(self, msg: HopFailure, sender: str) -> Optional[Rejection]:
        # permissive: the report names no route we could check it against; only the data node acts on it,
        # except one from the data node itself: it gave that attempt up, and a node of its route forgets it
        if msg.mb.run_id != self.run_id:
            return Rejection(WRONG_RUN, f"HopFailure of run {msg.mb.run_id[:64]!r}")
        if msg.mb.data_node != self.self_id and sender != msg.mb.data_node:
            return Rejection(NOT_FOR_US, "HopFailure about another data node's microbatch")
        return None

    # ------------------------------------------------------------------ norm reports (barrier)
    def _check_norm_report(self, msg: NormReport, sender: str, pos: Optional[Tuple[int, int]]) -> Optional[Rejection]:
        """A member's own report, of this run, for the current or next iteration, with sane numbers
        (the decoder already refused negative counters and a negative ``sq``; NaN/inf pass: a
        poisoned gradient must reach everyone so that all skip the step). No epoch rule, as for
        ``IterationDone``: the trainer leaves out numbers of another epoch and learns from them."""
        if msg.run_id != self.run_id:
            return Rejection(WRONG_RUN, f"NormReport of run {msg.run_id[:64]!r}")
        if sender != msg.peer_id:
            return Rejection(WRONG_SENDER, f"NormReport in the name of {msg.peer_id[-8:]}")
        rejection = self._check_window(None, msg.iteration, pos)
        if rejection is not None:
            return rejection
        if self.members is not None and sender not in self.members():
            return Rejection(NOT_MEMBER, "NormReport from a peer outside the schedule")
        return None

    # ------------------------------------------------------------------ magnitude (a bad member)
    def _check_magnitude(self, frame, kind: str, measured: Optional[Magnitude] = None) -> Optional[Rejection]:
        """Refuse a member's finite frame whose values are far outside what this node received of
        that kind lately (:mod:`node.dataplane.magnitude`). Runs last, on a frame that passed every
        other rule, so only frames of members that would otherwise be accepted shape the statistics."""
        if self.magnitudes is None:
            return None
        magnitude = measured if measured is not None else self.measure(frame)
        if isinstance(magnitude, Rejection):
            return magnitude
        why = self.magnitudes.judge(kind, magnitude)
        return None if why is None else Rejection(OUT_OF_RANGE, why)

    # ------------------------------------------------------------------ replay memory
    def _remember(self, bucket: Dict[Hashable, None], key: Hashable) -> None:
        bucket[key] = None
        self._n_seen += 1
        while self._n_seen > self.max_replay_entries:
            oldest = min(self._seen)
            entries = self._seen[oldest]
            if entries:
                entries.pop(next(iter(entries)))
                self._n_seen -= 1
            if not entries:
                del self._seen[oldest]

    def _forget_before(self, iteration: int) -> None:
        for it in [it for it in self._seen if it < iteration]:
            self._n_seen -= len(self._seen.pop(it))

    @property
    def remembered(self) -> int:
        """Frame ids currently held for replay detection."""
        return self._n_seen
