"""Application-level WAN emulation for the data plane.

The kernel here has ``tbf``/``htb`` but no ``netem``, so latency cannot be added by the OS. Instead every
message to a peer is planned on its emulated link: the bytes are serialised on the link (concurrent sends to
the same peer queue behind each other, so they share its bandwidth), then the propagation latency is added.
Nothing here is active unless the node was started with ``--network-profile``.

Two ways to wait out the plan:

* :meth:`LinkEmulator.transmit` (control messages): the sender sleeps, then really sends, so the real
  transport time comes on top of the emulated one;
* :meth:`LinkEmulator.deliver_at_unix` (activations and gradients): the sender stamps the delivery time on
  the message and sends it at once; the receiver holds it until then. The real transport (encoding, the two
  p2pd daemons, decoding) then runs *inside* the emulated delay instead of after it. That matters when many
  daemons share a few cores: there the real per-hop cost is an artefact of the host, not of the emulated
  WAN, whose own per-message software cost is the cost model's ``hop_overhead_s`` (already in the delay).
  Clocks: the stamp is a Unix time, so sender and receiver must share a clock (one machine; NTP-synced
  hosts add their skew to the latency).

Compute emulation (:class:`ComputePadder`) pads a stage's measured compute to a target duration, so that a
2-core machine can stand in for many GPUs the way the paper's own emulation did. The target is counted from
when the step *could* start (``ready_at``: its input arrived and the node was free), so the host's dispatch
latency also runs inside the emulated compute time. A step whose real work outlasts its target is an
*overrun*: counted (:attr:`ComputePadder.overruns`, :attr:`ComputePadder.overrun_s`), never hidden.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

__all__ = ["LinkSpec", "LinkEmulator", "ComputePadder", "Emulation", "profile_link_spec", "profile_links",
           "daemon_peer_locations"]

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
    """Delays sends by latency + bytes/bandwidth per destination, with per-link serialisation. The bytes are
    those of the encoded frame, after the run's wire codec (``--wire``): the real size of the chosen format.

    :param link_for: maps a destination peer id to its :class:`LinkSpec`, or ``None`` for "not emulated"
        (e.g. a peer whose location is unknown).
    :param clock: monotonic clock in seconds (injectable for tests).
    :param sleep: coroutine used to wait (injectable for tests).
    :param wall_clock: Unix clock for :meth:`deliver_at_unix` stamps (injectable for tests).
    """

    def __init__(
        self,
        link_for: Callable[[str], LinkSpec | None],
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], "asyncio.Future[None]"] = asyncio.sleep,
        wall_clock: Callable[[], float] = time.time,
    ):
        self._link_for = link_for
        self._clock = clock
        self._sleep = sleep
        self._link_free_at: dict[str, float] = {}
        self._wall_clock = wall_clock

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

    def deliver_at_unix(self, peer_id: str, nbytes: int) -> Optional[float]:
        """Reserve the link for ``nbytes`` now and return the Unix time of its delivery, or None when the
        peer's link is not emulated. The caller sends at once; the receiver holds the message until then."""
        if self._link_for(peer_id) is None:
            return None
        now = self._clock()
        return self._wall_clock() + (self.plan(peer_id, nbytes) - now)

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
        #: steps padded so far, steps whose real work outlasted the target, and by how much in total
        self.steps = 0
        self.overruns = 0
        self.overrun_s = 0.0

    def target_s(self, kind: str, samples: int, layers: int) -> float:
        return self.s_per_sample_per_layer * samples * layers * self.factors[kind]

    def _remaining(self, kind: str, started_at: float, samples: int, layers: int) -> float:
        remaining = started_at + self.target_s(kind, samples, layers) - self._clock()
        self.steps += 1
        if remaining < 0:
            self.overruns += 1
            self.overrun_s += -remaining
        return remaining

    def pad_blocking(self, kind: str, started_at: float, samples: int, layers: int) -> float:
        """Like :meth:`pad` but sleeps the calling thread: for the compute worker thread, so the node
        stays busy (its one compute thread is occupied) exactly as long as the emulated step takes."""
        remaining = self._remaining(kind, started_at, samples, layers)
        if remaining > 0:
            time.sleep(remaining)
            return remaining
        return 0.0

    async def pad(self, kind: str, started_at: float, samples: int, layers: int) -> float:
        """Sleep until ``started_at + target``; return how long we slept (0 if compute was already slower)."""
        remaining = self._remaining(kind, started_at, samples, layers)
        if remaining > 0:
            await self._sleep(remaining)
            return remaining
        return 0.0


#: Milliseconds per second (profiles state latency in ms).
_MS = 1000.0
#: Bytes per GiB (profiles state bandwidth in GiB/s).
_GIB = 2**30


