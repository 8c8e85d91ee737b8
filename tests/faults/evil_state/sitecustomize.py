"""Test-only: turns one real daemon into a hostile stage-1 replica (imported by ``site`` at start-up).

Put this folder on ``PYTHONPATH`` and set ``SKIPPIPE_TEST_EVIL_IDENTITY`` to the ``--identity`` path of
the daemon to turn; every other process ignores it. That daemon trains honestly but serves stage state
as ``$SKIPPIPE_TEST_EVIL_MODE`` (a file, read at every request) says:

* ``pickle``: a pickle whose ``__reduce__`` creates ``$SKIPPIPE_TEST_EVIL_MARKER`` when unpickled (what
  the old ``torch.load(weights_only=False)`` ran); asked to vouch, it sketches its real weights;
* ``zeros``: a well-formed blob with all-zero weights, and sketches of those zeros (a consistent liar);
* ``drift``: weights shifted by :data:`DRIFT` in every element (100 learning-rate steps at 1e-3), sketches
  of those, and a gradient-norm report whose parameter checksum is off: a replica that says it drifted,
  so that its only partner sees a tie and tries to copy it.

``SKIPPIPE_TEST_WRONG_STAGE_IDENTITY`` turns another daemon into a candidate that holds wrong weights for its
stage: it downloads its stage's verified state as any candidate does, but keeps re-initialised weights
(seed :data:`WRONG_SEED`) as its admission proof (what a node that never took the stage's state, or took
another run's, answers stage probes with).
"""

import os
import sys

_IDENTITY = os.environ.get("SKIPPIPE_TEST_EVIL_IDENTITY")
_WRONG_STAGE = os.environ.get("SKIPPIPE_TEST_WRONG_STAGE_IDENTITY")
#: What ``drift`` adds to every weight (100 steps of lr 1e-3: far beyond a tie's copy bound of 10).
DRIFT = 0.1
#: Seed of the wrong candidate's weights (not the run's: the run's initial weights are close to the stage's
#: early in a run).
WRONG_SEED = 424242


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
        elif mode in ("zeros", "drift"):
            from node.dataplane.state_codec import encode_state, weights_digest

            full = self.resources.runtime.state_dict()
            wrong = {**full, "model": {k: _wrong(v, mode) for k, v in full["model"].items()}}
            snap.payload = encode_state(wrong, {"stage": snap.stage, "iteration": snap.iteration})
            snap.digest = weights_digest(wrong["model"])
        return snap

    def _wrong(v, mode):
        return torch.zeros_like(v) if mode == "zeros" else v + DRIFT if v.is_floating_point() else v

    async def sketch(self, stage, min_iteration, nonce):
        from node.dataplane.state_codec import weights_sketch
        from node.net.records import StateClaimRecord, write_state_claim

        mode = _mode()
        if mode not in ("zeros", "drift"):
            return await honest_sketch(self, stage, min_iteration, nonce)
        await self._wait_for(stage, min_iteration)
        model = self.resources.runtime.module.state_dict()
        it, lie = self.state_iteration, weights_sketch({k: _wrong(v, mode) for k, v in model.items()}, nonce)
        await write_state_claim(self.dht, self.cfg.run_id, self.peer_id, nonce,
                                StateClaimRecord(stage, it, tuple(lie)))  # the same lie, signed
        return it, lie

    state.StageState._snapshot = snapshot
    if honest_sketch is not None:  # (a version without verified state has nothing to vouch with)
        state.StageState._sketch = sketch

    from node.train import runtime

    honest_checksum = runtime.StageRuntime.checksum

    def checksum(self):
        value = honest_checksum(self)
        return value + 1.0 + abs(value) * 1e-3 if _mode() == "drift" else value

    runtime.StageRuntime.checksum = checksum


def _install_wrong_stage() -> None:
    import node.compat  # noqa: F401  (before hivemind)

    from node.train import proof
    from node.train.model import build_stage

    async def load(self, module, weights):
        module.load_state_dict(build_stage(self.cfg.model, self.stage, WRONG_SEED).state_dict())

    proof.StageProof._load = load


if _IDENTITY and _IDENTITY in sys.argv:
    _install()
if _WRONG_STAGE and _WRONG_STAGE in sys.argv:
    _install_wrong_stage()
