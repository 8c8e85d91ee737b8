"""Checkpoints carry a content hash and the run config; a damaged one is refused with one line naming the file."""

from __future__ import annotations

import os

import pytest
import torch

from node.errors import UserError
from node.train.checkpoint import (HEADER_BYTES, CheckpointCorrupt, CheckpointStore, clean_stray_temp_files,
                                   read_checkpoint_file)


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 64, generator=g), "b": torch.zeros(64)}, "optimizer": {"step": 3}}


def _saved(tmp_path, **kw) -> CheckpointStore:
    store = CheckpointStore(tmp_path, "run", 1, "node-a")
    store.save(7, _state(), {"run_id": "run", "checksum": 1.5}, **kw)
    return store


def _one_line_naming(e: BaseException, path) -> None:
    text = str(e)
    assert str(path) in text and "\n" not in text, text


def test_round_trip_carries_hash_and_run_config(tmp_path):
    store = _saved(tmp_path, run_config={"lr": 1e-3, "model": "tiny"})
    ckpt = store.load()
    assert ckpt.iteration == 7 and ckpt.stage == 1 and ckpt.meta["checksum"] == 1.5
    assert ckpt.run_config == {"lr": 1e-3, "model": "tiny"}
    assert ckpt.sha256 is not None and len(ckpt.sha256) == 64
    assert torch.equal(ckpt.state["model"]["w"], _state()["model"]["w"])


@pytest.mark.parametrize("where", ["body_middle", "body_end", "header_hash", "header_length"])
def test_flipped_bytes_are_refused(tmp_path, where):
    store = _saved(tmp_path)
    data = bytearray(store.path.read_bytes())
    index = {"body_middle": HEADER_BYTES + (len(data) - HEADER_BYTES) // 2, "body_end": len(data) - 1,
             "header_hash": HEADER_BYTES - 1, "header_length": 16 + 8 + 7}[where]
    data[index] ^= 0x01
    store.path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt) as info:
        store.load()
    assert isinstance(info.value, UserError) and info.value.path == store.path
    _one_line_naming(info.value, store.path)


@pytest.mark.parametrize("keep", [0, 10, HEADER_BYTES, HEADER_BYTES + 100, -1])
def test_truncated_checkpoints_are_refused(tmp_path, keep):
    store = _saved(tmp_path)
    data = store.path.read_bytes()
    store.path.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    with pytest.raises(CheckpointCorrupt) as info:
        store.load()
    _one_line_naming(info.value, store.path)


def test_foreign_file_is_refused(tmp_path):
    store = CheckpointStore(tmp_path, "run", 1, "node-a")
    store.path.parent.mkdir(parents=True)
    store.path.write_bytes(os.urandom(4096))
    with pytest.raises(CheckpointCorrupt):
        store.load()


def _format_2(path, payload: dict) -> None:
    """A checkpoint as the previous version wrote it: the 64-byte header around a torch.save body."""
    import hashlib
    import io
    import struct

    buf = io.BytesIO()
    torch.save(payload, buf)
    body = buf.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack(">16sIIQ32s", b"SKIPPIPE-CKPT\x00\x00\x00", 2, 0, len(body),
                                 hashlib.sha256(body).digest()) + body)


@pytest.mark.parametrize("version", [1, 2])
def test_pickle_checkpoints_are_refused_with_the_converter_named_then_converted(tmp_path, version):
    from node.train.checkpoint import CheckpointOldFormat, convert_checkpoint

    store = CheckpointStore(tmp_path, "run", 2, "old")
    payload = {"format": version, "iteration": 4, "stage": 2, "state": _state(), "meta": {"checksum": 2.5}}
    if version == 1:
        store.path.parent.mkdir(parents=True)
        torch.save(payload, store.path)
    else:
        _format_2(store.path, {**payload, "run_config": {"seed": 0}})
    with pytest.raises(CheckpointOldFormat) as info:
        store.load()
    _one_line_naming(info.value, store.path)
    assert f"skippipe checkpoint convert {store.path}" in str(info.value)
    convert_checkpoint(store.path)
    ckpt = store.load()
    assert ckpt.iteration == 4 and ckpt.meta == {"checksum": 2.5} and ckpt.sha256 is not None
    assert ckpt.run_config == ({"seed": 0} if version == 2 else None)
    assert torch.equal(ckpt.state["model"]["w"], _state()["model"]["w"])


