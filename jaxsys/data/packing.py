"""Packing: documents -> fixed-length rows with segment ids, positions and a loss mask.

All documents are concatenated into one token stream and cut into rows of `seq_len`;
no padding is ever produced. `segment_ids` and `positions` let attention (and RoPE) treat
each document separately, and `loss_mask` drops the one target per document that would
be the first token of the next document.

Example (docs of lengths 1, 3, 7, 2; seq_len 4)::

  stream      a | b b b | c c c c c c c | d d
  row 0       a b b b      segment_ids 1 2 2 2   positions 0 0 1 2   loss_mask 0 1 1 0
  row 1       c c c c      segment_ids 1 1 1 1   positions 0 1 2 3   loss_mask 1 1 1 1
  row 2       c c c d      segment_ids 1 1 1 2   positions 0 1 2 0   loss_mask 1 1 0 1
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FIELDS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


class PackedRows:
  """Random-access rows of a packed token stream (a grain data source).

  Rows are computed lazily in O(seq_len) from the flat stream and the document starts,
  so a 100M-token corpus costs its stream (1-2 bytes per token) and nothing per row.

  Example::

    rows = PackedRows([np.array([1, 2, 3]), np.array([4, 5])], seq_len=2)
    len(rows)            # 2: (5 - 1) // 2
    rows[0]["targets"]   # array([2, 3], dtype=int32)
  """

  def __init__(self, docs: Sequence[np.ndarray], seq_len: int):
    docs = [np.asarray(d).reshape(-1) for d in docs]
    # Empty documents would create zero-length segments; they carry no tokens anyway.
    docs = [d for d in docs if d.size]
    lengths = np.array([d.size for d in docs], dtype=np.int64)
    # np.concatenate keeps the small token dtype (uint8 / uint16) when all docs share it.
    stream = np.concatenate(docs) if docs else np.zeros((0,), np.int32)
    starts = (np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if docs
              else np.zeros((0,), np.int64))
    self._set(stream, starts, seq_len)

  @classmethod
  def from_stream(cls, stream: np.ndarray, doc_starts: np.ndarray, seq_len: int) -> PackedRows:
    """Rows of a stream already concatenated (e.g. memory-mapped from a token cache):
    `doc_starts` int64 [num_docs] are its documents' first tokens, increasing from 0."""
    rows = cls.__new__(cls)
    rows._set(stream, doc_starts, seq_len)
    return rows

  def _set(self, stream: np.ndarray, doc_starts: np.ndarray, seq_len: int) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 2:
      raise ValueError(f"data.seq_len={seq_len!r} must be an int >= 2")
    self.seq_len = int(seq_len)
    self.stream, self.doc_starts = stream, doc_starts
    self.num_docs = int(doc_starts.size)
    self.num_tokens = int(self.stream.size)
    if self.num_tokens < self.seq_len + 1:
      raise ValueError(
          f"data.seq_len={self.seq_len} needs at least seq_len+1={self.seq_len + 1} tokens,"
          f" corpus has {self.num_tokens}; use a smaller data.seq_len or more documents"
      )
    # The +1 is the target of the last input: a row needs seq_len inputs and seq_len targets.
    self._num_rows = (self.num_tokens - 1) // self.seq_len

  def __len__(self) -> int:
    return self._num_rows

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    i = int(index)
    if i < 0:
      i += self._num_rows
    if not 0 <= i < self._num_rows:
      raise IndexError(f"row {index} out of range for {self._num_rows} rows")
    start = i * self.seq_len
    pos_T = np.arange(start, start + self.seq_len, dtype=np.int64)
    # Document index of each input and of each target (the next stream token).
    doc_T = np.searchsorted(self.doc_starts, pos_T, side="right") - 1
    target_doc_T = np.searchsorted(self.doc_starts, pos_T + 1, side="right") - 1
    # A document continuing from the previous row restarts at position 0 here: the row
    # cannot attend to its earlier tokens, so RoPE positions count from the row start.
    segment_start_T = np.maximum(self.doc_starts[doc_T], start)
    return {
        "inputs": self.stream[start : start + self.seq_len].astype(np.int32),
        "targets": self.stream[start + 1 : start + self.seq_len + 1].astype(np.int32),
        "segment_ids": (doc_T - doc_T[0] + 1).astype(np.int32),
        "positions": (pos_T - segment_start_T).astype(np.int32),
        "loss_mask": (doc_T == target_doc_T).astype(np.float32),
    }


def pack_documents(docs: Sequence[np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
  """All rows of `PackedRows(docs, seq_len)` stacked to [num_rows, seq_len] (small inputs only).

  Example::

    pack_documents([np.arange(5)], seq_len=2)["inputs"]  # [[0, 1], [2, 3]]
  """
  rows = PackedRows(docs, seq_len)
  return {k: np.stack([rows[i][k] for i in range(len(rows))]) for k in FIELDS}


def random_packed_batch(batch: int, seq_len: int, *, docs_per_row: int | None = None,
                        doc_lengths: int | Sequence[int] | None = None,
                        vocab_size: int | None = None,
                        seed: int | np.random.Generator = 0) -> dict[str, np.ndarray]:
  """Random [batch, seq_len] rows in the packing layout, for tests and benchmarks.

  Documents: exactly `docs_per_row` a row, cut at distinct uniformly random points; or
  lengths drawn uniformly from `doc_lengths` (an int: all that long) until the row is
  full, the last one cut at the row's end. Gives `segment_ids` (from 1 in every row),
  `positions` and `loss_mask` as `PackedRows` does, and uniform random `inputs` and
  `targets` when `vocab_size` is given.

  Example::

    random_packed_batch(2, 8, doc_lengths=4)["segment_ids"]  # [[1 1 1 1 2 2 2 2]] x 2
  """
  if (docs_per_row is None) == (doc_lengths is None):
    raise ValueError(f"give exactly one of docs_per_row={docs_per_row!r} and "
                     f"doc_lengths={doc_lengths!r}")
  if docs_per_row is not None and not 1 <= docs_per_row <= seq_len:
    raise ValueError(f"docs_per_row={docs_per_row} must be in [1, seq_len={seq_len}]")
  choices = np.atleast_1d(doc_lengths) if doc_lengths is not None else None
  if choices is not None and (choices.size == 0 or (choices < 1).any()):
    raise ValueError(f"doc_lengths={doc_lengths!r} must be positive lengths")
  rng = np.random.default_rng(seed)  # a Generator passes through, so callers share a stream
  out = {}
  if vocab_size is not None:
    tokens = rng.integers(0, vocab_size, (batch, seq_len + 1), dtype=np.int32)
    out = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  starts = np.zeros((batch, seq_len), bool)  # True where a document starts
  starts[:, 0] = True
  for b in range(batch):
    if choices is None:
      starts[b, rng.choice(np.arange(1, seq_len), docs_per_row - 1, replace=False)] = True
      continue
    pos = int(rng.choice(choices))
    while pos < seq_len:
      starts[b, pos] = True
      pos += int(rng.choice(choices))
  seg = np.cumsum(starts, axis=1, dtype=np.int32)
  first = np.maximum.accumulate(np.where(starts, np.arange(seq_len), 0), axis=1)
  # A target that is the next document's first token is not scored.
  loss_mask = np.ones((batch, seq_len), np.float32)
  loss_mask[:, :-1] = seg[:, :-1] == seg[:, 1:]
  return {**out, "segment_ids": seg, "positions": (np.arange(seq_len) - first).astype(np.int32),
          "loss_mask": loss_mask}
