"""Per-replica checkpoints: weights + optimizer state + the last committed iteration.

A checkpoint is written atomically (temp file in the same folder, fsync, ``os.replace``, fsync of
the folder), so a crash leaves either the old or the new file, never a torn one; a node saves every
K iterations and on clean shutdown, so a clean restart never loses a committed step.
Layout: ``<root>/<run_id>/stage<k>/<node_name>.pt``.

File format 3 (a disk can still flip bits, a copy can be truncated, and a file may come from someone
else): a fixed :data:`HEADER_BYTES`-byte header ``MAGIC | version | body length | SHA-256 of the
body``, then the body: a safetensors blob (:mod:`node.dataplane.state_codec`) of the stage state,
whose manifest also holds ``format``, ``iteration``, ``stage``, ``meta`` and ``run_config``. Reading
it never runs code (no pickle); the hash is checked before the body is decoded, and a file whose
hash, length, header or layout does not match raises :class:`CheckpointCorrupt` naming the file.

Older files (format 1: a bare ``torch.save``; format 2: the same header around a ``torch.save``
body) are pickles, and unpickling runs whatever code the file names. They are refused with one
line (:class:`CheckpointOldFormat`) that names the converter, ``skippipe checkpoint convert PATH``
(:func:`convert_checkpoint`), which reads them with ``torch.load(weights_only=True)`` (tensors and
plain containers only: no code runs) and rewrites them in format 3.

A full disk (``ENOSPC``, or ``EDQUOT`` for a spent quota) fails the write of the temp file, which is
removed; the last good checkpoint stays as it was, and the save raises :class:`CheckpointDiskFull`, one
line that says "disk full" and names the file (a node cannot keep its progress, so it leaves the swarm).

A crash between ``mkstemp`` and ``os.replace`` leaves a ``<name>.pt.<random>.tmp`` file behind: the
first :meth:`CheckpointStore.save` of a process removes this replica's strays
(:func:`clean_stray_temp_files` does it for a whole folder).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import pathlib
import struct
import tempfile
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Dict, List, Optional

from node.dataplane.state_codec import ExpectedState, StateCodecError, decode_state, encode_state
from node.errors import UserError

__all__ = ["Checkpoint", "CheckpointStore", "CheckpointCorrupt", "CheckpointMismatch", "CheckpointOldFormat",
           "CheckpointDiskFull", "is_disk_full", "atomic_write", "read_checkpoint_file", "convert_checkpoint",
           "clean_stray_temp_files", "check_run_config", "FORMAT_VERSION"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3
#: Formats written by earlier versions: pickles, read only by the converter.
PICKLE_FORMATS = (1, 2)
#: First bytes of a format-2 or format-3 checkpoint.
MAGIC = b"SKIPPIPE-CKPT\x00\x00\x00"
#: magic (16) | version (u32) | reserved (u32) | body length (u64) | sha256 (32) = 64 bytes
_HEADER = struct.Struct(">16sIIQ32s")
HEADER_BYTES = _HEADER.size


class CheckpointCorrupt(UserError, ValueError):
    """A checkpoint file that fails its content hash, is truncated, or is not a checkpoint at all.

    ``path`` names the file, ``reason`` says what is wrong; ``str()`` is one line with both.
    """

    def __init__(self, path: os.PathLike, reason: str):
        self.path, self.reason = pathlib.Path(path), reason
        super().__init__(f"corrupt checkpoint {self.path}: {reason} (move it away to start this replica fresh, "
                         "or restore a good copy)")


class CheckpointOldFormat(CheckpointCorrupt):
    """A checkpoint in a pickle format (1 or 2): refused, because loading it could run code; one line
    naming the file and the command that converts it. A kind of :class:`CheckpointCorrupt`, so every
    caller that refuses an unreadable checkpoint refuses it too."""

    def __init__(self, path: os.PathLike, version: int):
        self.path, self.version = pathlib.Path(path), version
        self.reason = f"old pickle format {version}"
        UserError.__init__(self, f"checkpoint {self.path} is in the old pickle format {version}, which this version "
                                 "does not load (it could run code); convert it once with: skippipe checkpoint "
                                 f"convert {self.path}")


#: errno values that mean "no room to write": the disk is full, or this user's quota on it is spent
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_disk_full(e: BaseException) -> bool:
    """``e`` (or an error it was raised from) says there is no room left to write. Checks the errno,
    and the OS's message text too: torch's and safetensors' writers wrap the OS error in a
    ``RuntimeError`` that keeps only its text."""
    texts = tuple(os.strerror(n) for n in DISK_FULL_ERRNOS)
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return True
        if any(t in str(e) for t in texts):
            return True
        e = e.__cause__ or e.__context__
    return False


class CheckpointDiskFull(UserError):
    """A checkpoint that could not be written because its disk is full (or the quota spent). The temp
    file is gone and the previous checkpoint is untouched; ``str()`` is one line that says "disk full"."""

    def __init__(self, path: os.PathLike, reason: str):
        self.path, self.reason = pathlib.Path(path), reason
        super().__init__(f"disk full: cannot write checkpoint {self.path} ({reason}); the last good checkpoint "
                         "is kept (free some space, then restart this node with --resume)")


class CheckpointMismatch(UserError):
    """A sound checkpoint of another run configuration (``--resume`` with other hyper-parameters)."""


@dataclass
class Checkpoint:
    iteration: int  # last committed (stepped) iteration
    stage: int
    state: Dict[str, Any]  # StageRuntime.state_dict()
    meta: Dict[str, Any]
    run_config: Optional[Dict[str, Any]] = None  # the trainer's run configuration when it was saved
    sha256: Optional[str] = field(default=None)  # content hash of the body


def _fsync_dir(folder: pathlib.Path) -> None:
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write(body: bytes, path: pathlib.Path, *, full_after: Optional[int] = None) -> str:
    """Write ``body`` behind a format-3 header at ``path`` atomically; returns the body's SHA-256 (hex).

    :class:`CheckpointDiskFull` if the disk has no room (``path`` is then as it was). ``full_after``
    (fault injection, :mod:`node.train.faults`): the disk fills after that many bytes of the temp file."""
    path = pathlib.Path(path)
    sha = hashlib.sha256(body)
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(body), sha.digest())
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            if full_after is not None:
                f.write((head + body)[:full_after])
                f.flush()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
            f.write(head)
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        _fsync_dir(path.parent)
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, Exception) and is_disk_full(e):
            raise CheckpointDiskFull(path, _first_line(e)) from None
        raise
    return sha.hexdigest()


def _read_verified_body(path: pathlib.Path, f: BinaryIO, size: int) -> tuple[bytes, str]:
    """The body of a format-3 file after checking header, length and hash; :class:`CheckpointCorrupt` else."""
    head = f.read(HEADER_BYTES)
    if head[: len(MAGIC)] != MAGIC:
        raise CheckpointOldFormat(path, 1) if _looks_like_pickle(head) else CheckpointCorrupt(
            path, "not a checkpoint (unknown header)")
    if len(head) < HEADER_BYTES:
        raise CheckpointCorrupt(path, f"truncated header ({size} bytes)")
    _, version, _, length, digest = _HEADER.unpack(head)
    if version in PICKLE_FORMATS:
        raise CheckpointOldFormat(path, version)
    if version != FORMAT_VERSION:
        raise CheckpointCorrupt(path, f"unknown format version {version}")
    if size != HEADER_BYTES + length:
        raise CheckpointCorrupt(path, f"truncated or extended: {size - HEADER_BYTES} body bytes, header says {length}")
    body = f.read(length)
    if len(body) != length:
        raise CheckpointCorrupt(path, "truncated while reading")
    sha = hashlib.sha256(body)
    if sha.digest() != digest:
        raise CheckpointCorrupt(path, "content hash mismatch (the file was altered or damaged)")
    return body, sha.hexdigest()


def _looks_like_pickle(head: bytes) -> bool:
    """A format-1 file: torch.save's zip archive (``PK``) or a legacy raw pickle (protocol opcode ``0x80``)."""
    return head[:2] == b"PK" or head[:1] == b"\x80"


