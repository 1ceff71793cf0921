"""Tests for jaxsys.data.documents: whole-document batches under a token budget."""

import json
import os

import dataclasses

import numpy as np
import pytest

from conftest import load_run_config
from jaxsys.data import documents

MAX_LEN = 100
BUDGET = 250


def _write_corpus(root) -> str:
  """40 documents of 2..101 bytes (1..100 pairs), plus files the loader must drop."""
  rng = np.random.default_rng(0)
  for i in range(40):
    path = os.path.join(root, f"pkg{i % 3}", f"m{i:02d}.py")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
      f.write(bytes(rng.integers(97, 123, size=int(rng.integers(2, MAX_LEN + 2)), dtype=np.uint8)))
  for name, data in [("empty.py", b""), ("one.py", b"x"), ("latin1.py", b"caf\xe9 au lait")]:
    with open(os.path.join(root, name), "wb") as f:
      f.write(data)
  return str(root)


@pytest.fixture
def cfg(tmp_path):
  return _data(source=_write_corpus(tmp_path / "corpus"), max_len=MAX_LEN)


def _data(**fields):
  """The test config's typed data section over `fields`."""
  return dataclasses.replace(load_run_config().data, **fields)


def _make(cfg, **kwargs):
  kwargs = {"tokens_per_batch": BUDGET, "seed": 0, **kwargs}
  return documents.make_document_loader(cfg, "all", **kwargs)


def _take(loader, n):
  return [next(loader) for _ in range(n)]


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["doc_ids"], y["doc_ids"])
    np.testing.assert_array_equal(x["lengths"], y["lengths"])
    assert len(x["tokens"]) == len(y["tokens"])
    for s, t in zip(x["tokens"], y["tokens"]):
      np.testing.assert_array_equal(s, t)


def _epochs(loader, num_epochs):
  """Batches grouped by the epoch they belong to (read from the state before each batch)."""
  out = [[] for _ in range(num_epochs)]
  while True:
    epoch = loader.get_state()["epoch"]
    if epoch >= num_epochs:
      return out
    out[epoch].append(next(loader))


def test_deterministic_and_seed_dependent(cfg):
  a, b, c = _make(cfg, seed=0), _make(cfg, seed=0), _make(cfg, seed=1)
  batches = _take(a, 12)
  _assert_same(batches, _take(b, 12))
  other = _take(c, 12)
  assert not all(np.array_equal(x["doc_ids"], y["doc_ids"]) for x, y in zip(batches, other))


def test_attributes_and_dropped_documents(cfg):
  ld = _make(cfg)
  # The empty, one-byte and non-UTF-8 files carry no pairs.
  assert ld.num_docs == 40 and ld.dropped == 3 and len(ld.paths) == 43
  assert {ld.paths[i].name for i in ld.doc_ids} == {f"m{i:02d}.py" for i in range(40)}
  np.testing.assert_array_equal(ld.lengths, [os.path.getsize(ld.paths[i]) - 1 for i in ld.doc_ids])
  assert ld.num_tokens == int(ld.lengths.sum()) + ld.num_docs
  assert ld.max_len == MAX_LEN and ld.tokens_per_batch == BUDGET and ld.truncated == 0


def test_each_epoch_is_every_document_once_in_budgeted_greedy_batches(cfg):
  ld = _make(cfg)
  epochs = _epochs(ld, 3)
  orders = []
  for batches in epochs:
    ids = np.concatenate([b["doc_ids"] for b in batches])
    assert sorted(ids.tolist()) == sorted(ld.doc_ids.tolist())
    orders.append(ids.tolist())
    for i, b in enumerate(batches):
      assert 0 < b["lengths"].sum() <= BUDGET
      for doc_id, n, tokens in zip(b["doc_ids"], b["lengths"], b["tokens"]):
        assert tokens.dtype == np.int32 and tokens.size == n + 1
        assert tokens.tobytes() == np.frombuffer(ld.paths[doc_id].read_bytes(), np.uint8).astype(np.int32).tobytes()
      if i + 1 < len(batches):  # Greedy: the next batch starts with the document that overflowed.
        assert b["lengths"].sum() + batches[i + 1]["lengths"][0] > BUDGET
  assert orders[0] != orders[1] != orders[2]  # A new order every epoch.


def test_unshuffled_non_repeating_is_one_pass_in_split_order(cfg):
  ld = _make(cfg, shuffle=False, repeat=False)
  batches = list(ld)
  np.testing.assert_array_equal(np.concatenate([b["doc_ids"] for b in batches]), ld.doc_ids)
  assert sum(int(b["lengths"].sum()) for b in batches) == int(ld.lengths.sum())
  with pytest.raises(StopIteration):
    next(ld)


