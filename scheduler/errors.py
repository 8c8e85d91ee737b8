"""The one exception the scheduler raises for bad input or an invalid schedule."""

from __future__ import annotations

__all__ = ["ScheduleError"]


class ScheduleError(ValueError):
    """A schedule (or a scheduling request) violates a constraint.

    ``constraint`` is a short machine-readable name of the violated rule (``"route-length"``,
    ``"stage-balance"``, ``"max-jump"``, ``"memory-deadlock"``, ...), so that validators can
    report it and tests can assert on it; the message always starts with that name.
    """

    def __init__(self, constraint: str, message: str):
        super().__init__(f"{constraint}: {message}")
        self.constraint = constraint
        self.detail = message