def read_checkpoint_file(path: os.PathLike, expected: Optional[ExpectedState] = None) -> tuple[dict, str]:
    """``(payload dict, sha256 hex)`` of a format-3 file, the payload holding ``format``, ``iteration``,
    ``stage``, ``meta``, ``run_config`` and ``state``. :class:`CheckpointCorrupt` if the file is bad,
    :class:`CheckpointOldFormat` if it is a pickle of an older version. Nothing in it is executed; with
    ``expected`` (the stage it is loaded into) its tensors must have exactly that stage's names and shapes."""
    path = pathlib.Path(path)
    try:
        with open(path, "rb") as f:
            body, digest = _read_verified_body(path, f, os.fstat(f.fileno()).st_size)
    except OSError as e:
        raise CheckpointCorrupt(path, f"cannot read it: {e.strerror or e}") from None
    try:
        manifest, state = decode_state(body, expected)
    except StateCodecError as e:  # the hash matched, so this is a foreign or buggy writer
        raise CheckpointCorrupt(path, f"unreadable body: {_first_line(e)}") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointCorrupt(path, f"body says format {manifest.get('format')!r:.20}")
    manifest["state"] = state
    return manifest, digest


def convert_checkpoint(path: os.PathLike) -> bool:
    """Rewrite a format-1 or format-2 checkpoint at ``path`` in format 3 (atomically, in place); True
    when it was rewritten, False when it already was format 3 (then it is only checked).

    The old body is read with ``torch.load(weights_only=True)``: torch's restricted unpickler, which
    builds tensors and plain containers and refuses everything else, so a file carrying code fails
    (:class:`CheckpointCorrupt`) without running it. A format-2 file's hash is checked first."""
    import io

    import torch

    path = pathlib.Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointCorrupt(path, f"cannot read it: {e.strerror or e}") from None
    if data[: len(MAGIC)] == MAGIC:
        if len(data) < HEADER_BYTES:
            raise CheckpointCorrupt(path, f"truncated header ({len(data)} bytes)")
        _, version, _, length, digest = _HEADER.unpack(data[:HEADER_BYTES])
        if version == FORMAT_VERSION:
            read_checkpoint_file(path)
            return False
        if version != 2:
            raise CheckpointCorrupt(path, f"unknown format version {version}")
        body = data[HEADER_BYTES:]
        if len(body) != length or hashlib.sha256(body).digest() != digest:
            raise CheckpointCorrupt(path, "content hash mismatch or truncated (the file was altered or damaged)")
    else:
        body = data
    try:
        payload = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types on a torn file or a refused global
        raise CheckpointCorrupt(path, f"not a plain checkpoint (refused without running it): {_first_line(e)}") \
            from None
    if not isinstance(payload, dict) or payload.get("format") not in PICKLE_FORMATS or "state" not in payload:
        raise CheckpointCorrupt(path, "not a checkpoint (unknown layout)")
    try:
        write_checkpoint(path, int(payload["iteration"]), int(payload["stage"]), payload["state"],
                         dict(payload.get("meta") or {}), payload.get("run_config"))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointCorrupt(path, f"incomplete payload: {_first_line(e)}") from None
    return True


