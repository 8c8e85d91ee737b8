"""Home routers on one machine: public hosts on a bridge and home hosts behind source-NAT router namespaces.

Why: on a flat bridge (:mod:`node.testing.netns`) every node can dial every other, so code that assumes
inbound connections (a node advertising an address nobody can reach, a schedule sending work to a node
that cannot accept it) still works. Here home hosts sit behind a router namespace that rewrites their
source address to its own (``MASQUERADE``) and forwards nothing inbound except replies to connections the
home side opened: no port forward, as on most home routers. One kind of router is *strict*: it also
picks a random source port for every new connection (``--random-fully``), so the mapping differs per
destination, like a symmetric NAT, and an address learned from one peer is useless to another.

Needs root, iproute2 and iptables; :func:`nat_unavailable` says why not, for a skip.

Layout of a :class:`NatLab` named ``p`` (subnet ``S``), hosts numbered public first, then each home::

    root namespace: bridge ``p-br`` (the "internet") with ``10.S.0.1/24``
    public host ``p-i``:        eth0 = 10.S.0.(10+i)/24, egress capped by tbf
    router ``p-rh`` of home h:  eth0 = 10.S.0.(200+h)/24 (its public address, egress capped by tbf),
                                bridge ``lan`` = 10.(S+1+h).0.1/24, MASQUERADE out of eth0,
                                inbound forwarding only for connections the home side opened
    home host ``p-i``:          eth0 = 10.(S+1+h).0.(10+j)/24, default route via the router, capped by tbf

:class:`NatLab` offers ``hosts``, ``address(i)`` and ``namespace(i)`` like :class:`NetnsLab`, so
:class:`node.testing.netns.NamespaceSwarm` runs node ``i`` on host ``i`` unchanged.
"""

from __future__ import annotations

import enum
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Sequence

from node.testing.netns import _BridgeLab, _in, _ip, _shape, netns_unavailable

__all__ = ["NatKind", "Home", "NatLab", "nat_unavailable"]

#: Last octet of router ``h``'s public address is this plus ``h`` (public hosts use 10..199).
_ROUTER_OCTET = 200
#: Last octet of the first host on a segment (the gateway is .1).
_FIRST_HOST_OCTET = 10


class NatKind(enum.Enum):
    """How a home router maps the source of outgoing connections."""

    #: one public port per inside port while it is free (port preserving, like most home routers)
    PLAIN = "plain"
    #: a random public port for every connection: different per destination, like a symmetric NAT
    STRICT = "strict"


@dataclass(frozen=True)
class Home:
    """One home network: ``hosts`` machines behind one router of kind ``kind``."""

    hosts: int
    kind: NatKind = NatKind.PLAIN


def nat_unavailable() -> str | None:
    """Why a NAT lab cannot be made here (None when it can)."""
    why = netns_unavailable()
    if why is not None:
        return why
    if shutil.which("iptables") is None:
        return "iptables is not installed (apt-get install iptables)"
    return None


