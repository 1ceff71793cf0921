"""Tests for jaxsys.data.packing: hand-checked rows and a property test against a loop reference."""

import chex
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxsys.data import packing

# Lengths 1, 3, 7, 2; token values say which document they come from.
DOCS = [np.array([10]), np.array([20, 21, 22]), np.arange(30, 37), np.array([40, 41])]
EXPECTED = {  # seq_len 4 -> (13 - 1) // 4 = 3 rows
    "inputs": [[10, 20, 21, 22], [30, 31, 32, 33], [34, 35, 36, 40]],
    "targets": [[20, 21, 22, 30], [31, 32, 33, 34], [35, 36, 40, 41]],
    "segment_ids": [[1, 2, 2, 2], [1, 1, 1, 1], [1, 1, 1, 2]],
    "positions": [[0, 0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 0]],
    "loss_mask": [[0, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 1]],
}
DTYPES = {"inputs": np.int32, "targets": np.int32, "segment_ids": np.int32, "positions": np.int32,
          "loss_mask": np.float32}


def test_hand_made_rows():
  rows = packing.PackedRows(DOCS, seq_len=4)
  assert len(rows) == 3
  for i in range(3):
    row = rows[i]
    assert set(row) == set(packing.FIELDS)
    for k in packing.FIELDS:
      assert row[k].dtype == DTYPES[k], k
      chex.assert_shape(row[k], (4,))
      np.testing.assert_array_equal(row[k], EXPECTED[k][i], err_msg=f"row {i} {k}")
  np.testing.assert_array_equal(rows[-1]["inputs"], EXPECTED["inputs"][2])
  with pytest.raises(IndexError):
    rows[3]


def test_pack_documents_stacks_rows():
  packed = packing.pack_documents(DOCS, seq_len=4)
  for k in packing.FIELDS:
    chex.assert_shape(packed[k], (3, 4))
    np.testing.assert_array_equal(packed[k], np.asarray(EXPECTED[k], DTYPES[k]), err_msg=k)


def test_stream_keeps_small_dtype_and_skips_empty_docs():
  docs = [np.array([1, 2], np.uint8), np.array([], np.uint8), np.array([3, 4, 5], np.uint8)]
  rows = packing.PackedRows(docs, seq_len=2)
  assert rows.stream.dtype == np.uint8 and rows.num_docs == 2
  np.testing.assert_array_equal(rows.doc_starts, [0, 2])
  np.testing.assert_array_equal(rows[0]["loss_mask"], [1, 0])
  np.testing.assert_array_equal(rows[1]["segment_ids"], [1, 1])


@pytest.mark.parametrize("seq_len, match", [
    (1, r"data\.seq_len=1 must be an int >= 2"),
    (13, r"data\.seq_len=13 needs at least seq_len\+1=14 tokens, corpus has 13"),
])
def test_errors(seq_len, match):
  with pytest.raises(ValueError, match=match):
    packing.PackedRows(DOCS, seq_len)


def _reference_rows(docs, seq_len):
  """Obviously-correct loop version: walk the stream token by token."""
  stream = [int(t) for d in docs for t in d]
  doc_of = [j for j, d in enumerate(docs) for _ in d]
  num_rows = (len(stream) - 1) // seq_len
  out = {k: np.zeros((num_rows, seq_len), DTYPES[k]) for k in packing.FIELDS}
  for r in range(num_rows):
    segment, position = 0, 0
    for t in range(seq_len):
      p = r * seq_len + t
      if t == 0 or doc_of[p] != doc_of[p - 1]:
        segment, position = segment + 1, 0
      out["inputs"][r, t] = stream[p]
      out["targets"][r, t] = stream[p + 1]
      out["segment_ids"][r, t] = segment
      out["positions"][r, t] = position
      out["loss_mask"][r, t] = doc_of[p] == doc_of[p + 1]
      position += 1
  return out, np.array(stream), np.array(doc_of)


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=12),
    seq_len=st.integers(2, 9),
)
def test_property_matches_reference(lengths, seq_len):
  rng = np.random.default_rng(sum(lengths) * 31 + seq_len)
  docs = [rng.integers(0, 256, size=n).astype(np.uint8) for n in lengths]
  total = sum(lengths)
  if total < seq_len + 1:
    with pytest.raises(ValueError, match="needs at least"):
      packing.PackedRows(docs, seq_len)
    return
  packed = packing.pack_documents(docs, seq_len)
  expected, stream, doc_of = _reference_rows([d for d in docs if d.size], seq_len)
  for k in packing.FIELDS:
    np.testing.assert_array_equal(packed[k], expected[k], err_msg=k)
  n = packed["inputs"].size
  # Inputs and targets reproduce the stream (shifted by one).
  np.testing.assert_array_equal(packed["inputs"].reshape(-1), stream[:n])
  np.testing.assert_array_equal(packed["targets"].reshape(-1), stream[1 : n + 1])
  # loss_mask == 1 exactly where input and target belong to the same document.
  same_doc = doc_of[:n] == doc_of[1 : n + 1]
  np.testing.assert_array_equal(packed["loss_mask"].reshape(-1) == 1, same_doc)
  # Segment ids start at 1 in every row and never skip.
  assert (packed["segment_ids"][:, 0] == 1).all()
  assert set(np.diff(packed["segment_ids"], axis=1).reshape(-1)) <= {0, 1}


