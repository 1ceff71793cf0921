"""Tests for jaxsys.data.loader: determinism, sharding over processes, resume, termination."""

import json
import os
import tempfile

import dataclasses

import chex
import numpy as np
import pytest
from absl.testing import parameterized

from conftest import load_run_config
from jaxsys.data import corpus
from jaxsys.data import loader as loader_lib
from jaxsys.data import packing
from jaxsys.data import tokenizer as tokenizer_lib

SEQ_LEN = 16


def _write_corpus(root) -> str:
  rng = np.random.default_rng(0)
  words = ["def", "return", "café", "x", "λ", "import", "class", "=", "(", ")", "\n", "    "]
  for i in range(40):
    text = " ".join(rng.choice(words, size=int(rng.integers(1, 60))))
    path = os.path.join(root, f"pkg{i % 3}", f"m{i}.py")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      f.write(f"# module {i}\n{text}\n")
  return str(root)


@pytest.fixture
def cfg(tmp_path):
  return _data(source=_write_corpus(tmp_path / "corpus"))


def _data(**fields):
  """The test config's typed data section over `fields`, SEQ_LEN tokens a row, no threads."""
  return dataclasses.replace(load_run_config().data, seq_len=SEQ_LEN, num_threads=0, **fields)


def _take(loader, n):
  return [next(loader) for _ in range(n)]


def _assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    chex.assert_trees_all_equal(x, y)


def _row_keys(batch):
  """Each row of a batch as one hashable tuple over all fields (for multiset compares)."""
  n = batch["inputs"].shape[0]
  return sorted(tuple(np.concatenate([batch[k][i].astype(np.float64) for k in packing.FIELDS])) for i in range(n))


@pytest.mark.parametrize("num_threads", [0, 2])
def test_deterministic_and_seed_dependent(cfg, num_threads):
  cfg = dataclasses.replace(cfg, num_threads=num_threads)
  make = lambda seed: loader_lib.make_loader(cfg, "train", batch_size=4, seed=seed)
  a, b, c = make(0), make(0), make(1)
  assert a.num_rows >= 20 and a.seq_len == SEQ_LEN
  batches_a = _take(a, 8)
  _assert_batches_equal(batches_a, _take(b, 8))
  assert not all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(batches_a, _take(c, 8)))
  for batch in batches_a:
    chex.assert_shape([batch[k] for k in packing.FIELDS], (4, SEQ_LEN))


def test_unshuffled_epoch_is_packed_corpus_in_order(cfg):
  ld = loader_lib.make_loader(cfg, "train", batch_size=4, seed=0, shuffle=False, repeat=False)
  batches = list(ld)
  assert len(batches) == ld.steps_per_epoch == ld.num_rows // 4
  docs = corpus.read_documents(corpus.list_documents(cfg.source, "train"))
  expected = packing.pack_documents(ld.tokenizer.encode_batch(docs), SEQ_LEN)
  for k in packing.FIELDS:
    got = np.concatenate([b[k] for b in batches])
    np.testing.assert_array_equal(got, expected[k][: len(got)], err_msg=k)


def test_shuffled_epoch_is_a_permutation(cfg):
  ordered = loader_lib.make_loader(cfg, "train", batch_size=2, seed=0, shuffle=False, repeat=False)
  shuffled = loader_lib.make_loader(cfg, "train", batch_size=2, seed=3, shuffle=True, repeat=False)
  rows_o = [r for b in ordered for r in _row_keys(b)]
  rows_s = [r for b in shuffled for r in _row_keys(b)]
  assert rows_o != rows_s
  if ordered.num_rows % 2 == 0:  # no remainder dropped -> exactly the same rows
    assert sorted(rows_o) == sorted(rows_s)


@pytest.mark.parametrize("repeat", [True, False])
def test_two_processes_partition_the_global_batch(cfg, repeat):
  single = loader_lib.make_loader(cfg, "train", batch_size=4, seed=7, repeat=repeat)
  shards = [loader_lib.make_loader(cfg, "train", batch_size=4, seed=7, repeat=repeat, process_index=p,
                                   process_count=2) for p in (0, 1)]
  steps = single.steps_per_epoch + 2 if repeat else single.steps_per_epoch
  for _ in range(steps):
    full = next(single)
    parts = [next(s) for s in shards]
    for part in parts:
      chex.assert_shape(part["inputs"], (2, SEQ_LEN))
    assert sorted(_row_keys(parts[0]) + _row_keys(parts[1])) == _row_keys(full)
    # Contiguous blocks of the global batch: process p gets rows [2p, 2p + 2).
    for k in packing.FIELDS:
      np.testing.assert_array_equal(parts[0][k], full[k][:2])
      np.testing.assert_array_equal(parts[1][k], full[k][2:])
  if not repeat:  # every process stops after the same number of steps
    for it in [single, *shards]:
      with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("num_threads", [0, 2])