def profile_link_spec(profile, a: str, b: str, *, latency_scale: float = 1.0, bandwidth_scale: float = 1.0,
                      hop_overhead_s: float = 0.0) -> LinkSpec:
    """The emulated link between locations ``a`` and ``b`` of a :class:`scheduler.cost.LinkProfile`.

    ``latency_scale``/``bandwidth_scale`` let a 2-core machine replay a profile faster (and a tiny model stand in
    for a big one: scale bandwidth by the activation-size ratio). ``hop_overhead_s`` is a fixed delay per message
    that does not occupy the link (the cost model's per-hop overhead), added to the latency.
    """
    link = profile.link(a, b)
    return LinkSpec(latency_s=link.latency_ms / _MS * latency_scale + hop_overhead_s,
                    bandwidth_Bps=link.bandwidth_GiBps * _GIB * bandwidth_scale)


def profile_links(profile, my_location: str, location_of: Callable[[str], Optional[str]], **scales: float
                  ) -> Callable[[str], Optional[LinkSpec]]:
    """``link_for`` for :class:`LinkEmulator`: peer id -> its location (``location_of``) -> the profile's link.

    A peer without a known location (or at a location the profile lacks) is not emulated, with one warning.
    """
    cache: dict = {}
    warned: set = set()

    def link_for(peer_id: str) -> Optional[LinkSpec]:
        loc = location_of(peer_id)
        if loc is None or loc not in profile.locations:
            if peer_id not in warned:
                warned.add(peer_id)
                logger.warning("link emulation: no known location for peer %s (%r); its link is not emulated",
                               peer_id[-8:], loc)
            return None
        if loc not in cache:
            cache[loc] = profile_link_spec(profile, my_location, loc, **scales)
        return cache[loc]

    return link_for


class Emulation:
    """What one node emulates: its links (``link_emulator``) and/or its compute (``padder``); either may be None.

    Built only when asked for (``--network-profile`` / ``--compute-s-per-sample-per-layer``); a node without
    an :class:`Emulation` runs its data plane and compute untouched.
    """

    def __init__(self, link_emulator: Optional[LinkEmulator] = None, padder: Optional[ComputePadder] = None,
                 link_between: Optional[Callable[[str, str, Optional[str]], Optional[LinkSpec]]] = None):
        self.link_emulator = link_emulator
        self.padder = padder
        self._link_between = link_between

    def link_between(self, a: str, b: str, me: Optional[str] = None) -> Optional[LinkSpec]:
        """The emulated link from peer ``a`` to peer ``b`` (any two peers, for planning: the data
        node's deadlines must see the links its microbatches will cross); peer ``me`` is this node.
        None if that link is not emulated (no profile, or a location unknown)."""
        return self._link_between(a, b, me) if self._link_between is not None else None

    @classmethod
    def for_node(cls, *, profile=None, location: Optional[str] = None,
                 peer_locations: "Mapping[str, str] | Callable[[str], Optional[str]] | None" = None,
                 compute_s_per_sample_per_layer: Optional[float] = None, latency_scale: float = 1.0,
                 bandwidth_scale: float = 1.0, hop_overhead_s: float = 0.0) -> "Emulation":
        """Links from ``profile`` as seen from ``location`` (peer locations: a map or a lookup function)."""
        emulator = link_between = None
        if profile is not None:
            if location is None or location not in profile.locations:
                raise ValueError(f"location {location!r} is not in profile {profile.name!r} "
                                 f"(one of {', '.join(profile.locations)})")
            lookup = peer_locations.get if isinstance(peer_locations, Mapping) else peer_locations
            if lookup is None:
                raise ValueError("link emulation needs the peers' locations")
            scales = dict(latency_scale=latency_scale, bandwidth_scale=bandwidth_scale, hop_overhead_s=hop_overhead_s)
            emulator = LinkEmulator(profile_links(profile, location, lookup, **scales))

            def link_between(a: str, b: str, me: Optional[str], _lookup=lookup, _scales=scales) -> Optional[LinkSpec]:
                la, lb = (location if p == me else _lookup(p) for p in (a, b))
                if la not in profile.locations or lb not in profile.locations:
                    return None
                return profile_link_spec(profile, la, lb, **_scales)
        padder = ComputePadder(compute_s_per_sample_per_layer) if compute_s_per_sample_per_layer is not None else None
        return cls(emulator, padder, link_between)


def daemon_peer_locations(daemon) -> Callable[[str], Optional[str]]:
    """Peer id -> the ``location`` of its StageAdvert in the daemon's swarm view (None if unknown)."""
    def location_of(peer_id: str) -> Optional[str]:
        view = getattr(daemon, "view", None)
        entry = view.get(peer_id) if view is not None else None
        return getattr(getattr(entry, "advert", None), "location", None)
    return location_of
