"""Application-level WAN emulation for the data plane.

The kernel here has ``tbf``/``htb`` but no ``netem``, so latency cannot be added by the OS. Instead every
message to a peer passes through :meth:`LinkEmulator.transmit`, which waits as long as the emulated link
would take: the bytes are serialised on the link (concurrent sends to the same peer queue behind each other,
so they share its bandwidth), then the propagation latency is added. Nothing here is active unless the
node was started with ``--network-profile``.

Compute emulation (:class:`ComputePadder`) pads a stage's measured compute to a target duration, so that a
2-core machine can stand in for many GPUs the way the paper's own emulation did.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["LinkSpec", "LinkEmulator", "ComputePadder"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinkSpec:
    """One direction of an emulated link."""

    latency_s: float
    bandwidth_Bps: float

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"latency must be >= 0, got {self.latency_s}")
        if self.bandwidth_Bps <= 0:
            raise ValueError(f"bandwidth must be > 0, got {self.bandwidth_Bps}")

    def serialisation_s(self, nbytes: int) -> float:
        return nbytes / self.bandwidth_Bps


class LinkEmulator:
    """Delays sends by latency + bytes/bandwidth per destination, with per-link serialisation.

    :param link_for: maps a destination peer id to its :class:`LinkSpec`, or ``None`` for "not emulated"
        (e.g. a peer whose location is unknown).
    :param clock: monotonic clock in seconds (injectable for tests).
    :param sleep: coroutine used to wait (injectable for tests).
    """

    def __init__(
        self,
        link_for: Callable[[str], LinkSpec | None],
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], "asyncio.Future[None]"] = asyncio.sleep,
    ):
        self._link_for = link_for
        self._clock = clock
        self._sleep = sleep
        self._link_free_at: dict[str, float] = {}

    def plan(self, peer_id: str, nbytes: int) -> float:
        """Reserve the link for ``nbytes`` now; return the time at which the message is delivered.

        Reservation happens synchronously, so two sends started back to back are ordered on the link.
        """
        now = self._clock()
        link = self._link_for(peer_id)
        if link is None:
            return now
        start = max(now, self._link_free_at.get(peer_id, now))
        done = start + link.serialisation_s(nbytes)
        self._link_free_at[peer_id] = done
        return done + link.latency_s

    async def transmit(self, peer_id: str, nbytes: int) -> float:
        """Wait until a message of ``nbytes`` sent now to ``peer_id`` would have arrived; return the delay."""
        started = self._clock()
        deliver_at = self.plan(peer_id, nbytes)
        delay = deliver_at - self._clock()
        if delay > 0:
            await self._sleep(delay)
        return deliver_at - started


class ComputePadder:
    """Pads compute steps to a target duration: ``target = s_per_sample_per_layer * samples * layers * factor``.

    The factors follow the cost model: backward takes ``backward_factor`` x the forward time and the loss
    ``loss_factor`` x (the reference's 1.5 and 0.25).
    """

    def __init__(
        self,
        s_per_sample_per_layer: float,
        *,
        backward_factor: float = 1.5,
        loss_factor: float = 0.25,
        sleep: Callable[[float], "asyncio.Future[None]"] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ):
        if s_per_sample_per_layer < 0:
            raise ValueError("compute emulation needs a non-negative time per sample per layer")
        self.s_per_sample_per_layer = s_per_sample_per_layer
        self.factors = {"forward": 1.0, "backward": backward_factor, "loss": loss_factor}
        self._sleep = sleep
        self._clock = clock

    def target_s(self, kind: str, samples: int, layers: int) -> float:
        return self.s_per_sample_per_layer * samples * layers * self.factors[kind]

    async def pad(self, kind: str, started_at: float, samples: int, layers: int) -> float:
        """Sleep until ``started_at + target``; return how long we slept (0 if compute was already slower)."""
        remaining = started_at + self.target_s(kind, samples, layers) - self._clock()
        if remaining > 0:
            await self._sleep(remaining)
            return remaining
        return 0.0
