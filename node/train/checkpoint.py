"""Per-replica checkpoints: weights + optimizer state + the last committed iteration.

A checkpoint is written atomically (temp file in the same folder, fsync, ``os.replace``, fsync of
the folder), so a crash leaves either the old or the new file, never a torn one; a node saves every
K iterations and on clean shutdown, so a clean restart never loses a committed step.
Layout: ``<root>/<run_id>/stage<k>/<node_name>.pt``.

File format 2 (a disk can still flip bits, and a copy can be truncated): a fixed
:data:`HEADER_BYTES`-byte header ``MAGIC | version | body length | SHA-256 of the body``, then the
body, which is ``torch.save({"format", "iteration", "stage", "state", "meta", "run_config"})``. The
body is hashed while it is written (no second copy in memory) and checked before anything of it is
unpickled; a file whose hash, length or header does not match raises :class:`CheckpointCorrupt`
naming the file. Format-1 files (a bare ``torch.save``, written before the hash existed) still load.

A crash between ``mkstemp`` and ``os.replace`` leaves a ``<name>.pt.<random>.tmp`` file behind: the
first :meth:`CheckpointStore.save` of a process removes this replica's strays
(:func:`clean_stray_temp_files` does it for a whole folder).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import pathlib
import struct
import tempfile
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Dict, List, Optional

import torch

from node.errors import UserError

__all__ = ["Checkpoint", "CheckpointStore", "CheckpointCorrupt", "CheckpointMismatch", "atomic_torch_save",
           "read_checkpoint_file", "clean_stray_temp_files", "check_run_config", "FORMAT_VERSION"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
#: First bytes of a format-2 checkpoint.
MAGIC = b"SKIPPIPE-CKPT\x00\x00\x00"
#: magic (16) | version (u32) | reserved (u32) | body length (u64) | sha256 (32) = 64 bytes
_HEADER = struct.Struct(">16sIIQ32s")
HEADER_BYTES = _HEADER.size
_CHUNK = 1 << 20


class CheckpointCorrupt(UserError, ValueError):
    """A checkpoint file that fails its content hash, is truncated, or is not a checkpoint at all.

    ``path`` names the file, ``reason`` says what is wrong; ``str()`` is one line with both.
    """

    def __init__(self, path: os.PathLike, reason: str):
        self.path, self.reason = pathlib.Path(path), reason
        super().__init__(f"corrupt checkpoint {self.path}: {reason} (move it away to start this replica fresh, "
                         "or restore a good copy)")


class CheckpointMismatch(UserError):
    """A sound checkpoint of another run configuration (``--resume`` with other hyper-parameters)."""


@dataclass
class Checkpoint:
    iteration: int  # last committed (stepped) iteration
    stage: int
    state: Dict[str, Any]  # StageRuntime.state_dict()
    meta: Dict[str, Any]
    run_config: Optional[Dict[str, Any]] = None  # the trainer's run configuration when it was saved
    sha256: Optional[str] = field(default=None)  # content hash of the body (None: format-1 file)


class _HashingWriter:
    """File-like that hashes and counts what torch.save writes through it."""

    def __init__(self, f: BinaryIO):
        self.f, self.sha, self.count = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.count += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


class _Window(io.RawIOBase):
    """Read-only view of ``length`` bytes of ``f`` from ``offset``: lets torch.load read the body in place."""

    def __init__(self, f: BinaryIO, offset: int, length: int):
        super().__init__()
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), max(0, self.length - self.pos))
        if n == 0:
            return 0
        self.f.seek(self.offset + self.pos)
        data = self.f.read(n)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _fsync_dir(folder: pathlib.Path) -> None:
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_torch_save(obj: Any, path: pathlib.Path) -> str:
    """Write ``obj`` as a format-2 checkpoint file at ``path`` atomically; returns the body's SHA-256 (hex)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(HEADER_BYTES))  # placeholder until the hash is known
            writer = _HashingWriter(f)
            torch.save(obj, writer)
            f.seek(0)
            f.write(_HEADER.pack(MAGIC, FORMAT_VERSION, 0, writer.count, writer.sha.digest()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)
    return writer.sha.hexdigest()


def read_checkpoint_file(path: os.PathLike) -> tuple[dict, Optional[str]]:
    """``(payload dict, sha256 hex or None for a format-1 file)``; :class:`CheckpointCorrupt` if the file is bad.

    The hash is checked (streaming) before any of the body is unpickled.
    """
    path = pathlib.Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(HEADER_BYTES)
            if head[: len(MAGIC)] != MAGIC:
                return _read_legacy(path, f), None
            if len(head) < HEADER_BYTES:
                raise CheckpointCorrupt(path, f"truncated header ({size} bytes)")
            _, version, _, length, digest = _HEADER.unpack(head)
            if version != FORMAT_VERSION:
                raise CheckpointCorrupt(path, f"unknown format version {version}")
            if size != HEADER_BYTES + length:
                raise CheckpointCorrupt(path, f"truncated or extended: {size - HEADER_BYTES} body bytes, header says "
                                              f"{length}")
            sha = hashlib.sha256()
            remaining = length
            while remaining:
                chunk = f.read(min(_CHUNK, remaining))
                if not chunk:
                    raise CheckpointCorrupt(path, "truncated while reading")
                sha.update(chunk)
                remaining -= len(chunk)
            if sha.digest() != digest:
                raise CheckpointCorrupt(path, "content hash mismatch (the file was altered or damaged)")
            try:
                payload = torch.load(io.BufferedReader(_Window(f, HEADER_BYTES, length), _CHUNK), map_location="cpu",
                                     weights_only=False)
            except Exception as e:  # noqa: BLE001 - hash matched, so this is a foreign or buggy writer
                raise CheckpointCorrupt(path, f"unreadable body: {_first_line(e)}") from None
    except OSError as e:
        raise CheckpointCorrupt(path, f"cannot read it: {e.strerror or e}") from None
    if not isinstance(payload, dict):
        raise CheckpointCorrupt(path, "not a checkpoint (no payload map)")
    return payload, sha.hexdigest()


def _read_legacy(path: pathlib.Path, f: BinaryIO) -> dict:
    """A format-1 file (bare torch.save, no hash): the best we can do is whether torch can read it."""
    f.seek(0)
    try:
        payload = torch.load(f, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - torch raises many types on a torn or foreign file
        raise CheckpointCorrupt(path, f"not a readable checkpoint: {_first_line(e)}") from None
    if not isinstance(payload, dict) or payload.get("format") != 1:
        raise CheckpointCorrupt(path, "not a checkpoint (unknown layout)")
    logger.warning("checkpoint %s has no content hash (format 1); it is rewritten with one at the next save", path)
    return payload


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


def clean_stray_temp_files(folder: os.PathLike, name: Optional[str] = None) -> List[pathlib.Path]:
    """Remove ``<name>.pt.*.tmp`` (any ``*.pt.*.tmp`` without ``name``) left in ``folder`` by a crash mid-save.

    Only call it for files no live process is writing: a replica's own files while it holds its
    identity lock, or a whole folder before any replica using it starts. Returns what was removed.
    """
    folder = pathlib.Path(folder)
    pattern = f"{name}.*.tmp" if name else "*.pt.*.tmp"
    removed = []
    for stray in folder.glob(pattern) if folder.is_dir() else ():
        try:
            stray.unlink()
            removed.append(stray)
        except FileNotFoundError:
            continue
        except OSError as e:
            logger.warning("cannot remove stray checkpoint temp file %s: %s", stray, e)
    if removed:
        logger.info("removed %d stray checkpoint temp file(s) in %s", len(removed), folder)
    return removed


def check_run_config(ckpt: Checkpoint, run_config: Dict[str, Any], path: os.PathLike,
                     keys: Optional[List[str]] = None) -> None:
    """Raise :class:`CheckpointMismatch` (one line naming ``path`` and the differing keys) when ``ckpt`` was
    saved under another run configuration. Only ``keys`` are compared (default: all keys both have);
    a checkpoint without a recorded configuration (format 1) passes."""
    saved = ckpt.run_config
    if saved is None:
        return
    names = keys if keys is not None else sorted(set(saved) & set(run_config))
    differ = [k for k in names if saved.get(k) != run_config.get(k)]
    if differ:
        shown = ", ".join(f"{k}: {saved.get(k)!r} there, {run_config.get(k)!r} here" for k in differ[:5])
        raise CheckpointMismatch(f"checkpoint {path} belongs to another run configuration ({shown}); "
                                 "resume with the same settings or move it away")


class CheckpointStore:
    """Where one replica keeps its latest checkpoint."""

    def __init__(self, root: os.PathLike, run_id: str, stage: int, node_name: str):
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in node_name)
        self.path = pathlib.Path(root) / run_id / f"stage{stage}" / f"{safe}.pt"
        self.stage = stage
        self._cleaned = False

    def clean_stray_temp_files(self) -> List[pathlib.Path]:
        """Remove this replica's ``<name>.pt.*.tmp`` files (a crash mid-save leaves one); done once per store
        before its first save. Safe while this replica holds its identity lock: nobody else writes them."""
        self._cleaned = True
        return clean_stray_temp_files(self.path.parent, self.path.name)

    def save(self, iteration: int, state: Dict[str, Any], meta: Optional[Dict[str, Any]] = None,
             run_config: Optional[Dict[str, Any]] = None) -> pathlib.Path:
        if not self._cleaned:
            self.clean_stray_temp_files()
        payload = {"format": FORMAT_VERSION, "iteration": iteration, "stage": self.stage, "state": state,
                   "meta": dict(meta or {}), "run_config": dict(run_config) if run_config is not None else None}
        digest = atomic_torch_save(payload, self.path)
        logger.debug("checkpoint of stage %d at iteration %d -> %s (sha256 %s)", self.stage, iteration, self.path,
                     digest[:16])
        return self.path

    def load(self) -> Optional[Checkpoint]:
        """The checkpoint, None if there is none; :class:`CheckpointCorrupt` (one line naming the file) if bad."""
        if not self.path.exists():
            return None
        payload, digest = read_checkpoint_file(self.path)
        if payload.get("stage") != self.stage:
            raise CheckpointCorrupt(self.path, f"holds stage {payload.get('stage')!r}, not stage {self.stage}")
        try:
            return Checkpoint(int(payload["iteration"]), int(payload["stage"]), payload["state"],
                              dict(payload.get("meta") or {}), payload.get("run_config"), digest)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointCorrupt(self.path, f"incomplete payload: {_first_line(e)}") from None
