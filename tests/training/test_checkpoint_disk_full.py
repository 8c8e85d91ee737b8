"""A checkpoint disk that fills keeps the last good checkpoint and says "disk full" in one line.

The full disk is made two ways: injected (the ``diskfull`` fault's path: the temp file takes a few
blocks, then ENOSPC), and real (a tmpfs that holds one checkpoint but not a second one beside it,
mounted in a private mount namespace with ``unshare -m``; skipped where that is not allowed).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from node.errors import UserError
from node.train.checkpoint import CheckpointDiskFull, CheckpointStore, is_disk_full
from node.train.faults import FaultInjector, FaultRule, parse_fault


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(128, 128, generator=g)}, "optimizer": {"step": seed}}


def _check_kept(store: CheckpointStore, e: CheckpointDiskFull) -> None:
    text = str(e)
    assert text.startswith("disk full: ") and str(store.path) in text and "\n" not in text, text
    assert isinstance(e, UserError)
    ckpt = store.load()
    assert ckpt.iteration == 1 and torch.equal(ckpt.state["model"]["w"], _state(1)["model"]["w"])
    assert sorted(p.name for p in store.path.parent.iterdir()) == [store.path.name]  # no temp file left


def test_an_injected_full_disk_keeps_the_last_good_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path, "run", 1, "node-a")
    store.save(1, _state(1), {"checksum": 1.0})
    with pytest.raises(CheckpointDiskFull) as info:
        store.save(2, _state(2), {"checksum": 2.0}, full_after=4096)
    _check_kept(store, info.value)
    store.save(3, _state(3), {})  # room again: the next save goes through
    assert store.load().iteration == 3


def test_disk_full_is_recognised_through_wrappers_and_only_then():
    assert is_disk_full(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert is_disk_full(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)))
    try:  # torch's writer keeps only the OS's text in a RuntimeError
        try:
            raise OSError(errno.ENOSPC, "x")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 274496 vs 274384")
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)
    assert is_disk_full(RuntimeError(f"write failed: {os.strerror(errno.ENOSPC)}"))
    assert not is_disk_full(OSError(errno.EACCES, os.strerror(errno.EACCES)))
    assert not is_disk_full(RuntimeError("unexpected pos 274496 vs 274384"))


def test_other_write_errors_are_not_called_disk_full(tmp_path):
    (tmp_path / "run").write_text("a file where the run's folder should be")
    with pytest.raises(OSError) as info:
        CheckpointStore(tmp_path, "run", 1, "node-a").save(1, _state(1), {})
    assert not isinstance(info.value, CheckpointDiskFull)


def test_the_diskfull_fault_fires_once_at_or_after_its_iteration():
    faults = FaultInjector([parse_fault("diskfull@iteration=3")])
    assert faults.take(3, 0, "forward", 0) is None  # never at a hop
    assert not faults.disk_full(2)
    assert faults.disk_full(4) and not faults.disk_full(5)
    assert faults.fired == [("diskfull", 4)]
    assert FaultRule("diskfull", 0).matches(0, 0, "forward", 0) is False


_ON_TMPFS = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, sys.argv[2])
    from node.train.checkpoint import CheckpointDiskFull, CheckpointStore
    from tests.training.test_checkpoint_disk_full import _state
    store = CheckpointStore(sys.argv[1], "run", 1, "node-a")
    store.save(1, _state(1), {})
    try:
        store.save(2, _state(2), {})
        print(json.dumps({"error": None}))
    except CheckpointDiskFull as e:
        ckpt = store.load()
        print(json.dumps({"error": str(e), "iteration": ckpt.iteration,
                          "same": bool(torch.equal(ckpt.state["model"]["w"], _state(1)["model"]["w"])),
                          "files": sorted(p.name for p in store.path.parent.iterdir())}))
""")


def test_a_real_full_tmpfs_keeps_the_last_good_checkpoint(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private tmpfs")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # one checkpoint (a 64 KiB tensor plus its header and manifest) fits; a second one beside it does not
    script = f"mount -t tmpfs -o size=100k tmpfs {mnt} && exec {sys.executable} -c \"$0\" {mnt} {repo}"
    run = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, _ON_TMPFS],
                         capture_output=True, text=True, timeout=120)
    if run.returncode != 0 and "mount" in run.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {run.stderr.strip()[:200]}")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["error"] is not None, "the second checkpoint fit: the tmpfs is too large for this test"
    assert out["error"].startswith("disk full: ") and "\n" not in out["error"], out
    assert out["iteration"] == 1 and out["same"] and out["files"] == ["node-a.pt"], out


def test_a_leaving_node_hands_its_queued_hops_back_to_their_data_nodes():
    """The hops queued at a node whose disk filled (and those that still come) are reported failed to their
    data nodes, which recompute them elsewhere at once instead of at their deadlines."""
    from types import SimpleNamespace

    from node.train.common import TrainerConfig
    from node.train.pipeline import MicrobatchPipeline
    from protocol import ActivationMessage, HopFailure, MicrobatchId, TensorFrame

    sent = []
    progress = SimpleNamespace(current=4, committed=3)
    pipeline = MicrobatchPipeline(TrainerConfig(run_id="r"), peer_id="me", node_name="me", epochs=None,
                                  progress=progress, resources=None,
                                  sender=SimpleNamespace(send_control=lambda peer, msg: sent.append((peer, msg))),
                                  life=None, memory_slots=lambda: 1)
    try:
        frame = TensorFrame.from_tensor(torch.zeros(2))

        def hop(data_node, index):
            return ActivationMessage(MicrobatchId("r", 1, 4, data_node, index, 0), 1, (data_node, "me", data_node), frame)

        pipeline.on_hop(hop("d1", 0))  # iteration 4 has not opened here: it waits
        assert not sent
        assert pipeline.refuse_all("its checkpoint disk is full") == 1
        pipeline.on_hop(hop("d2", 1))  # one that comes later
        assert [(peer, type(m), m.mb.index, m.peer_id) for peer, m in sent] == [
            ("d1", HopFailure, 0, "me"), ("d2", HopFailure, 1, "me")]
        assert all(m.reason == "its checkpoint disk is full" for _, m in sent)
    finally:
        pipeline.stop_compute()
