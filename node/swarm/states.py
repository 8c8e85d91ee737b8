"""Named lifecycle states of a daemon, so the loops and the RPC compare members of a set, not strings.

:class:`NodeState` is what a node advertises (the ``state`` field of its ``StageAdvert``); peers
route around anything that is not ONLINE. :class:`Phase` is the daemon object's own life, which
decides whether ``stop()`` has work to do or has to wait for a stop already under way.
"""

from __future__ import annotations

import enum
import logging

__all__ = ["NodeState", "Phase", "NodeLogger"]


class NodeState(enum.StrEnum):
    """Advertised membership state (a ``StrEnum``: it goes on the wire and into JSON as its name)."""

    JOINING = "JOINING"  # adverts stored, not yet counted as a member
    ONLINE = "ONLINE"  # a member: schedules may route through it
    DRAINING = "DRAINING"  # leaving: finishes in-flight work, takes no new work
    OFFLINE = "OFFLINE"  # gone (said so, or its advert expired)


#: States in which a peer still holds its stages (a DRAINING node finishes what it has).
HOLDING_STATES = (NodeState.ONLINE, NodeState.DRAINING)


class Phase(enum.Enum):
    """Where the daemon object is in its own start/stop sequence."""

    CREATED = "created"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class NodeLogger(logging.LoggerAdapter):
    """Prefixes every message with the node's short name (``[abcd1234] ...``), so the lines of many
    nodes in one process or one merged log can be told apart; ``extra["node"]`` may be set late
    (a daemon learns its peer id only after loading its identity)."""

    def __init__(self, logger: logging.Logger, node: str = ""):
        super().__init__(logger, {"node": node})

    def set_node(self, node: str) -> None:
        self.extra["node"] = node

    def process(self, msg, kwargs):
        node = self.extra.get("node")
        return (f"[{node}] {msg}" if node else msg), kwargs
