"""A replica that is downloading its own stage state refuses to serve or back state at once.

Two ``--auto`` joiners of one stage in one epoch each ask the stage's other replicas, the other joiner
included, for a sketch backing the state they download; a joiner that waited for its own commit before
answering held the other's download for the whole sketch timeout, and the other held it back in turn.
"""

import asyncio
from types import SimpleNamespace

import pytest

from node.train.progress import IterationProgress
from node.train.state import StageState


def _stage_state() -> StageState:
    progress = IterationProgress(lambda: [], lambda peer: True)
    return StageState(SimpleNamespace(run_id="r"), peer_id="me", node_name="n", epochs=SimpleNamespace(stage=1),
                      progress=progress, health=None, resources=SimpleNamespace(runtime=object()),
                      life=SimpleNamespace(closed=False), compute=None)


@pytest.mark.asyncio
async def test_a_joining_replica_refuses_at_once_and_a_trained_one_waits_for_its_commit():
    state = _stage_state()
    state.joining = True
    with pytest.raises(ValueError, match="joining"):
        await asyncio.wait_for(state._wait_for(1, 5), 1.0)
    state.joining = False
    waiting = asyncio.ensure_future(state._wait_for(1, 5))  # a replica with state: answers once it commits 5
    await asyncio.sleep(0.1)
    assert not waiting.done()
    state.state_iteration = 5
    await asyncio.wait_for(waiting, 1.0)
    with pytest.raises(ValueError, match="not held here"):
        await state._wait_for(2, 5)


@pytest.mark.asyncio
async def test_a_request_waiting_when_the_download_starts_is_refused_then():
    """A sketch request that arrived just before this replica's own download began (nothing to refuse yet)
    is refused as soon as the download starts, not after the sketch timeout."""
    state = _stage_state()
    waiting = asyncio.ensure_future(state._wait_for(1, 5))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    state.joining = True  # StageState.join begins
    with pytest.raises(ValueError, match="joining"):
        await asyncio.wait_for(waiting, 1.0)
