"""The local swarm's watches print to the stderr of the moment, not to the one there was at import time
(pytest replaces stderr per test and closes the old one: printing to it raised in ``skippipe up``)."""

import io
import sys
from types import SimpleNamespace

from node.launch.watch import DeathWatch


class _DeadProc:
    def poll(self):
        return -9


def _swarm():
    dead = SimpleNamespace(index=1, stage=1, proc=_DeadProc(), alive=False)
    live = SimpleNamespace(index=2, stage=1, proc=_DeadProc(), alive=True)
    lead = SimpleNamespace(index=0, stage=0, proc=_DeadProc(), alive=True)
    return SimpleNamespace(nodes=[lead, dead, live], last_error=lambda node: "killed")


def test_a_death_is_reported_on_the_current_stderr(monkeypatch):
    now = io.StringIO()
    monkeypatch.setattr(sys, "stderr", now)
    watch = DeathWatch(_swarm())
    assert watch.check() == []  # stage 1 still has a live replica
    assert "node 1 (stage 1) died (exit code -9)" in now.getvalue()
    assert watch.check() == [] and now.getvalue().count("died") == 1  # once each


def test_a_given_stream_is_kept():
    given = io.StringIO()
    DeathWatch(_swarm(), stream=given).check()
    assert "died" in given.getvalue()