@dataclass
class NatLab(_BridgeLab):
    """``public`` hosts on the internet bridge and one router namespace per entry of ``homes``.

    ``name`` is at most 6 letters or digits (interface names have at most 15 characters). Subnets
    ``10.S.0.0/24`` .. ``10.(S+len(homes)).0.0/24`` are used; the home subnets exist only inside the lab.
    """

    name: str
    public: int = 2
    homes: Sequence[Home] = (Home(1, NatKind.PLAIN), Home(1, NatKind.STRICT))
    subnet: int = 88
    rate_mbit: float = 100.0
    namespaces: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (1 <= len(self.name) <= 6 and self.name.isalnum()):
            raise ValueError("lab name: 1-6 letters or digits")
        if not 1 <= self.public <= _ROUTER_OCTET - _FIRST_HOST_OCTET:
            raise ValueError(f"public must be 1..{_ROUTER_OCTET - _FIRST_HOST_OCTET}")
        if not 0 <= len(self.homes) <= 50 or any(not 1 <= h.hosts <= 200 for h in self.homes):
            raise ValueError("at most 50 homes of 1..200 hosts each")
        if not 1 <= self.subnet <= 254 - len(self.homes):
            raise ValueError("subnet leaves no room for the home subnets")

    # --- the NetnsLab interface -------------------------------------------------------------------
    @property
    def hosts(self) -> int:
        return self.public + sum(h.hosts for h in self.homes)

    def namespace(self, index: int) -> str:
        self._check(index)
        return super().namespace(index)

    def address(self, index: int) -> str:
        """The host's own address (a home host's is private: only its router can reach it)."""
        home, j = self.home_of(index)
        if home is None:
            return f"10.{self.subnet}.0.{_FIRST_HOST_OCTET + index}"
        return f"10.{self.subnet + 1 + home}.0.{_FIRST_HOST_OCTET + j}"

    # --- NAT specifics ----------------------------------------------------------------------------
    def home_of(self, index: int) -> tuple[int | None, int]:
        """``(home, position in it)`` of host ``index``; ``(None, index)`` for a public host."""
        self._check(index)
        if index < self.public:
            return None, index
        rest = index - self.public
        for h, home in enumerate(self.homes):
            if rest < home.hosts:
                return h, rest
            rest -= home.hosts
        raise AssertionError("unreachable")

    def is_public(self, index: int) -> bool:
        return self.home_of(index)[0] is None

    def kind_of(self, index: int) -> NatKind | None:
        """The NAT kind in front of host ``index`` (None for a public host)."""
        home, _ = self.home_of(index)
        return None if home is None else self.homes[home].kind

    def router(self, home: int) -> str:
        return f"{self.name}-r{home}"

    def router_address(self, home: int) -> str:
        """The public address a home's hosts appear from."""
        return f"10.{self.subnet}.0.{_ROUTER_OCTET + home}"

    def _check(self, index: int) -> None:
        if not 0 <= index < self.hosts:
            raise IndexError(f"host {index}: the lab has {self.hosts}")

    # --- life -------------------------------------------------------------------------------------
    def up(self) -> "NatLab":
        """Create the internet bridge, the public hosts, the routers and the home hosts; on failure undo."""
        try:
            self.down()  # leftovers of a run that was killed before it could clean up
            self._make_bridge()
            for i in range(self.public):
                self._add_on_bridge(self.namespace(i), f"{self.name}v{i}", self.address(i))
            for h, home in enumerate(self.homes):
                self._add_router(h, home)
            for i in range(self.public, self.hosts):
                self._add_home_host(i)
        except BaseException:
            self.down()
            raise
        return self

    def _add_router(self, h: int, home: Home) -> None:
        ns = self.router(h)
        self._add_on_bridge(ns, f"{self.name}r{h}", self.router_address(h))
        _ip("-n", ns, "link", "add", "lan", "type", "bridge")
        _ip("-n", ns, "addr", "add", f"10.{self.subnet + 1 + h}.0.1/24", "dev", "lan")
        _ip("-n", ns, "link", "set", "lan", "up")
        _in(ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        masquerade = ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "MASQUERADE"]
        if home.kind is NatKind.STRICT:
            masquerade.append("--random-fully")
        _in(ns, *masquerade)
        # inbound: only replies to what the home side opened (no port forward, no DMZ)
        _in(ns, "iptables", "-A", "FORWARD", "-i", "eth0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
            "-j", "ACCEPT")
        _in(ns, "iptables", "-A", "FORWARD", "-i", "eth0", "-j", "DROP")

    def _add_home_host(self, index: int) -> None:
        h, j = self.home_of(index)
        ns, router = self.namespace(index), self.router(h)
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        inner = f"lan{j}"
        _ip("-n", router, "link", "add", inner, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", router, "link", "set", inner, "master", "lan")
        _ip("-n", router, "link", "set", inner, "up")
        _ip("-n", ns, "addr", "add", f"{self.address(index)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "route", "add", "default", "via", f"10.{self.subnet + 1 + h}.0.1")
        _shape(ns, "eth0", self.rate_mbit)

    def down(self) -> None:
        """Remove every namespace of this lab (veth ends and router rules go with them) and the bridge."""
        for i in range(self.hosts):
            _ip("netns", "del", f"{self.name}-{i}", check=False)
        for i in range(self.public):  # outer veth ends a killed run's processes may still hold (NetnsLab.down)
            _ip("link", "del", f"{self.name}v{i}", check=False)
        for h in range(len(self.homes)):
            _ip("netns", "del", self.router(h), check=False)
            _ip("link", "del", f"{self.name}r{h}", check=False)
        _ip("link", "del", self.bridge, check=False)
        self.namespaces.clear()

