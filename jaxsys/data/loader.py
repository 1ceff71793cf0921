"""Grain loaders: corpus -> tokens -> packed rows -> shuffled, sharded, checkpointable batches.

Example::

  loader = make_loader(run.data, "train", batch_size=64, seed=0, workdir="/tmp/run")
  batch = next(loader)              # dict of [64 // process_count, seq_len] arrays
  state = loader.get_state()        # JSON-serialisable; loader.set_state(state) resumes
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import grain
import numpy as np
from absl import logging

from jaxsys.data import corpus
from jaxsys.data import packing
from jaxsys.data import token_cache
from jaxsys.data import tokenizer as tokenizer_lib
from jaxsys.data.config import DataConfig

# Keys of the loader state that must match on resume: a different corpus, batch size,
# seed or order would make "the next batch" meaningless. process_index/process_count are
# deliberately NOT among them: the iterator position counts global steps (see make_loader),
# so a run may resume on a different number of hosts.
_STATE_KEYS = ("split", "num_rows", "seq_len", "batch_size", "seed", "shuffle", "repeat")


def _json_safe(x: Any) -> Any:
  """numpy scalars / tuples -> plain Python, so json.dumps(state) always works."""
  if isinstance(x, dict):
    return {str(k): _json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_json_safe(v) for v in x]
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  return x


class Loader:
  """Iterator over batches: dict of np arrays [local_batch_size, seq_len] (see packing.FIELDS).

  Attributes: `tokenizer`, `seq_len`, `num_rows` (packed rows in the split), `batch_size`
  (global), `local_batch_size`, `steps_per_epoch` (global batches per pass over the rows).
  """

  def __init__(self, dataset: grain.IterDataset, *, tokenizer, rows: list[packing.PackedRows],
               meta: dict[str, Any], local_batch_size: int):
    self._dataset = dataset
    self._iterator = iter(dataset)
    self._meta = meta
    self.tokenizer = tokenizer
    self.seq_len = rows[0].seq_len
    self.num_rows = sum(map(len, rows))  # every source's, for a mixture
    self.num_tokens = sum(r.num_tokens for r in rows)
    self.batch_size = meta["batch_size"]
    self.local_batch_size = local_batch_size
    self.steps_per_epoch = self.num_rows // self.batch_size

  def __iter__(self) -> Loader:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._iterator)

  def get_state(self) -> dict[str, Any]:
    """JSON-serialisable position: grain's iterator state plus what it is only valid for."""
    return {"grain": _json_safe(self._iterator.get_state()), **self._meta}

  def set_state(self, state: dict[str, Any]) -> None:
    """Restores a `get_state` result so the next batch is the one that would have come next."""
    if not isinstance(state, dict) or "grain" not in state:
      raise ValueError(f"loader state must be a dict from Loader.get_state with key 'grain', got {type(state).__name__} with keys {sorted(state) if isinstance(state, dict) else None}")
    mismatched = {k: (state.get(k), self._meta[k]) for k in _STATE_KEYS if state.get(k) != self._meta[k]}
    if mismatched:
      details = ", ".join(f"{k}: saved {s!r} vs now {n!r}" for k, (s, n) in mismatched.items())
      raise ValueError(f"loader state was saved for a different data pipeline ({details}); resume with the same data config, batch_size and seed")
    self._iterator.set_state(state["grain"])


