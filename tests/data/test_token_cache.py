"""Tests for jaxsys.data.token_cache: rows equal to tokenizing, reuse, stale keys, atomicity."""
import dataclasses
import json
import os
import pathlib

import chex
import numpy as np
import pytest

from conftest import load_run_config
from jaxsys.data import corpus
from jaxsys.data import loader as loader_lib
from jaxsys.data import token_cache
from jaxsys.data import tokenizer as tokenizer_lib


def _write_jsonl(root: pathlib.Path, word: str, n: int = 300) -> str:
  root.mkdir(parents=True, exist_ok=True)
  lines = [json.dumps({"text": f"{word} {i} " * (1 + i % 5)}) for i in range(n)]
  (root / "part.jsonl").write_text("\n".join(lines) + "\n")
  return str(root)


def _cfg(source: str, cache: str = "") -> object:
  return dataclasses.replace(load_run_config().data, source=source, seq_len=16, num_threads=0,
                             token_cache=cache)


def _take(ld, n):
  return [next(ld) for _ in range(n)]


def test_cached_rows_equal_tokenized_ones_and_resume_exactly(tmp_path, monkeypatch):
  """A two-source mixture: the cold (writing) and warm (memory-mapped, nothing read) loaders
  give the uncached loader's batches; a state saved without the cache resumes with it."""
  source = f"0.6:{_write_jsonl(tmp_path / 'a', 'alpha')};0.4:{_write_jsonl(tmp_path / 'b', 'beta')}"
  cache = str(tmp_path / "cache")
  make = lambda c: loader_lib.make_loader(_cfg(source, c), "train", batch_size=4, seed=0)
  plain = make("")
  expected = _take(plain, 12)
  state = json.loads(json.dumps(plain.get_state()))
  after = _take(plain, 3)
  cold = make(cache)
  assert len(list((tmp_path / "cache").iterdir())) == 2  # one entry a source
  for ld in (cold, make(cache)):
    chex.assert_trees_all_equal(_take(ld, 12), expected)
  monkeypatch.setattr(corpus, "load_documents", lambda *a, **k: pytest.fail("re-read"))
  warm = make(cache)
  assert warm.num_rows == plain.num_rows
  warm.set_state(state)
  chex.assert_trees_all_equal(_take(warm, 3), after)


def test_a_changed_file_or_tokenizer_is_a_new_entry(tmp_path):
  source = _write_jsonl(tmp_path / "a", "alpha")
  cache = tmp_path / "cache"
  byte = tokenizer_lib.make_tokenizer("byte")
  docs = lambda: corpus.load_documents(source, "all")
  first = token_cache.packed_rows(cache, source, "all", "text", byte, seq_len=16, docs=docs)
  (entry,) = cache.iterdir()
  with open(pathlib.Path(source) / "part.jsonl", "a") as f:
    f.write(json.dumps({"text": "appended"}) + "\n")
  os.utime(pathlib.Path(source) / "part.jsonl", ns=(1, 1))  # a new mtime even on coarse clocks
  second = token_cache.packed_rows(cache, source, "all", "text", byte, seq_len=16, docs=docs)
  assert second.num_tokens == first.num_tokens + len("appended")  # rebuilt, not the stale one
  assert [p.name for p in cache.iterdir()] != [entry.name] and not entry.exists()
  bpe = tokenizer_lib.BPETokenizer.train(docs(), 270)
  assert token_cache.cache_key(source, "all", "text", bpe) != token_cache.cache_key(
      source, "all", "text", byte)
  token_cache.packed_rows(cache, source, "all", "text", bpe, seq_len=16, docs=docs)
  assert len(list(cache.iterdir())) == 2  # another tokenizer's entry is kept beside it


def test_a_half_written_entry_is_never_read(tmp_path, monkeypatch):
  """A run killed while writing leaves at most a temporary directory; an entry without its
  key.json (a partial copy) is rebuilt."""
  source = _write_jsonl(tmp_path / "a", "alpha")
  cache = tmp_path / "cache"
  byte = tokenizer_lib.make_tokenizer("byte")
  docs = lambda: corpus.load_documents(source, "all")
  real_write = token_cache._write

  def killed(directory, key, tokens):
    real_write(directory, key, tokens)
    raise KeyboardInterrupt  # after every file is written, before the rename
  monkeypatch.setattr(token_cache, "_write", killed)
  with pytest.raises(KeyboardInterrupt):
    token_cache.packed_rows(cache, source, "all", "text", byte, seq_len=16, docs=docs)
  assert not list(cache.iterdir())
  monkeypatch.setattr(token_cache, "_write", real_write)
  rows = token_cache.packed_rows(cache, source, "all", "text", byte, seq_len=16, docs=docs)
  (entry,) = cache.iterdir()
  (entry / "key.json").unlink()
  (entry / "tokens.npy").unlink()  # a new file: `rows` still maps the old one
  np.save(entry / "tokens.npy", np.zeros(40, np.uint8))  # garbage of a partial copy
  again = token_cache.packed_rows(cache, source, "all", "text", byte, seq_len=16, docs=docs)
  np.testing.assert_array_equal(again.stream, rows.stream)