def write_checkpoint(path: pathlib.Path, iteration: int, stage: int, state: Dict[str, Any],
                     meta: Dict[str, Any], run_config: Optional[Dict[str, Any]], *,
                     full_after: Optional[int] = None) -> str:
    """Encode and atomically write one format-3 checkpoint; returns its body's SHA-256 (hex)."""
    manifest = {"format": FORMAT_VERSION, "iteration": int(iteration), "stage": int(stage), "meta": dict(meta),
                "run_config": dict(run_config) if run_config is not None else None}
    try:
        body = encode_state(state, manifest)
    except StateCodecError as e:
        raise ValueError(f"cannot checkpoint this state: {e}") from None
    return atomic_write(body, path, full_after=full_after)


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
    a checkpoint without a recorded configuration (one converted from format 1) passes."""
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
             run_config: Optional[Dict[str, Any]] = None, *, full_after: Optional[int] = None) -> pathlib.Path:
        """Write the checkpoint of ``iteration`` atomically; :class:`CheckpointDiskFull` (the previous file
        kept) when the disk has no room. ``full_after``: fault injection, see :func:`atomic_write`."""
        if not self._cleaned:
            self.clean_stray_temp_files()
        digest = write_checkpoint(self.path, iteration, self.stage, state, dict(meta or {}), run_config,
                                  full_after=full_after)
        logger.debug("checkpoint of stage %d at iteration %d -> %s (sha256 %s)", self.stage, iteration, self.path,
                     digest[:16])
        return self.path

    def load(self, expected: Optional[ExpectedState] = None) -> Optional[Checkpoint]:
        """The checkpoint, None if there is none; :class:`CheckpointCorrupt` (one line naming the file) if bad,
        :class:`CheckpointOldFormat` (one line naming the converter) if written in a pickle format."""
        if not self.path.exists():
            return None
        payload, digest = read_checkpoint_file(self.path, expected)
        if payload.get("stage") != self.stage:
            raise CheckpointCorrupt(self.path, f"holds stage {payload.get('stage')!r}, not stage {self.stage}")
        try:
            run_config = payload.get("run_config")
            if run_config is not None and not isinstance(run_config, dict):
                raise TypeError("run_config is not a map")
            return Checkpoint(int(payload["iteration"]), int(payload["stage"]), payload["state"],
                              dict(payload.get("meta") or {}), run_config, digest)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointCorrupt(self.path, f"incomplete payload: {_first_line(e)}") from None