def _split_row(row: dict[str, np.ndarray], b: int) -> list[np.ndarray]:
  """Row b's documents as token arrays, its last target appended to the last one."""
  stream = np.append(row["inputs"][b], row["targets"][b, -1])
  cuts = np.flatnonzero(np.diff(row["segment_ids"][b])) + 1
  return np.split(stream, cuts)


@pytest.mark.parametrize("kw", [dict(docs_per_row=1), dict(docs_per_row=5),
                                dict(doc_lengths=4), dict(doc_lengths=(1, 1, 2, 9))])
def test_random_packed_batch_is_what_packing_its_documents_gives(kw):
  batch = packing.random_packed_batch(3, 24, vocab_size=50, seed=1, **kw)
  assert set(batch) == set(packing.FIELDS)
  for k in packing.FIELDS:
    assert batch[k].dtype == DTYPES[k] and batch[k].shape == (3, 24), k
  assert 0 <= batch["inputs"].min() and batch["inputs"].max() < 50
  np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
  for b in range(3):
    docs = _split_row(batch, b)
    row = packing.pack_documents(docs, 24)
    for k in packing.FIELDS:
      np.testing.assert_array_equal(row[k][0], batch[k][b], err_msg=f"row {b} {k}")
    lengths = [d.size for d in docs]
    lengths[-1] -= 1  # the appended target
    if "docs_per_row" in kw:
      assert len(lengths) == kw["docs_per_row"]
    else:  # every document but the row's last (cut at the end) has a drawn length
      assert set(lengths[:-1]) <= set(np.atleast_1d(kw["doc_lengths"]))
      assert lengths[-1] <= max(np.atleast_1d(kw["doc_lengths"]))


def test_random_packed_batch_distributions():
  # Uniform lengths in [1, T/4]: mean about T/8 (bench_attention's "packed" rows).
  t = 1024
  seg = packing.random_packed_batch(32, t, doc_lengths=np.arange(1, t // 4 + 1))["segment_ids"]
  full = np.concatenate([np.bincount(row)[1:-1] for row in seg])  # not the cut last one
  assert abs(full.mean() - (t // 4 + 1) / 2) < 6, full.mean()
  assert full.min() >= 1 and full.max() <= t // 4
  # Random cut points: every position but 0 is a document start equally often.
  starts = np.diff(packing.random_packed_batch(4000, 9, docs_per_row=3)["segment_ids"]) > 0
  np.testing.assert_allclose(starts.mean(0), 2 / 8, atol=0.02)
  # A shared Generator continues its stream; an int seed repeats it.
  rng = np.random.default_rng(0)
  a, b = (packing.random_packed_batch(1, 64, doc_lengths=(1, 7), seed=rng)["segment_ids"]
          for _ in range(2))
  assert not np.array_equal(a, b)
  np.testing.assert_array_equal(
      a, packing.random_packed_batch(1, 64, doc_lengths=(1, 7), seed=0)["segment_ids"])


@pytest.mark.parametrize("kw, match", [
    (dict(), r"exactly one of docs_per_row=None and doc_lengths=None"),
    (dict(docs_per_row=2, doc_lengths=3), r"exactly one of docs_per_row=2 and doc_lengths=3"),
    (dict(docs_per_row=9), r"docs_per_row=9 must be in \[1, seq_len=8\]"),
    (dict(doc_lengths=(2, 0)), r"doc_lengths=\(2, 0\) must be positive lengths"),
])
def test_random_packed_batch_errors(kw, match):
  with pytest.raises(ValueError, match=match):
    packing.random_packed_batch(2, 8, **kw)