def make_loader(
    data_cfg: DataConfig,
    split: str,
    *,
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    repeat: bool = True,
    process_index: int = 0,
    process_count: int = 1,
    tokenizer: tokenizer_lib.Tokenizer | None = None,
    workdir: str | os.PathLike | None = None,
) -> Loader:
  """Loader over packed rows of `split` of `data_cfg.source`, sharded over processes.

  `batch_size` is global: process `process_index` yields `batch_size // process_count`
  rows per step, block `process_index` of the single-process batch (its rows
  [p * L, (p + 1) * L) for L the local batch size), so a global batch assembled from the
  processes' blocks in order is the single-process batch and no row moves between hosts. A
  non-repeating loader drops the last incomplete GLOBAL batch so every process runs the
  same number of steps (otherwise multi-host collectives would hang).

  Example::

    run = check_config(tiny_lm.get_config())  # jaxsys.train.config_check, configs/tiny_lm.py
    loader = make_loader(run.data, "val", batch_size=8, seed=0, shuffle=False, repeat=False)
    for batch in loader: ...
  """
  _check_int("batch_size", batch_size, minimum=1)
  _check_int("process_count", process_count, minimum=1)
  _check_int("seed", seed, minimum=0)
  if seed >= 2**32:  # grain's index shuffle takes a 32-bit seed
    raise ValueError(f"seed={seed} must be < 2**32")
  if not isinstance(process_index, (int, np.integer)) or not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index!r} must be in [0, process_count={process_count})")
  if batch_size % process_count:
    raise ValueError(f"batch_size={batch_size} is not divisible by process_count={process_count}; use a multiple of {process_count}")
  local_batch_size = batch_size // process_count
  source, seq_len, num_threads = data_cfg.source, data_cfg.seq_len, data_cfg.num_threads

  parts = corpus.resolve_mixture(source)  # each part listed once, read through it
  loaded: dict[int, list[bytes]] = {}

  def docs_of(i: int, keep: bool) -> list[bytes]:
    """Part i's documents, read once: kept for its rows if a tokenizer trains on them first."""
    docs = loaded.pop(i) if i in loaded else corpus.load_documents(
        parts[i][1], split, data_cfg.text_field)
    if keep:
      loaded[i] = docs
    return docs

  if tokenizer is None:
    tokenizer = _default_tokenizer(
        data_cfg, split, lambda: [d for i in range(len(parts)) for d in docs_of(i, True)], workdir,
        sources=[part for _, part in parts])
  # Each part's raw text is dropped once packed: the packed stream is all we keep (raw text
  # can be ~1 GB); with data.token_cache, a part already cached is not read at all.
  rows = [_packed_rows(data_cfg, part, split, tokenizer, lambda i=i: docs_of(i, False))
          for i, (_, part) in enumerate(parts)]
  datasets = []
  for (_, part), part_rows in zip(parts, rows):
    if len(part_rows) < batch_size:
      raise ValueError(
          f"data.source={part.spec!r} split {split!r} packs into {len(part_rows)} rows of "
          f"data.seq_len={seq_len}, fewer than batch_size={batch_size}; use a smaller batch_size "
          "or seq_len, or more data")
    ds = grain.MapDataset.source(part_rows)
    if shuffle:  # each source on its own before mixing, so the mixture keeps its weights
      ds = ds.shuffle(seed=seed + len(datasets))
    if repeat:
      # shuffle before repeat: grain folds the epoch into the seed -> a new order each epoch.
      ds = ds.repeat(None)
    datasets.append(ds)
  # A mixture draws rows from its sources by weight (grain's deterministic interleave); it
  # ends with its first source to run out when it does not repeat.
  ds = datasets[0] if len(datasets) == 1 else grain.MapDataset.mix(
      datasets, weights=[w for w, _ in parts])
  if not repeat:
    ds = ds[: (len(ds) // batch_size) * batch_size]
  # Blocks of the global row order: local batch m is global rows [m * L, (m + 1) * L), so
  # process p's step s is block m = s * process_count + p (batching is lazy: a process only
  # reads its own rows), and step s covers global rows [s * batch_size, (s + 1) * batch_size).
  ds = ds.batch(local_batch_size, drop_remainder=True)[process_index::process_count]
  read_options = grain.ReadOptions(
      num_threads=int(num_threads),
      # Rows are computed from memory, so a few batches ahead per thread hides the latency.
      prefetch_buffer_size=max(2, 2 * int(num_threads)) if num_threads > 0 else 0,
  )
  iter_ds = ds.to_iter_dataset(read_options)
  meta = dict(
      split=split, num_rows=sum(map(len, rows)), seq_len=seq_len, batch_size=int(batch_size),
      seed=int(seed), shuffle=bool(shuffle), repeat=bool(repeat),
  )
  logging.info(
      "make_loader(%s, %r): %s tokens, %s rows of %d, local batch %d of %d",
      source, split, "+".join(str(r.num_tokens) for r in rows),
      "+".join(str(len(r)) for r in rows), seq_len, local_batch_size, batch_size,
  )
  return Loader(iter_ds, tokenizer=tokenizer, rows=rows, meta=meta, local_batch_size=local_batch_size)


def _check_int(name: str, value: Any, *, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


def _packed_rows(data_cfg: DataConfig, source: corpus.Source, split: str, tokenizer,
                 docs: Callable[[], list[bytes]]) -> packing.PackedRows:
  """One source's packed rows: from data.token_cache when set, else tokenized here."""
  if data_cfg.token_cache:
    return token_cache.packed_rows(data_cfg.token_cache, source, split, data_cfg.text_field,
                                   tokenizer, seq_len=data_cfg.seq_len, docs=docs)
  return packing.PackedRows(tokenizer.encode_batch(docs()), data_cfg.seq_len)


def _default_tokenizer(data_cfg: DataConfig, split: str, docs: Callable[[], list[bytes]],
                       workdir, sources: list[corpus.Source] | None = None
                       ) -> tokenizer_lib.Tokenizer:
  """make_tokenizer for data_cfg; BPE trains on the TRAIN split only (`docs()` when `split`
  is train, called only if it trains; else read from `sources`, the resolved parts, or
  data.source), cached in workdir."""
  name = data_cfg.tokenizer
  if name != "bpe":
    return tokenizer_lib.make_tokenizer(name)
  cache_path = os.path.join(workdir, "tokenizer.json") if workdir is not None else None
  train_docs = None
  if cache_path is None or not os.path.exists(cache_path):
    # Training on val/test would leak held-out text into the vocabulary.
    train_docs = docs() if split == "train" else [
        d for src in (sources or [data_cfg.source])
        for d in corpus.load_documents(src, "train", data_cfg.text_field)]
  return tokenizer_lib.make_tokenizer(
      name, vocab_size=data_cfg.vocab_size, train_docs=train_docs, cache_path=cache_path
  )