@pytest.mark.parametrize("k", [1, 5, 13])
def test_resume_after_json_round_trip(cfg, k):
  a = _make(cfg)
  _take(a, k)
  state = json.loads(json.dumps(a.get_state()))
  expected = _take(a, 10)
  b = _make(cfg)
  b.set_state(state)
  _assert_same(_take(b, 10), expected)


def test_resume_on_stdlib_val_with_default_tokenizer():
  cfg = _data(source="stdlib", max_len=4096, truncate_long=True)
  a = documents.make_document_loader(cfg, "val", tokens_per_batch=16384, seed=3)
  assert a.truncated > 0 and int(a.lengths.max()) == 4096
  _take(a, 7)
  state = a.get_state()
  expected = _take(a, 20)
  b = documents.make_document_loader(cfg, "val", tokens_per_batch=16384, seed=3)
  b.set_state(state)
  _assert_same(_take(b, 20), expected)


def test_mismatched_or_malformed_state_is_refused(cfg):
  state = _make(cfg, seed=5).get_state()
  with pytest.raises(ValueError, match=r"seed: saved 5 vs now 6"):
    _make(cfg, seed=6).set_state(state)
  with pytest.raises(ValueError, match=r"tokens_per_batch: saved 250 vs now 300"):
    _make(cfg, seed=5, tokens_per_batch=300).set_state(state)
  with pytest.raises(ValueError, match="keys 'epoch' and 'position'"):
    _make(cfg, seed=5).set_state({"grain": {}})
  with pytest.raises(ValueError, match="need ints with epoch >= 0"):
    _make(cfg, seed=5).set_state({**state, "position": 10**6})


def test_give_back_starts_the_next_batch_and_resumes(cfg):
  """A consumer that takes part of a batch returns the rest; state after that resumes exactly."""
  a = _make(cfg, seed=5)
  first = next(a)
  n = len(first["doc_ids"])
  assert n >= 3
  a.give_back([n - 1, 0])
  with pytest.raises(ValueError, match="a batch gives back once"):
    a.give_back([])
  state = json.loads(json.dumps(a.get_state()))
  second = next(a)
  np.testing.assert_array_equal(second["doc_ids"][:2], first["doc_ids"][[n - 1, 0]])
  assert second["lengths"].sum() <= a.tokens_per_batch
  b = _make(cfg, seed=5)
  b.set_state(state)
  _assert_same(_take(b, 3), [second] + _take(a, 2))
  c = _make(cfg, seed=5)
  size = len(next(c)["doc_ids"])
  with pytest.raises(ValueError, match="keeping at least one document"):
    c.give_back(list(range(size)))


def test_too_long_document_is_one_clear_error(cfg):
  with open(os.path.join(cfg.source, "pkg1", "big.py"), "wb") as f:
    f.write(b"y" * 500)
  with open(os.path.join(cfg.source, "big2.py"), "wb") as f:
    f.write(b"y" * 300)
  with pytest.raises(ValueError) as info:
    _make(cfg)
  msg = str(info.value)
  assert "\n" not in msg
  assert "data.max_len=100" in msg and "2 document(s)" in msg and "'pkg1/big.py'" in msg and "499" in msg
  assert msg.endswith("raise data.max_len to at least 499 or set data.truncate_long=true")


def test_truncate_long_counts_and_logs(cfg, caplog):
  for name, size in [("big.py", 500), ("big2.py", 300)]:
    with open(os.path.join(cfg.source, name), "wb") as f:
      f.write(b"y" * size)
  cfg = dataclasses.replace(cfg, truncate_long=True)
  with caplog.at_level("INFO"):
    ld = _make(cfg)
  assert ld.truncated == 2 and ld.truncated_tokens == (500 - 101) + (300 - 101)
  assert "truncated 2 of 42 documents" in caplog.text
  assert ld.num_docs == 42 and int(ld.lengths.max()) == MAX_LEN
  tokens = [t for b in _epochs(ld, 1)[0] for t in b["tokens"]]
  assert len(tokens) == 42 and max(t.size for t in tokens) == MAX_LEN + 1


def test_budget_below_max_len_is_refused(cfg):
  with pytest.raises(ValueError, match=r"tokens_per_batch=99 is smaller than data.max_len=100.*>= 100"):
    _make(cfg, tokens_per_batch=99)
  _make(cfg, tokens_per_batch=MAX_LEN)  # Equal is enough: one max_len document per batch.
