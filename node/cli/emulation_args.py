"""Command-line flags for WAN and compute emulation, shared by ``skippipe up`` and ``skippipe node run``.

Why a module of its own: both commands must spell the flags identically and build the same
:class:`node.dataplane.emulation.Emulation` from them; each includes them with one call to
:func:`add_emulation_arguments`. Nothing is emulated unless ``--network-profile`` or
``--compute-s-per-sample-per-layer`` is given (:func:`emulation_from_args` then returns None).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional, Sequence, Union

from node.cli.validate import float_range
from node.errors import UserError
from node.dataplane.emulation import Emulation, daemon_peer_locations

__all__ = ["EmulationSettings", "add_emulation_arguments", "emulation_from_args", "daemon_peer_locations",
           "round_robin_location", "round_robin_emulation_for", "emulation_node_args"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmulationSettings:
    """What the flags asked for; :meth:`build` turns it into one node's :class:`Emulation`."""

    network_profile: Optional[str] = None
    location: Optional[str] = None
    latency_scale: float = 1.0
    bandwidth_scale: float = 1.0
    hop_overhead_s: float = 0.0
    compute_s_per_sample_per_layer: Optional[float] = None

    def load_profile(self):
        """The :class:`scheduler.cost.LinkProfile` of ``--network-profile`` (None without one)."""
        if self.network_profile is None:
            return None
        from scheduler.cost import LinkProfile
        from scheduler.errors import ScheduleError

        try:
            return LinkProfile.load(self.network_profile)
        except ScheduleError as e:
            raise UserError(f"--network-profile: {e}") from None

    def build(self, peer_locations: Union[Mapping[str, str], Callable[[str], Optional[str]], None],
              location: Optional[str] = None) -> Emulation:
        """Emulation of one node at ``location`` (default ``--location``); peers' locations from a map or lookup."""
        profile = self.load_profile()
        try:
            return Emulation.for_node(profile=profile, location=location or self.location,
                                      peer_locations=peer_locations,
                                      compute_s_per_sample_per_layer=self.compute_s_per_sample_per_layer,
                                      latency_scale=self.latency_scale, bandwidth_scale=self.bandwidth_scale,
                                      hop_overhead_s=self.hop_overhead_s)
        except ValueError as e:
            raise UserError(f"emulation: {e}") from None


def add_emulation_arguments(parser: argparse.ArgumentParser, *, location: bool = True) -> None:
    """Add the emulation flags; ``location=False`` where the command already has its own ``--location``."""
    g = parser.add_argument_group("emulation (off unless asked for)")
    g.add_argument("--network-profile", metavar="FILE", default=None,
                   help="delay every data-plane message by the profile's latency + bytes/bandwidth between "
                        "this node's --location and the peer's (scheduler profile JSON)")
    if location:
        g.add_argument("--location", default=None, help="this node's location in --network-profile")
    g.add_argument("--latency-scale", type=float_range(0, 1e6), default=1.0, help="multiply profile latencies (default 1)")
    g.add_argument("--bandwidth-scale", type=float_range(0, 1e6, lo_open=True), default=1.0, help="multiply profile bandwidths (default 1)")
    g.add_argument("--hop-overhead-s", type=float_range(0, 3600.0), default=0.0,
                   help="fixed extra delay per emulated message, not occupying the link (default 0)")
    g.add_argument("--compute-s-per-sample-per-layer", type=float_range(0, 3600.0), default=None, metavar="X",
                   help="pad each forward/backward/loss step to X x samples x layers x (1 / 1.5 / 0.25) seconds")


def emulation_from_args(args: argparse.Namespace, *, require_location: bool = True) -> Optional[EmulationSettings]:
    """The settings of the flags, or None when nothing is emulated (the default).

    ``require_location=False`` for commands that place many nodes themselves (``skippipe up``: round-robin; it has
    no ``--location``) or plan for every location (``--schedule-cost emulation``): the settings carry no location.
    """
    profile = args.network_profile
    compute = args.compute_s_per_sample_per_layer
    if profile is None and compute is None:
        return None
    settings = EmulationSettings(network_profile=profile, location=args.location if require_location else None,
                                 latency_scale=float(args.latency_scale), bandwidth_scale=float(args.bandwidth_scale),
                                 hop_overhead_s=float(args.hop_overhead_s), compute_s_per_sample_per_layer=compute)
    if profile is not None and require_location and not settings.location:
        raise UserError("--network-profile needs --location (this node's location in the profile)")
    if settings.latency_scale < 0 or settings.bandwidth_scale <= 0 or settings.hop_overhead_s < 0:
        raise UserError("--latency-scale and --hop-overhead-s must be >= 0 and --bandwidth-scale > 0")
    if compute is not None and compute < 0:
        raise UserError("--compute-s-per-sample-per-layer must be >= 0")
    if profile is not None:
        prof = settings.load_profile()
        if settings.location is not None and settings.location not in prof.locations:
            raise UserError(f"--location {settings.location!r} is not in {profile} "
                            f"(one of {', '.join(prof.locations)})")
    return settings


def round_robin_location(settings: EmulationSettings, index: int) -> Optional[str]:
    """Location of node ``index`` of a local swarm: the profile's locations round-robin (the scheduler's
    placement, :func:`scheduler.cost.nodes_round_robin`); None without a profile."""
    profile = settings.load_profile()
    return profile.locations[index % len(profile.locations)] if profile is not None else None


def round_robin_emulation_for(settings: EmulationSettings) -> Callable[[int, Sequence[str]], Emulation]:
    """``emulation_for`` for the in-process harness (``InProcessSwarm``): node i at round-robin location i."""
    def emulation_for(index: int, members: Sequence[str]) -> Emulation:
        where = {m: round_robin_location(settings, j) for j, m in enumerate(members)}
        return settings.build(where, location=round_robin_location(settings, index))
    return emulation_for


def emulation_node_args(settings: Optional[EmulationSettings], index: int) -> List[str]:
    """``skippipe node run`` flags that give daemon ``index`` of a local swarm the same emulation."""
    if settings is None:
        return []
    out: List[str] = []
    if settings.network_profile is not None:
        out += ["--network-profile", settings.network_profile, "--location", str(round_robin_location(settings, index)),
                "--latency-scale", repr(settings.latency_scale), "--bandwidth-scale", repr(settings.bandwidth_scale),
                "--hop-overhead-s", repr(settings.hop_overhead_s)]
    if settings.compute_s_per_sample_per_layer is not None:
        out += ["--compute-s-per-sample-per-layer", repr(settings.compute_s_per_sample_per_layer)]
    return out