def test_resume_after_json_round_trip(cfg, num_threads):
  cfg = dataclasses.replace(cfg, num_threads=num_threads)
  make = lambda: loader_lib.make_loader(cfg, "train", batch_size=4, seed=5)
  original = make()
  k = original.steps_per_epoch + 1  # resume across an epoch boundary
  _take(original, k)
  state = json.loads(json.dumps(original.get_state()))
  resumed = make()
  resumed.set_state(state)
  _assert_batches_equal(_take(resumed, 4), _take(original, 4))


def test_resume_on_a_different_process_count(cfg):
  single = loader_lib.make_loader(cfg, "train", batch_size=4, seed=5)
  _take(single, 3)
  state = json.loads(json.dumps(single.get_state()))
  shard = loader_lib.make_loader(cfg, "train", batch_size=4, seed=5, process_index=1, process_count=2)
  shard.set_state(state)
  full = next(single)
  np.testing.assert_array_equal(next(shard)["inputs"], full["inputs"][2:])


def test_mismatched_state_is_rejected(cfg):
  state = loader_lib.make_loader(cfg, "train", batch_size=4, seed=5).get_state()
  other = loader_lib.make_loader(cfg, "train", batch_size=4, seed=6)
  with pytest.raises(ValueError, match="seed: saved 5 vs now 6"):
    other.set_state(state)


def test_non_repeat_terminates(cfg):
  ld = loader_lib.make_loader(cfg, "train", batch_size=3, seed=0, repeat=False)
  assert sum(1 for _ in ld) == ld.num_rows // 3
  with pytest.raises(StopIteration):
    next(ld)


class LoaderErrorsTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    tmp = tempfile.TemporaryDirectory()  # absltest's create_tempdir needs parsed flags
    self.addCleanup(tmp.cleanup)
    self.cfg = _data(source=_write_corpus(tmp.name))

  def test_batch_not_divisible(self):
    with self.assertRaisesRegex(ValueError, r"batch_size=5 is not divisible by process_count=2"):
      loader_lib.make_loader(self.cfg, "train", batch_size=5, seed=0, process_count=2)

  def test_batch_larger_than_split(self):
    with self.assertRaisesRegex(ValueError, r"rows of data\.seq_len=16, fewer than batch_size=100000"):
      loader_lib.make_loader(self.cfg, "train", batch_size=100000, seed=0)

  def test_unknown_tokenizer(self):
    cfg = dataclasses.replace(self.cfg, tokenizer="words")
    with self.assertRaisesRegex(ValueError, r"data\.tokenizer='words'"):
      loader_lib.make_loader(cfg, "train", batch_size=4, seed=0)

  @parameterized.parameters(("process_index", 2), ("process_count", 0))
  def test_bad_process(self, name, value):
    kwargs = dict(process_index=0, process_count=2)
    kwargs[name] = value
    with self.assertRaisesRegex(ValueError, name):
      loader_lib.make_loader(self.cfg, "train", batch_size=4, seed=0, **kwargs)


def test_bpe_tokenizer_trained_on_train_split_and_cached(cfg, tmp_path):
  cfg = dataclasses.replace(cfg, tokenizer="bpe", vocab_size=270)
  workdir = str(tmp_path / "work")
  ld = loader_lib.make_loader(cfg, "train", batch_size=2, seed=0, workdir=workdir)
  assert isinstance(ld.tokenizer, tokenizer_lib.BPETokenizer) and ld.tokenizer.vocab_size == 270
  assert os.path.exists(os.path.join(workdir, "tokenizer.json"))
  batch = next(ld)
  assert batch["inputs"].max() < 270
  again = loader_lib.make_loader(cfg, "all", batch_size=2, seed=0, workdir=workdir)
  assert again.tokenizer.hf_tokenizer.to_str() == ld.tokenizer.hf_tokenizer.to_str()


