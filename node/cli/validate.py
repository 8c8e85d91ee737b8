"""Validators for command-line numbers, used as argparse ``type=`` functions.

Every number a user types is checked here before anything runs: it must parse, be finite (no
``nan``/``inf``) and lie in a range. A bad value fails in argparse, which :mod:`node.cli` turns
into one ``error: argument --flag: ...`` line and exit code 2, never a traceback. Upper bounds
exist so that work proportional to an input (stages, nodes, microbatches, threads, ...) is
refused up front instead of hanging the machine or running out of memory.

Usage::

    p.add_argument("--heartbeat", type=float_range(0.05, 3600.0), ...)
    p.add_argument("--gossip-port", type=port(allow_zero=True), ...)
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, Optional

__all__ = ["float_range", "int_range", "port", "maddr_list_item", "as_text", "check_file_size", "MAX_PLAN_NODES",
           "MAX_SIMULATED_MICROBATCHES", "MAX_PLAN_WORK", "plan_work", "MAX_STAGES", "MAX_NODES", "MAX_MICROBATCHES",
           "MAX_MEMORY_SLOTS", "MAX_THREADS", "MAX_DURATION_S"]

#: Stages of a run / replicas of a plan: far above any real swarm, small enough for O(S^2) work.
MAX_STAGES = 256
#: Nodes of a plan or a local swarm.
MAX_NODES = 4096
#: Microbatches per data node per iteration (the scheduler's and simulator's work grows with it).
MAX_MICROBATCHES = 4096
#: In-flight microbatches a node accepts.
MAX_MEMORY_SLOTS = 1024
#: torch threads of a process.
MAX_THREADS = 1024
#: Longest duration any flag accepts (one week): larger values are typos or overflows.
MAX_DURATION_S = 7 * 24 * 3600.0


def _fmt(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def float_range(lo: Optional[float] = None, hi: Optional[float] = None, *, lo_open: bool = False,
                what: str = "a number") -> Callable[[str], float]:
    """A finite float in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); None leaves a side open."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if lo is not None and (value <= lo if lo_open else value < lo):
            raise argparse.ArgumentTypeError(f"must be {'greater than' if lo_open else 'at least'} {_fmt(lo)}, got {text!r}")
        if hi is not None and value > hi:
            raise argparse.ArgumentTypeError(f"must be at most {_fmt(hi)}, got {text!r}")
        return value

    parse.__name__ = "number"  # argparse names the type in some messages
    return parse


def int_range(lo: Optional[int] = None, hi: Optional[int] = None, *, what: str = "an integer") -> Callable[[str], int]:
    """An integer in ``[lo, hi]``; None leaves a side open. ``1e3`` and ``2.5`` are refused."""

    def parse(text: str) -> int:
        if not isinstance(text, str) or len(text) > 32:  # int() of a huge digit string is quadratic
            raise argparse.ArgumentTypeError(f"expected {what}, got {str(text)[:40]!r}")
        try:
            value = int(text, 10)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if lo is not None and value < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {text!r}")
        if hi is not None and value > hi:
            raise argparse.ArgumentTypeError(f"must be at most {hi}, got {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


def port(*, allow_zero: bool = True, allow_off: bool = False) -> Callable[[str], int]:
    """A TCP port 1-65535; ``allow_zero`` adds 0 (ephemeral), ``allow_off`` adds -1 (off)."""
    base = int_range(what="a TCP port")

    def parse(text: str) -> int:
        value = base(text)
        if value == 0 and allow_zero or value == -1 and allow_off or 1 <= value <= 65535:
            return value
        extra = (", 0 = ephemeral" if allow_zero else "") + (", -1 = off" if allow_off else "")
        raise argparse.ArgumentTypeError(f"must be a TCP port 1-65535{extra}, got {text!r}")

    parse.__name__ = "port"
    return parse


def maddr_list_item(text: str) -> str:
    """One multiaddr (``/ip4/1.2.3.4/tcp/31337``); ports and syntax are checked by the multiaddr parser."""
    if len(text) > 1024:
        raise argparse.ArgumentTypeError("multiaddr too long")
    try:
        from multiaddr import Multiaddr

        Multiaddr(text)
    except Exception as e:  # noqa: BLE001 - the library raises several kinds
        raise argparse.ArgumentTypeError(f"not a multiaddr: {text!r} ({str(e).split(' (string:')[0]})") from None
    return text


#: Nodes of an offline plan (the cost matrix and allocation search grow with the square).
MAX_PLAN_NODES = 1024
#: Microbatches of a schedule that ``skippipe simulate`` accepts in total.
MAX_SIMULATED_MICROBATCHES = 50_000
#: Bound on ``nodes x data nodes x microbatches x path length^2`` of an offline plan. The searches stop on
#: work budgets, but building the problem (cost matrix, constructions, baselines) still grows with this
#: product: 1,000 nodes with 250 data nodes, 6 microbatches and paths of 4 (24 million) took 20 s of CPU,
#: so a plan far beyond that is refused up front instead of running for hours.
MAX_PLAN_WORK = 30_000_000
#: Largest JSON file (profile, schedule) a command reads.
MAX_INPUT_FILE_BYTES = 64 << 20


def check_file_size(path, what: str, limit: int = MAX_INPUT_FILE_BYTES) -> None:
    """Refuse an input file larger than ``limit`` bytes (missing files are left to the reader's message)."""
    import os

    from node.errors import UserError

    try:
        size = os.stat(path).st_size
    except OSError:
        return
    if size > limit:
        raise UserError(f"{what} {path} is {size} bytes; at most {limit} are read")


def plan_work(nodes: int, data_nodes: int, microbatches: int, path_length: int) -> int:
    """The size measure that :data:`MAX_PLAN_WORK` bounds."""
    return nodes * max(data_nodes, 1) * microbatches * path_length * path_length


def as_text(check: Callable[[str], object]) -> Callable[[str], str]:
    """Validate with ``check`` but keep the text (for options that travel on as strings)."""

    def parse(text: str) -> str:
        check(text)
        return text

    parse.__name__ = getattr(check, "__name__", "value")
    return parse
