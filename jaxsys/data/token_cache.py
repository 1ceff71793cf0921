"""Pre-tokenized corpora on disk (`data.token_cache=<dir>`): a source's split tokenized once,
memory-mapped by every later run instead of read and tokenized again.

An entry is a directory `<dir>/<source>-<split>-<tokenizer hash>-<key hash>/` holding
`tokens.npy` (the split's non-empty documents' tokens, one flat array in the tokenizer's
dtype), `starts.npy` (int64 [num_docs], each document's first token) and `key.json`. The key
is everything the tokens depend on: the source's files (path, size, mtime), the tokenizer
(its class and the sha256 of its tokenizer.json), `data.text_field`, the split and its
fractions, and this format's version. A changed file or tokenizer is a new key, so a stale
entry is never read: it is rebuilt, and the older entries of that source, split and
tokenizer are removed. An entry is written in a temporary directory and renamed into place,
so a run killed while writing leaves nothing that is read.

Example::

  rows = packed_rows("/cache", "/data/web/*.parquet", "train", "text", tokenizer, seq_len=1024,
                     docs=lambda: corpus.load_documents("/data/web/*.parquet", "train"))
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import tempfile
from collections.abc import Callable

import numpy as np
from absl import logging

from jaxsys.data import corpus
from jaxsys.data import packing

VERSION = 1


def tokenizer_identity(tokenizer) -> str:
  """Class and sha256 of the tokenizer's tokenizer.json: equal only if they encode alike."""
  spec = tokenizer.hf_tokenizer.to_str().encode()
  return f"{type(tokenizer).__name__}:{hashlib.sha256(spec).hexdigest()}"


def cache_key(source: str | corpus.Source, split: str, text_field: str, tokenizer) -> dict:
  """What the tokens of `split` of one source depend on (JSON-serialisable)."""
  src = corpus.resolve(source)
  stats = []
  for path in src.files:
    st = path.stat()
    stats.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
  return {"version": VERSION, "source": src.spec, "root": str(src.root.resolve()), "split": split,
          "fractions": [corpus.VAL_FRACTION, corpus.TEST_FRACTION],
          "text_field": text_field if src.format is not None else None,
          "tokenizer": tokenizer_identity(tokenizer), "files": stats}


def _entry_name(source: str) -> str:
  """A readable, filesystem-safe prefix naming the source (the key hash makes it unique)."""
  return re.sub(r"[^A-Za-z0-9._-]+", "_", source).strip("_")[-60:] or "source"


def _write(directory: pathlib.Path, key: dict, tokens: list[np.ndarray]) -> None:
  tokens = [t.reshape(-1) for t in tokens if t.size]  # as PackedRows drops empty documents
  lengths = np.array([t.size for t in tokens], np.int64)
  stream = np.concatenate(tokens) if tokens else np.zeros((0,), np.int32)
  np.save(directory / "tokens.npy", stream)
  np.save(directory / "starts.npy", np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(
      np.int64) if tokens else np.zeros((0,), np.int64))
  # key.json last: with it the entry is complete (the rename is what publishes it).
  (directory / "key.json").write_text(json.dumps(key))


def _complete(entry: pathlib.Path, key: dict) -> bool:
  """Whether `entry` was published whole for `key` (its key.json is written last)."""
  try:
    return json.loads((entry / "key.json").read_text()) == key
  except (OSError, ValueError):
    return False


def packed_rows(cache_dir: str | os.PathLike, source: str | corpus.Source, split: str,
                text_field: str, tokenizer, *, seq_len: int,
                docs: Callable[[], list[bytes]]) -> packing.PackedRows:
  """`split` of one `source` (or its `corpus.resolve`d form) as packed rows from the cache,
  memory-mapped; on a miss, `docs()` tokenized and written to it first. Rows equal
  `PackedRows(tokenizer.encode_batch(docs()), seq_len)`."""
  key = cache_key(source, split, text_field, tokenizer)
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
  cache = pathlib.Path(cache_dir)
  # Entries differing only in the files are one source's versions: older ones are stale.
  # Another tokenizer or text field is another entry, kept beside it.
  reader = hashlib.sha256(f"{key['tokenizer']}/{key['text_field']}".encode()).hexdigest()[:8]
  prefix = f"{_entry_name(key['source'])}-{split}-{reader}-"
  entry = cache / f"{prefix}{digest}"
  if not _complete(entry, key):
    cache.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache))
    try:
      _write(tmp, key, tokenizer.encode_batch(docs()))
      # A broken entry is replaced; one another process completed meanwhile is equal: kept.
      if entry.exists() and not _complete(entry, key):
        shutil.rmtree(entry, ignore_errors=True)
      try:
        os.rename(tmp, entry)
      except OSError:  # another process published the same entry first: theirs is equal
        pass
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
    for old in cache.glob(f"{prefix}*"):  # the source's stale entries: never read again
      if old != entry and old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
    logging.info("token cache: wrote %s", entry)
  stream = np.load(entry / "tokens.npy", mmap_mode="r")
  starts = np.load(entry / "starts.npy")
  return packing.PackedRows.from_stream(stream, starts, seq_len)
