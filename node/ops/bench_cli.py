"""What the benchmark scripts under ``bench/`` share at their outermost level.

A bench starts daemons, network namespaces and temporary folders, and must leave none behind however it
ends; its user wants one ``error:`` line for a failure it can name, not a traceback. So a bench raises
:class:`BenchError` for those, and :func:`run_bench` turns it into that line (exit 2), turns Ctrl-C and
SIGTERM (a CI job's timeout, ``kill``) into exit 130 after the bench's own ``finally`` blocks have run,
and restores the SIGTERM handler it found.
"""

from __future__ import annotations

import signal
import sys
from typing import Callable

__all__ = ["BenchError", "run_bench"]


class BenchError(Exception):
    """A failure reported as one ``error:`` line (no traceback)."""


def run_bench(body: Callable[[], int], cleaned_up: str = "every daemon was stopped") -> int:
    """Run ``body`` and return its exit code, or 2 after a :class:`BenchError`, or 130 after an interruption;
    ``cleaned_up`` says in the interruption's line what the bench's ``finally`` blocks undid."""

    def on_term(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)  # so the bench's finally blocks stop its daemons
    try:
        return body()
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: interrupted ({cleaned_up})", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
