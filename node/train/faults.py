"""Deterministic fault injection for the trainer: drop, delay or kill at iteration i, hop j.

Why: recovery code that only runs when a real machine dies is recovery code nobody has tested.
The injector lets a test (or an operator rehearsing an outage) say exactly where a fault happens,
the way hivemind's all-reduce fault tests and torchft's event injector do, so every recovery path
is exercised on every CI run, with the same outcome each time.

A rule fires at the node that *processes* hop ``j`` of a microbatch (hop 0 = the data node's
embedding / its final backward, hop ``len(route)-1`` = the data node's loss), in the given
direction, during iteration ``i``; each rule fires once (``times`` to change that).

- ``drop``: the message is silently discarded (a lost frame; only the data node's deadline sees it);
- ``delay``: processing waits ``delay_s`` first (a straggler);
- ``kill``: the node dies on the spot (the daemon SIGKILLs its own process group, like a machine
  losing power; the in-process harness crashes that trainer).

A ``corrupt`` rule makes the node a *bad member* instead (rehearsing the checks of
docs/training.md, "A bad member"): from iteration ``i`` on, the next ``times`` values of its
``target`` are filled with ``fill`` or multiplied by ``scale`` before they leave the node:

- ``activations``: the activation tensors it sends on (forward hops it computed);
- ``gradients``: the gradient tensors it sends back (backward hops it computed);
- ``average``: its contribution to the stage's gradient averaging (one per iteration);
- ``norm``: the squared gradient norm of its norm report (one per iteration).

Several ``corrupt`` rules of one target fire one after the other, in the order given.

A ``diskfull`` rule fills the node's checkpoint disk: the first checkpoint it writes after iteration
``i`` or later fails half-way with ``ENOSPC`` (rehearsing a full disk: the node keeps its last good
checkpoint and leaves the swarm).

Spec syntax (``--inject``, repeatable): ``ACTION@iteration=I[,hop=J][,direction=forward|backward]``
``[,microbatch=M][,attempt=A][,delay=S][,times=N]``, e.g. ``kill@iteration=3,hop=2,direction=backward``;
``attempt=0`` spares recomputations and hedges of the microbatch (which go to other replicas of the
stage: the same rule on every replica stalls the first attempt wherever the schedule sends it);
``corrupt@iteration=I,target=T,fill=V|scale=V[,times=N]``, e.g. ``corrupt@iteration=5,target=norm,fill=nan,times=3``;
``diskfull@iteration=I``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, List, Optional

from node.errors import UserError

__all__ = ["FaultRule", "FaultInjector", "parse_fault", "corrupted", "ACTIONS", "DIRECTIONS", "TARGETS"]

logger = logging.getLogger(__name__)

ACTIONS = ("drop", "delay", "kill", "corrupt", "diskfull")
#: Actions that do not fire at a hop (they tamper with values, or with the checkpoint disk).
NOT_AT_HOPS = ("corrupt", "diskfull")
DIRECTIONS = ("forward", "backward", "any")
#: What a ``corrupt`` rule tampers with (see the module docstring).
TARGETS = ("activations", "gradients", "average", "norm")


@dataclass
class FaultRule:
    action: str
    iteration: int
    hop: Optional[int] = None  # None = any hop
    direction: str = "any"
    microbatch: Optional[int] = None  # microbatch index within its data node; None = any
    attempt: Optional[int] = None  # attempt of that microbatch (0: the first; recomputations, hedges: 1, ...); None = any
    delay_s: float = 5.0
    times: int = 1  # how often the rule fires before it is spent
    target: Optional[str] = None  # corrupt: what is tampered with (TARGETS)
    fill: Optional[float] = None  # corrupt: every value becomes this (nan, inf, 1e30 ...)
    scale: Optional[float] = None  # corrupt: every value is multiplied by this

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise UserError(f"fault action must be one of {', '.join(ACTIONS)}, got {self.action!r}")
        if self.action == "corrupt" and (self.target not in TARGETS or (self.fill is None) == (self.scale is None)):
            raise UserError(f"a corrupt rule needs target= one of {', '.join(TARGETS)} and exactly one of "
                            f"fill= or scale=: {self}")
        if self.direction not in DIRECTIONS:
            raise UserError(f"fault direction must be one of {', '.join(DIRECTIONS)}, got {self.direction!r}")
        if (self.iteration < 0 or (self.hop is not None and self.hop < 0) or (self.attempt is not None and self.attempt < 0)
                or self.delay_s < 0 or self.times < 1):
            raise UserError(f"fault rule has a negative iteration/hop/attempt/delay or times < 1: {self}")

    def matches(self, iteration: int, hop: int, direction: str, microbatch: int, attempt: int = 0) -> bool:
        return (self.times > 0 and self.action not in NOT_AT_HOPS and iteration == self.iteration
                and (self.hop is None or hop == self.hop)
                and self.direction in ("any", direction)
                and (self.microbatch is None or microbatch == self.microbatch)
                and (self.attempt is None or attempt == self.attempt))


def parse_fault(spec: str) -> FaultRule:
    """``kill@iteration=3,hop=2,direction=backward`` -> :class:`FaultRule` (UserError if malformed)."""
    action, sep, rest = spec.strip().partition("@")
    if not sep:
        raise UserError(f"--inject {spec!r}: expected ACTION@iteration=I[,hop=J,...]")
    fields = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise UserError(f"--inject {spec!r}: {part!r} is not key=value")
        fields[key.strip()] = value.strip()
    known = {"iteration", "hop", "direction", "microbatch", "attempt", "delay", "times", "target", "fill", "scale"}
    unknown = set(fields) - known
    if unknown:
        raise UserError(f"--inject {spec!r}: unknown key(s) {sorted(unknown)} (known: {sorted(known)})")
    if "iteration" not in fields:
        raise UserError(f"--inject {spec!r}: iteration=I is required")
    try:
        return FaultRule(action=action.strip(), iteration=int(fields["iteration"]),
                         hop=int(fields["hop"]) if "hop" in fields else None,
                         direction=fields.get("direction", "any"),
                         microbatch=int(fields["microbatch"]) if "microbatch" in fields else None,
                         attempt=int(fields["attempt"]) if "attempt" in fields else None,
                         delay_s=float(fields.get("delay", 5.0)), times=int(fields.get("times", 1)),
                         target=fields.get("target"),
                         fill=float(fields["fill"]) if "fill" in fields else None,
                         scale=float(fields["scale"]) if "scale" in fields else None)
    except ValueError as e:
        raise UserError(f"--inject {spec!r}: {e}") from None


class FaultInjector:
    """Holds the rules of one node; :meth:`take` returns the rule that fires here, if any."""

    def __init__(self, rules: Iterable[FaultRule] = ()):
        self.rules: List[FaultRule] = list(rules)
        self.fired: List[tuple] = []  # (action, iteration, hop, direction, microbatch), for tests and logs

    def __bool__(self) -> bool:
        return bool(self.rules)

    def take(self, iteration: int, hop: int, direction: str, microbatch: int, attempt: int = 0) -> Optional[FaultRule]:
        for rule in self.rules:
            if rule.matches(iteration, hop, direction, microbatch, attempt):
                rule.times -= 1
                self.fired.append((rule.action, iteration, hop, direction, microbatch))
                logger.warning("fault injection: %s at iteration %d hop %d (%s) microbatch %d attempt %d", rule.action,
                               iteration, hop, direction, microbatch, attempt)
                return rule
        return None

    def corruption(self, iteration: int, target: str) -> Optional[FaultRule]:
        """The ``corrupt`` rule that tampers with this ``target`` value of ``iteration``, if any (it is
        then counted as fired once)."""
        for rule in self.rules:
            if rule.action == "corrupt" and rule.target == target and rule.times > 0 and iteration >= rule.iteration:
                rule.times -= 1
                self.fired.append(("corrupt", iteration, target, rule.fill, rule.scale))
                logger.warning("fault injection: corrupting %s at iteration %d (%s)", target, iteration,
                               f"fill {rule.fill}" if rule.fill is not None else f"scale {rule.scale}")
                return rule
        return None

    def disk_full(self, iteration: int) -> bool:
        """A ``diskfull`` rule fills the disk for the checkpoint of ``iteration`` (then counted as fired once)."""
        for rule in self.rules:
            if rule.action == "diskfull" and rule.times > 0 and iteration >= rule.iteration:
                rule.times -= 1
                self.fired.append(("diskfull", iteration))
                logger.warning("fault injection: the checkpoint disk is full at iteration %d", iteration)
                return True
        return False

    @staticmethod
    def corrupt_value(rule: Optional[FaultRule], value):
        """``value`` as ``rule`` (from :meth:`corruption`) makes it."""
        return corrupted(rule, value)

    def tamper(self, iteration: int, target: str, value):
        """``value`` (a tensor or a float) of ``target`` at ``iteration``, as a ``corrupt`` rule makes it."""
        return corrupted(self.corruption(iteration, target), value)

    @property
    def pending(self) -> int:
        """How many more times the rules will fire (0: every rule is spent)."""
        return sum(rule.times for rule in self.rules)


def corrupted(rule: Optional[FaultRule], value):
    """``value`` (a tensor or a float) as ``rule`` tampers with it; unchanged without a rule."""
    if rule is None:
        return value
    if rule.fill is not None:
        if isinstance(value, float):
            return rule.fill
        return value.new_full(value.shape, rule.fill)
    return value * rule.scale