def test_a_jsonl_source_packs_its_records_in_order(tmp_path):
  """JSONL records (the text in data.text_field) are the documents the rows pack, in file
  and line order, as text files are."""
  rng = np.random.default_rng(1)
  texts = [" ".join(rng.choice(["def", "λ", "x", "return"], size=int(rng.integers(5, 30))))
           for _ in range(300)]
  for part in range(2):
    lines = [json.dumps({"content": t, "n": i}) for i, t in enumerate(texts[part::2])]
    (tmp_path / f"part{part}.jsonl").write_text("\n".join(lines) + "\n")
  cfg = _data(source=str(tmp_path / "*.jsonl"), text_field="content")
  ld = loader_lib.make_loader(cfg, "train", batch_size=4, seed=0, shuffle=False, repeat=False)
  docs = corpus.load_documents(cfg.source, "train", "content")
  assert 250 < len(docs) < 300 and docs[0].decode() == texts[0]  # part0's first record
  expected = packing.pack_documents(ld.tokenizer.encode_batch(docs), SEQ_LEN)
  got = np.concatenate([b["inputs"] for b in ld])
  np.testing.assert_array_equal(got, expected["inputs"][:len(got)])


def test_a_mixture_draws_rows_by_weight_and_resumes(tmp_path):
  """'0.5:A;0.3:B;0.2:C': rows from each source in its proportion (each shuffled on its
  own), every row one of its source's packed rows; resumed mid-epoch, the mixed order goes
  on exactly."""
  words = {"a": "alpha", "b": "beta", "c": "gamma"}
  for name, word in words.items():
    (tmp_path / name).mkdir()
    lines = [json.dumps({"text": f"{word} {i} " * 3}) for i in range(400)]
    (tmp_path / name / "part.jsonl").write_text("\n".join(lines) + "\n")
  cfg = _data(source=";".join(f"{w}:{tmp_path / n}" for w, n in ((0.5, "a"), (0.3, "b"),
                                                                  (0.2, "c"))))
  make = lambda: loader_lib.make_loader(cfg, "train", batch_size=4, seed=0)
  ld = make()
  rows = [row for batch in _take(ld, 50) for row in batch["inputs"]]
  text = [ld.tokenizer.decode(r) for r in rows]
  counts = {n: sum(w in t and all(o not in t for o in words.values() if o != w) for t in text)
            for n, w in words.items()}
  assert sum(counts.values()) == len(rows) == 200  # no row crosses sources
  assert counts == {"a": 100, "b": 60, "c": 40}, counts
  state = ld.get_state()  # mid-epoch: every source has hundreds of rows left
  after = _take(ld, 3)
  resumed = make()
  resumed.set_state(json.loads(json.dumps(state)))
  _assert_batches_equal(after, _take(resumed, 3))


def test_a_mixture_part_that_is_not_weight_and_source_is_one_line():
  cfg = _data(source="0.5:stdlib;heavy:stdlib")
  with pytest.raises(ValueError, match=r"the part 'heavy:stdlib' is not <weight>:<source> with "
                                       "a weight > 0"):
    loader_lib.make_loader(cfg, "train", batch_size=4, seed=0)


def test_each_source_is_listed_once_per_loader(tmp_path, monkeypatch):
  """The loader resolves each part of a mixture once; its documents, the token cache's key
  and a BPE trained on the train split (loading all) all read through that resolution."""
  jsonl = tmp_path / "j"
  jsonl.mkdir()
  (jsonl / "part.jsonl").write_text("".join(json.dumps({"text": f"alpha {i} " * 4}) + "\n"
                                            for i in range(400)))
  source = f"0.5:{jsonl};0.5:{_write_corpus(tmp_path / 'py')}"
  listed = []
  real = corpus._source_files  # pylint: disable=protected-access
  monkeypatch.setattr(corpus, "_source_files", lambda s: listed.append(s) or real(s))
  cfg = _data(source=source, tokenizer="bpe", vocab_size=270, token_cache=str(tmp_path / "c"))
  ld = loader_lib.make_loader(cfg, "all", batch_size=1, seed=0)
  assert sorted(listed) == sorted([str(jsonl), str(tmp_path / "py")]) and next(ld)
