"""Test-only: turns one real daemon into a candidate that holds wrong weights for its stage (imported by
``site`` at start-up).

Put this folder on ``PYTHONPATH`` and set ``SKIPPIPE_TEST_WRONG_STAGE_IDENTITY`` to the ``--identity`` path
of the daemon to turn; every other process ignores it. That daemon downloads its stage's verified state
as any candidate does, but keeps re-initialised weights (another seed) as its admission proof: what a
node that never took the stage's state, or took another run's, answers stage probes with.
"""

import os
import sys

_IDENTITY = os.environ.get("SKIPPIPE_TEST_WRONG_STAGE_IDENTITY")
#: The seed of the wrong weights (any seed but the run's: the run's initial weights are close to the
#: stage's early in a run).
WRONG_SEED = 424242


def _install() -> None:
    import node.compat  # noqa: F401  (before hivemind)

    from node.train import proof
    from node.train.model import build_stage

    async def load(self, module, weights):
        module.load_state_dict(build_stage(self.cfg.model, self.stage, WRONG_SEED).state_dict())

    proof.StageProof._load = load


if _IDENTITY and _IDENTITY in sys.argv:
    _install()
