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
