"""Test-only: turns one real daemon into a hostile stage-1 replica (imported by ``site`` at start-up).

Put this folder on ``PYTHONPATH`` and set ``SKIPPIPE_TEST_EVIL_IDENTITY`` to the ``--identity`` path of
the daemon to turn; every other process ignores it. That daemon trains honestly but serves stage state
as ``$SKIPPIPE_TEST_EVIL_MODE`` (a file, read at every request) says:

* ``pickle``: a pickle whose ``__reduce__`` creates ``$SKIPPIPE_TEST_EVIL_MARKER`` when unpickled (what
  the old ``torch.load(weights_only=False)`` ran); asked to vouch, it sketches its real weights;
* ``zeros``: a well-formed blob with all-zero weights, and sketches of those zeros (a consistent liar).
"""

import os
import sys

_IDENTITY = os.environ.get("SKIPPIPE_TEST_EVIL_IDENTITY")


class _Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _mode() -> str:
    try:
        with open(os.environ["SKIPPIPE_TEST_EVIL_MODE"]) as f:
            return f.read().strip()
    except OSError:
        return ""


def _install() -> None:
    import pickle

    import node.compat  # noqa: F401  (before hivemind)
    import torch

    from node.train import state

    honest_snapshot, honest_sketch = state.StageState._snapshot, getattr(state.StageState, "_sketch", None)

    async def snapshot(self, stage, min_iteration):
        snap = await honest_snapshot(self, stage, min_iteration)
        mode = _mode()
        if mode == "pickle":
            snap.payload = pickle.dumps({"model": _Marker(os.environ["SKIPPIPE_TEST_EVIL_MARKER"])})
        elif mode == "zeros":
            from node.dataplane.state_codec import encode_state, weights_digest

            full = self.resources.runtime.state_dict()
            zeros = {**full, "model": {k: torch.zeros_like(v) for k, v in full["model"].items()}}
            snap.payload = encode_state(zeros, {"stage": snap.stage, "iteration": snap.iteration})
            snap.digest = weights_digest(zeros["model"])
        return snap

    async def sketch(self, stage, min_iteration, nonce):
        from node.dataplane.state_codec import weights_sketch
        from node.net.records import StateClaimRecord, write_state_claim

        if _mode() != "zeros":
            return await honest_sketch(self, stage, min_iteration, nonce)
        await self._wait_for(stage, min_iteration)
        model = self.resources.runtime.module.state_dict()
        it, lie = self.state_iteration, weights_sketch({k: torch.zeros_like(v) for k, v in model.items()}, nonce)
        await write_state_claim(self.dht, self.cfg.run_id, self.peer_id, nonce,
                                StateClaimRecord(stage, it, tuple(lie)))  # the same lie, signed
        return it, lie

    state.StageState._snapshot = snapshot
    if honest_sketch is not None:  # (a version without verified state has nothing to vouch with)
        state.StageState._sketch = sketch


if _IDENTITY and _IDENTITY in sys.argv:
    _install()