class _SideEffect:
    """Unpickling this object creates ``marker``: what a hostile checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("version", [1, 2])
def test_a_pickle_with_code_is_never_run_by_load_eval_or_the_converter(tmp_path, capsys, version):
    from node.cli import main

    marker = tmp_path / "pwned"
    store = CheckpointStore(tmp_path / "ck", "run", 0, "evil")
    payload = {"format": version, "iteration": 4, "stage": 0, "state": {"model": {"w": torch.zeros(2)}},
               "meta": {"x": _SideEffect(marker)}}
    if version == 1:
        store.path.parent.mkdir(parents=True)
        torch.save(payload, store.path)
    else:
        _format_2(store.path, payload)
    with pytest.raises(UserError):
        store.load()
    assert main(["eval", "--checkpoint", str(tmp_path / "ck" / "run")]) == 2
    assert main(["export", "--from", str(tmp_path / "ck" / "run"), "--out", str(tmp_path / "hf")]) == 2
    assert main(["checkpoint", "convert", str(store.path)]) == 2
    err = capsys.readouterr().err
    assert not marker.exists(), "unpickling ran the file's code"
    assert "Traceback" not in err and len([line for line in err.splitlines() if line.startswith("error:")]) == 3, err


def test_stray_temp_files_are_cleaned_at_the_first_save(tmp_path):
    store = CheckpointStore(tmp_path, "run", 1, "node-a")
    folder = store.path.parent
    folder.mkdir(parents=True)
    mine = folder / "node-a.pt.abc123.tmp"
    other = folder / "node-b.pt.xyz.tmp"  # another replica's: not ours to touch
    mine.write_bytes(b"half a checkpoint")
    other.write_bytes(b"someone else's")
    store.save(1, _state())
    assert not mine.exists() and other.exists()
    assert sorted(p.name for p in folder.iterdir()) == ["node-a.pt", "node-b.pt.xyz.tmp"]
    assert clean_stray_temp_files(folder) == [other] and not other.exists()
    read_checkpoint_file(store.path)  # the real one is untouched


def test_eval_names_the_corrupt_file(tmp_path, capsys):
    from node.cli import main

    store = _saved(tmp_path)
    data = bytearray(store.path.read_bytes())
    data[-10] ^= 0xFF
    store.path.write_bytes(bytes(data))
    assert main(["eval", "--checkpoint", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and str(store.path) in lines[0] and "Traceback" not in err


def test_resume_under_another_run_config_names_file_and_keys(tmp_path):
    from node.train.checkpoint import CheckpointMismatch, check_run_config

    store = _saved(tmp_path, run_config={"lr": 1e-3, "seed": 0, "model": "tiny"})
    ckpt = store.load()
    check_run_config(ckpt, {"lr": 1e-3, "seed": 0, "model": "tiny", "new_key": 1}, store.path)  # same: passes
    with pytest.raises(CheckpointMismatch) as info:
        check_run_config(ckpt, {"lr": 2e-3, "seed": 0, "model": "tiny"}, store.path)
    assert "lr" in str(info.value) and "seed" not in str(info.value)
    _one_line_naming(info.value, store.path)


def test_convert_command_rewrites_a_folder_of_old_checkpoints(tmp_path, capsys):
    from node.cli import main

    stores = [CheckpointStore(tmp_path, "run", s, f"node{s}") for s in (0, 1)]
    for s, store in enumerate(stores):
        _format_2(store.path, {"format": 2, "iteration": 3, "stage": s, "state": _state(s), "meta": {}})
    assert main(["checkpoint", "convert", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("converted ") == 2
    assert [store.load().iteration for store in stores] == [3, 3]
    assert main(["checkpoint", "convert", str(tmp_path)]) == 0  # already format 3: checked, left alone
    assert capsys.readouterr().out.count("already in the current format") == 2
