"""User corpora (text, folder, jsonl, parquet), the document-hash split, tokenizers and --model-config."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np
import pytest

from node.cli.train_args import model_and_data_from_args
from node.errors import UserError
from node.train.corpus import iter_documents
from node.train.data import DataConfig, DataShard, is_validation_document, load_splits, load_tokenizer, validation_batches
from node.train.model import load_model_config_file

PARAGRAPHS = [f"Paragraph {i}: " + " ".join(f"word{(i * 7 + j) % 53}" for j in range(40)) for i in range(300)]


def _write_text(path: pathlib.Path, paragraphs=PARAGRAPHS) -> pathlib.Path:
    path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    return path


def _args(**kw) -> argparse.Namespace:
    base = dict(model="tiny", model_config=None, corpus="shakespeare", text_field="text", tokenizer=None,
                microbatch_size=4, seed=0, seq_len=32, num_stages=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_text_file_folder_and_jsonl_give_the_same_documents(tmp_path):
    text = _write_text(tmp_path / "c.txt")
    folder = tmp_path / "folder"
    folder.mkdir()
    _write_text(folder / "a.txt", PARAGRAPHS[:100])
    (folder / "sub").mkdir()
    _write_text(folder / "sub" / "b.md", PARAGRAPHS[100:])
    (folder / "ignored.bin").write_bytes(b"\x00\x01")
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps({"id": i, "body": p}) for i, p in enumerate(PARAGRAPHS)) + "\n")
    assert list(iter_documents(str(text))) == PARAGRAPHS
    assert list(iter_documents(str(folder))) == PARAGRAPHS
    assert list(iter_documents(str(jsonl), "body")) == PARAGRAPHS


def test_split_is_by_document_hash_and_shards_stream_from_disk(tmp_path):
    corpus = _write_text(tmp_path / "c.txt")
    cfg = DataConfig(corpus=str(corpus), seq_len=16, microbatch_size=4, val_fraction=0.1)
    splits = load_splits(cfg)
    assert isinstance(splits.train, np.memmap)  # memory-mapped, not held
    val_docs = [p for p in PARAGRAPHS if is_validation_document(p, 0.1)]
    assert 0 < len(val_docs) < len(PARAGRAPHS)
    assert len(splits.val) == sum(len(p.encode()) + 2 for p in val_docs)
    val_text = bytes(np.asarray(splits.val, dtype=np.uint8)).decode()
    assert val_text.startswith(val_docs[0])
    # the split depends on each document, not on its position: shuffling the file keeps it
    shuffled = _write_text(tmp_path / "shuffled.txt", list(reversed(PARAGRAPHS)))
    splits2 = load_splits(DataConfig(corpus=str(shuffled), seq_len=16, microbatch_size=4, val_fraction=0.1))
    assert len(splits2.val) == len(splits.val)
    a, b = DataShard(splits, cfg, 0, 2), DataShard(splits, cfg, 1, 2)
    assert len(a.windows) + len(b.windows) == (len(splits.train) - 1) // 16
    x, y = a.batch(0, 0)
    assert x.shape == (4, 16) and bool((x[:, 1:] == y[:, :-1]).all())
    assert validation_batches(splits, cfg, 1)[0][0].shape == (4, 16)


@pytest.mark.parametrize("content,needle", [
    (b"", "empty"),
    (b"\x00\x01\x02binary\x00" * 10, "binary"),
    (b"caf\xe9 au lait\n" * 10, "not UTF-8"),
])
def test_bad_text_files_are_one_clear_error(tmp_path, content, needle):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    with pytest.raises(UserError, match=needle):
        model_and_data_from_args(_args(corpus=str(bad)))


def test_bad_paths_fields_and_folders(tmp_path):
    with pytest.raises(UserError, match="no such file or folder"):
        model_and_data_from_args(_args(corpus=str(tmp_path / "missing.txt")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no .txt or .md"):
        model_and_data_from_args(_args(corpus=str(tmp_path / "empty")))
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(UserError, match="no field 'text'.*--text-field"):
        model_and_data_from_args(_args(corpus=str(jsonl)))
    jsonl.write_text("{not json\n")
    with pytest.raises(UserError, match="line 1 is not valid JSON"):
        model_and_data_from_args(_args(corpus=str(jsonl)))
    unreadable = _write_text(tmp_path / "locked.txt")
    unreadable.chmod(0)
    try:
        try:
            unreadable.open("rb").close()
            readable = True  # running as root: permissions do not apply
        except PermissionError:
            readable = False
        if not readable:
            with pytest.raises(UserError, match="cannot read"):
                model_and_data_from_args(_args(corpus=str(unreadable)))
    finally:
        unreadable.chmod(0o644)


def test_parquet_needs_pyarrow_or_reads_the_text_column(tmp_path, monkeypatch):
    path = tmp_path / "c.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        path.write_bytes(b"PAR1")
        with pytest.raises(UserError, match="pip install pyarrow"):
            list(iter_documents(str(path)))
        return
    pq.write_table(pa.table({"content": PARAGRAPHS}), str(path), row_group_size=50)
    assert list(iter_documents(str(path), "content")) == PARAGRAPHS
    with pytest.raises(UserError, match="no column 'text'"):
        list(iter_documents(str(path)))
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError, match="pip install pyarrow"):
        list(iter_documents(str(path), "content"))


def test_bpe_trains_once_caches_next_to_the_data_and_hashes_into_the_config(tmp_path):
    pytest.importorskip("tokenizers")
    corpus = _write_text(tmp_path / "c.txt")
    mcfg, data = model_and_data_from_args(_args(corpus=str(corpus), tokenizer="bpe:300"))
    cached = list((tmp_path / ".c.txt.skippipe").glob("bpe300-*.tokenizer.json"))
    assert len(cached) == 1
    assert data.tokenizer == "bpe" and data.bpe_vocab_size == 300 and len(data.tokenizer_hash) == 16
    assert mcfg.vocab_size == load_tokenizer(data).vocab_size <= 300  # the model's vocab is the tokenizer's
    mtime = cached[0].stat().st_mtime_ns
    _, again = model_and_data_from_args(_args(corpus=str(corpus), tokenizer="bpe:300"))
    assert again.tokenizer_hash == data.tokenizer_hash and cached[0].stat().st_mtime_ns == mtime
    # the same tokenizer by path has the same hash; bytes has another, so a joiner with it is refused
    _, by_path = model_and_data_from_args(_args(corpus=str(corpus), tokenizer=str(cached[0])))
    assert by_path.tokenizer_hash == data.tokenizer_hash
    _, by_bytes = model_and_data_from_args(_args(corpus=str(corpus), tokenizer="bytes"))
    assert by_bytes.tokenizer_hash != data.tokenizer_hash
    from node.train.trainer import TrainerConfig, summary_differences, training_summary

    a = training_summary(TrainerConfig(run_id="r", model=mcfg, data=data), 10)
    b = training_summary(TrainerConfig(run_id="r", model=mcfg, data=by_bytes), 10)
    assert any("tokenizer_hash" in d for d in summary_differences(a, b))
    splits = load_splits(data)
    assert splits.vocab_size == mcfg.vocab_size and int(np.max(splits.train)) < mcfg.vocab_size


def test_tokenizer_spec_errors():
    for spec, needle in [("bpe:abc", "integer"), ("bpe:100", "at least"), ("nope/tokenizer.json", "no such file")]:
        with pytest.raises(UserError, match=needle):
            model_and_data_from_args(_args(tokenizer=spec))


def test_500m_defaults_to_a_32k_bpe():
    from node.cli.train_args import default_tokenizer

    assert default_tokenizer("500m") == "bpe:32000" and default_tokenizer("tiny") == "bytes"


def test_model_config_file(tmp_path):
    good = tmp_path / "m.json"
    good.write_text(json.dumps({"layers": 8, "d_model": 64, "heads": 4, "kv_heads": 2, "ffn": 128,
                                "context": 32, "stages": 4}))
    cfg = load_model_config_file(good, vocab_size=256)
    assert (cfg.n_stages, cfg.layers_per_stage, cfg.vocab_size, cfg.n_kv_heads) == (4, 2, 256, 2)
    mcfg, data = model_and_data_from_args(_args(model_config=good, seq_len=None))
    assert mcfg.n_layers == 8 and data.seq_len == 32
    with pytest.raises(UserError, match="--num-stages 6 differs"):
        model_and_data_from_args(_args(model_config=good, num_stages=6))
    cases = [
        ({"layers": 7, "d_model": 64, "heads": 4, "ffn": 128, "context": 32, "stages": 4}, "split evenly"),
        ({"layers": 8, "d_model": 64, "heads": 3, "ffn": 128, "context": 32, "stages": 4}, "not divisible"),
        ({"layers": 8, "d_model": 64, "heads": 4, "ffn": 128, "context": 32}, "missing stages"),
        ({"layers": 8, "d_model": 64, "heads": 4, "ffn": 128, "context": 32, "stages": 4, "depth": 1}, "unknown key"),
        ({"layers": 8, "d_model": "64", "heads": 4, "ffn": 128, "context": 32, "stages": 4}, "whole number"),
        ({"layers": 8, "d_model": 64, "heads": 4, "ffn": 128, "context": 32, "stages": 4, "vocab": 300}, "differs from the tokenizer"),
    ]
    for body, needle in cases:
        good.write_text(json.dumps(body))
        with pytest.raises(UserError, match=needle):
            model_and_data_from_args(_args(model_config=good))
    good.write_text("{")
    with pytest.raises(UserError, match="not valid JSON"):
        model_and_data_from_args(_args(model_config=good))
    with pytest.raises(UserError, match="no such file"):
        model_and_data_from_args(_args(model_config=tmp_path / "missing.json"))


def test_node_run_cli_reports_bad_corpus_as_one_line(tmp_path, capsys):
    from node.cli import main

    bad = tmp_path / "x.bin"
    bad.write_bytes(b"\x00" * 100)
    rc = main(["node", "run", "--train", "--corpus", str(bad), "--rpc-port", "-1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error:") and "binary" in err[0]


def test_a_node_without_stage_0_needs_no_corpus_for_bytes(tmp_path):
    missing = str(tmp_path / "elsewhere.txt")
    mcfg, data = model_and_data_from_args(_args(corpus=missing, stages=(2,), auto=False))
    assert data.tokenizer_hash and mcfg.vocab_size == 256
    with pytest.raises(UserError, match="--tokenizer PATH"):
        model_and_data_from_args(_args(corpus=missing, stages=(2,), auto=False, tokenizer="bpe:300"))
    with pytest.raises(UserError, match="no such file or folder"):
        model_and_data_from_args(_args(corpus=missing, stages=(0,), auto=False))
