"""Tests for jaxsys.data.tokenizer: exact round trips, token_bytes, save/load, errors."""

import numpy as np
import pytest
from absl.testing import parameterized

from jaxsys.data import tokenizer as tokenizer_lib

TEXT = "déjà vu — naïve café 日本語 🙂\n\tdef f(x):\r\n    return x  # ok\n"


def _train_docs() -> list[bytes]:
  # A few KB of code and prose, non-ASCII included, enough for a few hundred merges.
  lines = [
      f"def function_{i}(alpha, beta):\n    return alpha * {i} + beta  # café {i}\n"
      for i in range(60)
  ] + [f"Le naïf élève numéro {i} écrit des phrases simples.\n" for i in range(40)]
  return [l.encode() for l in lines]


@pytest.fixture(scope="module")
def bpe():
  return tokenizer_lib.BPETokenizer.train(_train_docs(), vocab_size=300)


def test_byte_round_trip_non_ascii():
  tok = tokenizer_lib.ByteTokenizer()
  ids = tok.encode(TEXT)
  assert ids.dtype == np.uint8
  np.testing.assert_array_equal(ids, np.frombuffer(TEXT.encode(), np.uint8))
  assert tok.decode(ids) == TEXT
  assert tok.decode(tok.encode(TEXT.encode())) == TEXT
  assert tok.token_bytes().dtype == np.int32 and tok.token_bytes().shape == (256,)
  assert tok.token_bytes()[ids].sum() == len(TEXT.encode())
  with pytest.raises(ValueError, match=r"\[0, 255\]"):
    tok.decode([256])


def test_bpe_round_trip_exact_bytes(bpe):
  assert bpe.vocab_size == 300
  ids = bpe.encode(TEXT)
  assert ids.dtype == np.uint16
  assert bpe.decode(ids).encode() == TEXT.encode()
  docs = _train_docs()
  for doc, doc_ids in zip(docs, bpe.encode_batch(docs)):
    assert bpe.decode(doc_ids).encode() == doc
    np.testing.assert_array_equal(doc_ids, bpe.encode(doc))
    assert len(doc_ids) < len(doc)  # it actually compresses the training text


def test_bpe_token_bytes_sum_to_byte_length(bpe):
  tb = bpe.token_bytes()
  assert tb.dtype == np.int32 and tb.shape == (bpe.vocab_size,)
  assert tb.min() >= 1 and tb.max() > 1  # merges stand for several bytes
  for text in (TEXT, _train_docs()[3].decode()):
    assert tb[bpe.encode(text)].sum() == len(text.encode())


def test_bpe_save_load_equal(bpe, tmp_path):
  path = tmp_path / "sub" / "tokenizer.json"
  bpe.save(path)
  loaded = tokenizer_lib.BPETokenizer.load(path)
  assert loaded.vocab_size == bpe.vocab_size
  np.testing.assert_array_equal(loaded.encode(TEXT), bpe.encode(TEXT))
  np.testing.assert_array_equal(loaded.token_bytes(), bpe.token_bytes())
  assert loaded.hf_tokenizer.to_str() == bpe.hf_tokenizer.to_str()


def test_make_tokenizer_caches_bpe(tmp_path):
  path = tmp_path / "tokenizer.json"
  tok = tokenizer_lib.make_tokenizer("bpe", vocab_size=280, train_docs=_train_docs(), cache_path=str(path))
  assert path.exists()
  # Second call must load the cache, not train: no training docs given.
  again = tokenizer_lib.make_tokenizer("bpe", vocab_size=280, cache_path=str(path))
  np.testing.assert_array_equal(again.encode(TEXT), tok.encode(TEXT))
  with pytest.raises(ValueError, match="data.vocab_size=290 but the cached tokenizer"):
    tokenizer_lib.make_tokenizer("bpe", vocab_size=290, cache_path=str(path))
  assert isinstance(tokenizer_lib.make_tokenizer("byte"), tokenizer_lib.ByteTokenizer)


class ErrorsTest(parameterized.TestCase):

  @parameterized.parameters(256, 0, None, 300.0)
  def test_bad_vocab_size(self, vocab_size):
    with self.assertRaisesRegex(ValueError, r"data\.vocab_size=.*>= 257"):
      tokenizer_lib.make_tokenizer("bpe", vocab_size=vocab_size, train_docs=_train_docs())

  def test_bad_vocab_size_train(self):
    with self.assertRaisesRegex(ValueError, r"data\.vocab_size=100"):
      tokenizer_lib.BPETokenizer.train(_train_docs(), vocab_size=100)

  def test_vocab_larger_than_corpus_supports(self):
    with self.assertRaisesRegex(ValueError, r"data\.vocab_size=5000 is more than the training corpus supports"):
      tokenizer_lib.BPETokenizer.train([b"ab ab ab"], vocab_size=5000)

  def test_unknown_tokenizer(self):
    with self.assertRaisesRegex(ValueError, r"^data\.tokenizer='chars' is not a tokenizer; use one of 'byte', 'bpe' or 'hf:<dir>'$"):
      tokenizer_lib.make_tokenizer("chars")

  def test_bpe_without_docs_or_cache(self):
    with self.assertRaisesRegex(ValueError, "needs train_docs"):
      tokenizer_lib.make_tokenizer("bpe", vocab_size=300)

  def test_bpe_rejects_invalid_utf8(self):
    tok = tokenizer_lib.BPETokenizer.train(_train_docs(), vocab_size=270)
    with self.assertRaisesRegex(ValueError, "UTF-8"):
      tok.encode(b"\xff\xfe")


def test_a_continuation_keeps_the_space_at_the_join(tmp_path):
  """SentencePiece-style decoding drops a leading '▁''s space: the printed continuation is
  the whole sequence's decoding less the prompt's, so 'import os' + '▁return' keeps it."""
  # pylint: disable-next=import-outside-toplevel
  from tokenizers import Tokenizer, decoders, models as tok_models, normalizers, pre_tokenizers
  vocab = {"<s>": 0, "▁import": 1, "▁os": 2, "▁return": 3, "▁value": 4}
  tok = Tokenizer(tok_models.WordLevel(vocab=vocab, unk_token="<s>"))
  tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
  tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
  tok.save(str(tmp_path / "tokenizer.json"))
  tokenizer = tokenizer_lib.HFTokenizer.load(tmp_path)
  prompt = tokenizer.encode("import os").tolist()
  assert prompt == [1, 2] and tokenizer.decode([3, 4]) == "return value"  # the space lost
  assert tokenizer_lib.decode_continuation(tokenizer, prompt, [3, 4]) == " return value"
