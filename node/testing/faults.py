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

Spec syntax (``--inject``, repeatable): ``ACTION@iteration=I[,hop=J][,direction=forward|backward]``
``[,microbatch=M][,delay=S][,times=N]``, e.g. ``kill@iteration=3,hop=2,direction=backward``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, List, Optional

from node.errors import UserError

__all__ = ["FaultRule", "FaultInjector", "parse_fault", "ACTIONS", "DIRECTIONS"]

logger = logging.getLogger(__name__)

ACTIONS = ("drop", "delay", "kill")
DIRECTIONS = ("forward", "backward", "any")


@dataclass
class FaultRule:
    action: str
    iteration: int
    hop: Optional[int] = None  # None = any hop
    direction: str = "any"
    microbatch: Optional[int] = None  # microbatch index within its data node; None = any
    delay_s: float = 5.0
    times: int = 1  # how often the rule fires before it is spent

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise UserError(f"fault action must be one of {', '.join(ACTIONS)}, got {self.action!r}")
        if self.direction not in DIRECTIONS:
            raise UserError(f"fault direction must be one of {', '.join(DIRECTIONS)}, got {self.direction!r}")
        if self.iteration < 0 or (self.hop is not None and self.hop < 0) or self.delay_s < 0 or self.times < 1:
            raise UserError(f"fault rule has a negative iteration/hop/delay or times < 1: {self}")

    def matches(self, iteration: int, hop: int, direction: str, microbatch: int) -> bool:
        return (self.times > 0 and iteration == self.iteration and (self.hop is None or hop == self.hop)
                and self.direction in ("any", direction)
                and (self.microbatch is None or microbatch == self.microbatch))


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
    known = {"iteration", "hop", "direction", "microbatch", "delay", "times"}
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
                         delay_s=float(fields.get("delay", 5.0)), times=int(fields.get("times", 1)))
    except ValueError as e:
        raise UserError(f"--inject {spec!r}: {e}") from None


class FaultInjector:
    """Holds the rules of one node; :meth:`take` returns the rule that fires here, if any."""

    def __init__(self, rules: Iterable[FaultRule] = ()):
        self.rules: List[FaultRule] = list(rules)
        self.fired: List[tuple] = []  # (action, iteration, hop, direction, microbatch), for tests and logs

    def __bool__(self) -> bool:
        return bool(self.rules)

    def take(self, iteration: int, hop: int, direction: str, microbatch: int) -> Optional[FaultRule]:
        for rule in self.rules:
            if rule.matches(iteration, hop, direction, microbatch):
                rule.times -= 1
                self.fired.append((rule.action, iteration, hop, direction, microbatch))
                logger.warning("fault injection: %s at iteration %d hop %d (%s) microbatch %d", rule.action,
                               iteration, hop, direction, microbatch)
                return rule
        return None
