"""Whole-document batches under a token budget (for Hybrid Data Parallelism planners).

Unlike `loader.make_loader`, which packs a token stream into fixed rows, this loader
never splits a document: each batch is a set of whole documents whose sequence lengths
sum to at most `tokens_per_batch`, and the consumer decides how to place and pack them.

A consumer that uses only part of a batch (the HDP step keeps what its plan fits into its
micro-steps) gives the rest back with `give_back`; they start the next batch, and the
state carries them, so a resume is exact.

Length convention: a document of n tokens is ONE sequence of n - 1 (input, target)
pairs, so its sequence length is n - 1; `data.max_len` bounds that length, i.e. a kept
document has at most max_len + 1 tokens. Documents with fewer than 2 tokens carry no pair
and are dropped (counted in `dropped`).

Example::

  data = dataclasses.replace(run.data, max_len=65536, truncate_long=True)  # run: check_config's
  loader = make_document_loader(data, "train", tokens_per_batch=262144, seed=0)
  batch = next(loader)   # {"tokens": [np.int32 [n_i]], "doc_ids": int64 [k], "lengths": int64 [k]}
  state = loader.get_state()   # JSON-serialisable; loader.set_state(state) resumes
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import numpy as np
from absl import logging

from jaxsys.data import corpus
from jaxsys.data import loader as loader_lib
from jaxsys.data import tokenizer as tokenizer_lib
from jaxsys.data.config import DataConfig

# State keys that must match on resume: with any of them different, (epoch, position)
# would point into a different document order or batch partition.
_STATE_KEYS = ("split", "seed", "shuffle", "repeat", "tokens_per_batch", "max_len", "num_docs", "num_tokens")


def _read_indexed(paths: list[pathlib.Path]) -> tuple[list[int], list[bytes]]:
  """(index into `paths`, bytes) of each UTF-8 file (empty ones are dropped later: < 2 tokens).

  Read here rather than with corpus.read_documents so every document keeps its index in
  the split's document list (read_documents shifts indices when it skips a file).
  """
  ids, docs = [], []
  for i, path in enumerate(paths):
    data = pathlib.Path(path).read_bytes()
    try:
      data.decode("utf-8")
    except UnicodeDecodeError:
      continue  # A byte-level BPE cannot round-trip it (as in corpus.read_documents).
    ids.append(i)
    docs.append(data)
  return ids, docs


def _relative(path: pathlib.Path, root: pathlib.Path) -> str:
  try:
    return path.relative_to(root).as_posix()
  except ValueError:
    return str(path)


class DocumentLoader:
  """Iterator over batches of whole documents (see `make_document_loader`).

  Attributes: `tokenizer`, `max_len`, `tokens_per_batch`, `num_docs` (kept documents),
  `num_tokens` (their tokens, after truncation), `lengths` (int64 [num_docs] sequence
  lengths = tokens - 1, in split order), `doc_ids` (int64 [num_docs] each kept document's
  index in `paths`), `paths` (the split's document list), `truncated` and
  `truncated_tokens` (documents cut to max_len and tokens dropped), `dropped` (files of
  the split with < 2 tokens or not UTF-8).
  """

  def __init__(self, docs: list[np.ndarray], doc_ids: np.ndarray, *, meta: dict[str, Any], tokenizer,
               paths: list[pathlib.Path], truncated: int, truncated_tokens: int, dropped: int):
    self._docs = docs
    self._meta = meta
    self.tokenizer = tokenizer
    self.paths = paths
    self.doc_ids = doc_ids
    self.lengths = np.array([d.size - 1 for d in docs], dtype=np.int64)
    self.max_len = meta["max_len"]
    self.tokens_per_batch = meta["tokens_per_batch"]
    self.num_docs = meta["num_docs"]
    self.num_tokens = meta["num_tokens"]
    self.truncated = truncated
    self.truncated_tokens = truncated_tokens
    self.dropped = dropped
    self._epoch = 0
    self._position = 0
    self._carry: list[int] = []  # documents given back: the next batch starts with them
    self._last: list[int] | None = None  # the last batch's documents
    self._order_epoch = None  # Epoch whose order and token offsets are cached below.
    self._order = self._offsets = None

  def _epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(document order, cumulative sequence lengths along it from 0) for `epoch`, cached."""
    if self._order_epoch != epoch:
      if self._meta["shuffle"]:
        # Seeding with (seed, epoch) gives a new, reproducible order every epoch.
        order = np.random.default_rng([self._meta["seed"], epoch]).permutation(self.num_docs)
      else:
        order = np.arange(self.num_docs)
      self._order = order
      self._offsets = np.concatenate([[0], np.cumsum(self.lengths[order])])
      self._order_epoch = epoch
    return self._order, self._offsets

  def __iter__(self) -> DocumentLoader:
    return self

  def __next__(self) -> dict[str, Any]:
    carry, self._carry = self._carry, []
    if not self._meta["repeat"] and self._epoch > 0 and not carry:
      raise StopIteration
    picked = list(carry)
    budget = self.tokens_per_batch - int(self.lengths[carry].sum()) if carry else (
        self.tokens_per_batch)
    if self._meta["repeat"] or self._epoch == 0:
      order, offsets = self._epoch_order(self._epoch)
      start = self._position
      # Greedy: documents in order while they fit the budget (at least one per batch);
      # the one that would overflow starts the next batch.
      end = int(np.searchsorted(offsets, offsets[start] + budget, side="right")) - 1
      end = min(max(end, start + (0 if picked else 1)), self.num_docs)
      picked += order[start:end].tolist()
      if end < self.num_docs:
        self._position = end
      else:  # The epoch's last batch (possibly partial): batches never span two epochs.
        self._epoch, self._position = self._epoch + 1, 0
    self._last = picked
    picked = np.asarray(picked, np.int64)
    return {
        "tokens": [self._docs[i].astype(np.int32) for i in picked],
        "doc_ids": self.doc_ids[picked],
        "lengths": self.lengths[picked],
    }

  def give_back(self, indices) -> None:
    """Returns documents of the last batch (their indices in it): the next batch starts
    with them, in this order (a consumer that takes what fits its micro-steps). At least
    one document stays taken; once per batch."""
    if self._last is None:
      raise ValueError("give_back: no batch to give documents back to (call next() first; "
                       "a batch gives back once)")
    idx = [int(i) for i in indices]
    if len(set(idx)) != len(idx) or not all(0 <= i < len(self._last) for i in idx) or (
        len(idx) >= len(self._last)):
      raise ValueError(f"give_back: indices {idx} must be distinct positions in the last "
                       f"batch [0, {len(self._last)}), keeping at least one document")
    self._carry = [self._last[i] for i in idx]
    self._last = None

  def get_state(self) -> dict[str, Any]:
    """JSON-serialisable position (epoch, next document in its order, documents given
    back) plus what it is valid for."""
    return {"epoch": self._epoch, "position": self._position, "carry": list(self._carry),
            **self._meta}

  def set_state(self, state: dict[str, Any]) -> None:
    """Restores a `get_state` result so the next batch is the one that would have come next."""
    if not isinstance(state, dict) or "epoch" not in state or "position" not in state:
      keys = sorted(state) if isinstance(state, dict) else None
      raise ValueError(f"document loader state must be a dict from DocumentLoader.get_state with keys 'epoch' and 'position', got {type(state).__name__} with keys {keys}")
    mismatched = {k: (state.get(k), self._meta[k]) for k in _STATE_KEYS if state.get(k) != self._meta[k]}
    if mismatched:
      details = ", ".join(f"{k}: saved {s!r} vs now {n!r}" for k, (s, n) in mismatched.items())
      raise ValueError(f"document loader state was saved for a different data pipeline ({details}); resume with the same data config, tokens_per_batch and seed")
    epoch, position = state["epoch"], state["position"]
    if not (isinstance(epoch, int) and epoch >= 0 and isinstance(position, int) and 0 <= position < max(self.num_docs, 1)):
      raise ValueError(f"document loader state has epoch={epoch!r}, position={position!r}; need ints with epoch >= 0 and 0 <= position < num_docs={self.num_docs}")
    carry = state.get("carry", [])
    if not (isinstance(carry, list) and all(isinstance(i, int) and 0 <= i < self.num_docs
                                            for i in carry)):
      raise ValueError(f"document loader state has carry={carry!r}; need a list of document "
                       f"indices in [0, {self.num_docs})")
    self._epoch, self._position, self._carry, self._last = epoch, position, list(carry), None


def _fit_to_max_len(docs, doc_ids, paths, *, source: corpus.Source, max_len: int,
                    truncate_long: bool):
  """Drops documents without pairs, then truncates or refuses those over max_len pairs."""
  keep = [j for j, d in enumerate(docs) if d.size >= 2]
  docs = [docs[j] for j in keep]
  doc_ids = np.asarray(doc_ids, dtype=np.int64)[keep]
  over = [j for j, d in enumerate(docs) if d.size - 1 > max_len]
  truncated_tokens = sum(docs[j].size - (max_len + 1) for j in over)
  if over and not truncate_long:
    worst = max(over, key=lambda j: docs[j].size)
    name = _relative(paths[doc_ids[worst]], source.root)
    longest = docs[worst].size - 1
    raise ValueError(
        f"data.max_len={max_len} is shorter than {len(over)} document(s) of "
        f"data.source={source.spec!r}; the longest,"
        f" {name!r}, has {longest} (input, target) pairs ({longest + 1} tokens); raise data.max_len to at least"
        f" {longest} or set data.truncate_long=true"
    )
  for j in over:
    docs[j] = docs[j][: max_len + 1]
  if over:
    logging.warning(
        "make_document_loader: data.truncate_long=true truncated %d of %d documents to data.max_len=%d pairs,"
        " dropping %d tokens", len(over), len(docs), max_len, truncated_tokens,
    )
  return docs, doc_ids, len(over), truncated_tokens


def make_document_loader(
    data_cfg: DataConfig,
    split: str,
    *,
    tokens_per_batch: int,
    seed: int,
    shuffle: bool = True,
    repeat: bool = True,
    tokenizer: tokenizer_lib.Tokenizer | None = None,
    workdir: str | os.PathLike | None = None,
) -> DocumentLoader:
  """Loader of whole-document batches of `split` of `data_cfg.source` (fields: source, tokenizer, vocab_size, max_len, truncate_long).

  Each epoch takes the documents in a seeded shuffle (a new order per epoch; split order
  when shuffle=False) and cuts it greedily: documents join the batch while the sum of
  sequence lengths stays <= tokens_per_batch; the one that would overflow starts the next
  batch (never split, never dropped). Batches never span two epochs, so each epoch's last
  batch may be partial; repeat=False stops after one epoch, yielding that partial batch
  too (a whole-document consumer loses nothing by a short batch, and every document is
  seen). Every process gets the same GLOBAL batch, since the consumer plans over all
  devices; there is no per-process sharding.

  A batch is {"tokens": list of np.int32 [n_i] (n_i <= max_len + 1), "doc_ids": int64 [k]
  (indices into `loader.paths`, the split's document list), "lengths": int64 [k] (n_i - 1)}.
  """
  loader_lib._check_int("tokens_per_batch", tokens_per_batch, minimum=1)  # pylint: disable=protected-access
  loader_lib._check_int("seed", seed, minimum=0)  # pylint: disable=protected-access
  source, max_len, truncate_long = data_cfg.source, data_cfg.max_len, data_cfg.truncate_long
  if tokens_per_batch < max_len:
    raise ValueError(f"tokens_per_batch={tokens_per_batch} is smaller than data.max_len={max_len}, so a document of max_len pairs fits no batch; use tokens_per_batch >= {max_len}")

  src = corpus.resolve(source)  # listed once, for the split and the tokenizer
  paths = corpus.list_documents(src, split)
  doc_ids, raw = _read_indexed(paths)
  if not raw:
    raise ValueError(f"data.source={source!r} split {split!r} has no non-empty UTF-8 documents")
  if tokenizer is None:
    # Non-empty docs only: the same training text as make_loader, so a shared workdir cache agrees.
    tokenizer = loader_lib._default_tokenizer(  # pylint: disable=protected-access
        data_cfg, split, lambda: [d for d in raw if d], workdir, sources=[src])
  docs = [np.asarray(d).reshape(-1) for d in tokenizer.encode_batch(raw)]
  del raw  # Token arrays (1-2 bytes per token) are all we keep.
  docs, doc_ids, truncated, truncated_tokens = _fit_to_max_len(
      docs, doc_ids, paths, source=src, max_len=int(max_len), truncate_long=bool(truncate_long))
  if not docs:
    raise ValueError(f"data.source={source!r} split {split!r} has no document of >= 2 tokens; use more data")
  meta = dict(
      split=split, seed=int(seed), shuffle=bool(shuffle), repeat=bool(repeat), tokens_per_batch=int(tokens_per_batch),
      max_len=int(max_len), num_docs=len(docs), num_tokens=int(sum(d.size for d in docs)),
  )
  logging.info(
      "make_document_loader(%s, %r): %d documents, %d tokens, %d dropped (< 2 tokens or unreadable), budget %d pairs",
      source, split, len(docs), meta["num_tokens"], len(paths) - len(docs), tokens_per_batch,
  )
  return DocumentLoader(docs, doc_ids, meta=meta, tokenizer=tokenizer, paths=paths, truncated=truncated,
                        truncated_tokens=truncated_tokens, dropped=len(paths) - len(docs))
