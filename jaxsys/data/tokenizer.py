"""Tokenizers: raw bytes (default), a byte-level BPE trained locally with `tokenizers`, and a
Hugging Face checkpoint's own `tokenizer.json` (`data.tokenizer=hf:<dir>`).

Both map any UTF-8 text to ids and back exactly, and report how many bytes each token
stands for (`token_bytes`), so losses can be compared across tokenizers in bits per byte.

Example::

  tok = make_tokenizer("bpe", vocab_size=4096, train_docs=docs, cache_path="/tmp/tok.json")
  ids = tok.encode("def f(x):\\n  return x\\n")   # np.uint16 [num_tokens]
  assert tok.decode(ids) == "def f(x):\\n  return x\\n"
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence

import numpy as np
import tokenizers
from absl import logging
from tokenizers import decoders, models, pre_tokenizers, trainers

TOKENIZERS = ("byte", "bpe")
HF_PREFIX = "hf:"  # data.tokenizer=hf:<dir>: <dir>/tokenizer.json (or the file itself)
MIN_BPE_VOCAB = 257  # 256 byte tokens plus at least one merge.
# encode_batch builds Rust `Encoding` objects for a whole batch at once; chunking bounds
# the peak memory on large corpora without losing the parallelism within a chunk.
_ENCODE_CHUNK_DOCS = 512


def _as_bytes(text: str | bytes) -> bytes:
  return text.encode("utf-8") if isinstance(text, str) else bytes(text)


class ByteTokenizer:
  """One token per UTF-8 byte; ids are the byte values 0..255.

  Example::

    ByteTokenizer().encode("é")  # -> array([195, 169], dtype=uint8)
  """

  vocab_size: int = 256

  def encode(self, text: str | bytes) -> np.ndarray:
    """uint8 ids (the bytes themselves), the cheapest dtype for a 100M-token corpus."""
    return np.frombuffer(_as_bytes(text), dtype=np.uint8).copy()

  def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() > 255):
      raise ValueError(f"ByteTokenizer.decode: ids must be in [0, 255], got range [{ids.min()}, {ids.max()}]")
    return bytes(ids.astype(np.uint8)).decode("utf-8", errors="replace")

  def token_bytes(self) -> np.ndarray:
    """int32 [vocab_size]: bytes per token (all ones)."""
    return np.ones(self.vocab_size, dtype=np.int32)

  @property
  def hf_tokenizer(self) -> tokenizers.Tokenizer:
    """The same ids as a `tokenizers.Tokenizer` (a byte-level BPE without merges), so a
    byte-level model exports with a tokenizer.json `transformers` loads."""
    alphabet = _byte_alphabet()
    tok = tokenizers.Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _byte_alphabet() -> list[str]:
  """GPT-2's ByteLevel character of each byte value 0..255."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[b] = chr(b)
    else:
      chars[b], extra = chr(256 + extra), extra + 1
  return [chars[b] for b in range(256)]


def _check_bpe_vocab_size(vocab_size) -> None:
  if not isinstance(vocab_size, (int, np.integer)) or isinstance(vocab_size, bool) or vocab_size < MIN_BPE_VOCAB:
    raise ValueError(
        f"data.vocab_size={vocab_size!r} is too small for tokenizer 'bpe'; use an int"
        f" >= {MIN_BPE_VOCAB} (256 byte tokens + merges)"
    )


class BPETokenizer:
  """Byte-level BPE (GPT-2 style ByteLevel pre-tokenizer and decoder) via `tokenizers`.

  Every string round-trips exactly: the ByteLevel alphabet has one character per byte.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer):
    self._tok = tokenizer
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    self._dtype = np.uint16 if size <= 2**16 else np.int32

  @classmethod
  def train(cls, docs: Sequence[bytes | str], vocab_size: int) -> BPETokenizer:
    """Trains on `docs` locally (no download); fails if the corpus cannot fill the vocab.

    Example::

      tok = BPETokenizer.train([b"hello world"] * 100, vocab_size=260)
    """
    _check_bpe_vocab_size(vocab_size)
    tok = tokenizers.Tokenizer(models.BPE())
    # use_regex=True is GPT-2's split (words, numbers, punctuation, spaces); merges never
    # cross those boundaries, which keeps tokens meaningful for code and prose alike.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=int(vocab_size),
        min_frequency=2,  # a merge seen once is noise, not compression
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, always
        special_tokens=[],
        show_progress=False,
    )
    texts = (d.decode("utf-8") if isinstance(d, bytes) else d for d in docs)
    tok.train_from_iterator(texts, trainer=trainer, length=len(docs))
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
      # A model sized for vocab_size would silently carry dead rows; say so instead.
      raise ValueError(
          f"data.vocab_size={vocab_size} is more than the training corpus supports (BPE"
          f" found only {got} tokens with frequency >= 2); use data.vocab_size <= {got} or more data"
      )
    return cls(tok)

  def save(self, path: str | os.PathLike) -> None:
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    self._tok.save(str(path))

  @classmethod
  def load(cls, path: str | os.PathLike) -> BPETokenizer:
    """Loads a tokenizer saved by `save`; rejects files that are not byte-level BPE."""
    tok = tokenizers.Tokenizer.from_file(str(path))
    spec = json.loads(tok.to_str())
    kinds = (spec["model"]["type"], (spec.get("pre_tokenizer") or {}).get("type"), (spec.get("decoder") or {}).get("type"))
    if kinds != ("BPE", "ByteLevel", "ByteLevel"):
      raise ValueError(
          f"{str(path)!r} is not a byte-level BPE tokenizer (model, pre_tokenizer, decoder ="
          f" {kinds}); expected ('BPE', 'ByteLevel', 'ByteLevel'), e.g. one saved by BPETokenizer.save"
      )
    return cls(tok)

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def hf_tokenizer(self) -> tokenizers.Tokenizer:
    """The underlying `tokenizers.Tokenizer`."""
    return self._tok

  def _text(self, text: str | bytes) -> str:
    if isinstance(text, str):
      return text
    try:
      return bytes(text).decode("utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(f"BPETokenizer.encode needs UTF-8 text; got invalid bytes at offset {e.start}") from None

  def encode(self, text: str | bytes) -> np.ndarray:
    """uint16 ids (int32 if the vocab exceeds 65536)."""
    return np.asarray(self._tok.encode(self._text(text), add_special_tokens=False).ids, dtype=self._dtype)

  def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
    """Like `encode` on each text, tokenised in parallel by the Rust library."""
    out = []
    for i in range(0, len(texts), _ENCODE_CHUNK_DOCS):
      chunk = [self._text(t) for t in texts[i : i + _ENCODE_CHUNK_DOCS]]
      # encode_batch_fast skips offset tracking, which we never use.
      encodings = self._tok.encode_batch_fast(chunk, add_special_tokens=False)
      out.extend(np.asarray(e.ids, dtype=self._dtype) for e in encodings)
    return out

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Text for `ids`; bytes that are not valid UTF-8 (e.g. a cut character) become U+FFFD."""
    return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)

  def token_bytes(self) -> np.ndarray:
    """int32 [vocab_size]: raw bytes each token decodes to (special tokens: 0)."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    special = set(self._tok.get_added_tokens_decoder())
    out = np.zeros(self.vocab_size, dtype=np.int32)
    for token, idx in self._tok.get_vocab(with_added_tokens=True).items():
      if idx in special:
        continue
      # Each ByteLevel character stands for exactly one byte.
      if not set(token) <= alphabet:
        raise ValueError(f"token {token!r} (id {idx}) is not in the ByteLevel alphabet")
      out[idx] = len(token)
    return out


class HFTokenizer:
  """A Hugging Face checkpoint's `tokenizer.json`, used as it defines itself: documents are
  encoded with its special tokens (its post-processor's BOS/EOS), ids are decoded with them.

  Example::

    tok = HFTokenizer.load("/ckpt/SmolLM-135M")  # its tokenizer.json
    tok.encode("hi")  # e.g. [bos, ...] when the tokenizer adds a BOS
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer, directory: str | None = None):
    self._tok = tokenizer
    self.directory = directory
    ids = [*tokenizer.get_vocab(with_added_tokens=True).values(), -1]
    self._size = max(tokenizer.get_vocab_size(with_added_tokens=True), max(ids) + 1)
    self._dtype = np.uint16 if self._size <= 2**16 else np.int32
    self.bos_token, self.eos_token = _special_tokens(directory)

  @classmethod
  def load(cls, path: str | os.PathLike) -> HFTokenizer:
    """From `path`/tokenizer.json (a checkpoint directory) or the file `path` itself."""
    path = str(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
      raise ValueError(f"{file} is missing; data.tokenizer='hf:<dir>' needs the checkpoint's "
                       "tokenizer.json")
    try:
      tok = tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # the Rust library's parse errors have no common type
      raise ValueError(f"{file} is not a tokenizer.json the tokenizers library reads: "
                       f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return cls(tok, os.path.dirname(os.path.abspath(file)))

  @property
  def vocab_size(self) -> int:
    """Ids the tokenizer can produce (largest id + 1): the model needs as many embedding rows."""
    return self._size

  @property
  def hf_tokenizer(self) -> tokenizers.Tokenizer:
    return self._tok

  def encode(self, text: str | bytes, add_special_tokens: bool = True) -> np.ndarray:
    """Ids of one document, with the special tokens the tokenizer adds (e.g. a BOS); a
    rendered chat template writes its own, so it is encoded with add_special_tokens=False."""
    text = text if isinstance(text, str) else bytes(text).decode("utf-8", errors="replace")
    return np.asarray(self._tok.encode(text, add_special_tokens=add_special_tokens).ids,
                      dtype=self._dtype)

  def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
    out = []
    for i in range(0, len(texts), _ENCODE_CHUNK_DOCS):
      chunk = [t if isinstance(t, str) else bytes(t).decode("utf-8", errors="replace")
               for t in texts[i : i + _ENCODE_CHUNK_DOCS]]
      encodings = self._tok.encode_batch_fast(chunk, add_special_tokens=True)
      out.extend(np.asarray(e.ids, dtype=self._dtype) for e in encodings)
    return out

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)

  def token_bytes(self) -> np.ndarray:
    """int32 [vocab_size]: UTF-8 bytes each token stands for (special tokens: 0), for bits per
    byte. Byte-level BPE (Llama 3, GPT-2, SmolLM): one byte a character. SentencePiece-style
    (Llama 2: '▁' for a space, <0xNN> byte fallback): the word-start '▁' counts as the space it
    decodes to, so a document's first word counts one byte more than its text."""
    spec = json.loads(self._tok.to_str())
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    added = {t["id"]: t["content"] for t in spec.get("added_tokens", [])}
    kinds = _component_types(spec.get("decoder")) | _component_types(spec.get("pre_tokenizer"))
    out = np.zeros(self.vocab_size, dtype=np.int32)
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    for token, idx in self._tok.get_vocab(with_added_tokens=True).items():
      if idx in special:
        continue
      if idx in added:
        out[idx] = len(added[idx].encode("utf-8"))
      elif "ByteLevel" in kinds:
        if not set(token) <= alphabet:
          raise ValueError(f"token {token!r} (id {idx}) is not in the ByteLevel alphabet")
        out[idx] = len(token)
      elif "Metaspace" in kinds or "ByteFallback" in kinds:
        byte = len(token) == 6 and token.startswith("<0x") and token.endswith(">")
        out[idx] = 1 if byte else len(token.replace("\u2581", " ").encode("utf-8"))
      else:
        raise ValueError(f"tokenizer.json decoder/pre_tokenizer types {sorted(kinds)}: bits per "
                         "byte needs a ByteLevel or a SentencePiece-style (Metaspace, ByteFallback) "
                         "tokenizer")
    return out


def _component_types(component: dict | None) -> set[str]:
  """The types of a tokenizer.json decoder / pre_tokenizer, a Sequence's members included."""
  if not component:
    return set()
  inner = component.get("decoders") or component.get("pretokenizers") or []
  return {component.get("type")} | set().union(*map(_component_types, inner))


def _special_tokens(directory: str | None) -> tuple[str | None, str | None]:
  """(bos_token, eos_token) from the checkpoint's tokenizer_config.json, where it has one."""
  path = os.path.join(directory, "tokenizer_config.json") if directory else ""
  if not os.path.isfile(path):
    return None, None
  with open(path) as f:
    config = json.load(f)
  pick = lambda t: t.get("content") if isinstance(t, dict) else t
  return pick(config.get("bos_token")), pick(config.get("eos_token"))


def decode_continuation(tokenizer, prompt_ids, new_ids) -> str:
  """New tokens as decoding the whole sequence writes them, less the prompt's own decoding:
  a SentencePiece-style tokenizer drops a leading '▁''s space when `new_ids` are decoded
  alone ('import os' + '▁return' would read 'import osreturn')."""
  whole, prompt = tokenizer.decode([*prompt_ids, *new_ids]), tokenizer.decode(prompt_ids)
  return whole[len(prompt):] if whole.startswith(prompt) else tokenizer.decode(new_ids)


def hf_directory(name: str) -> str | None:
  """'hf:<dir>' -> '<dir>'; any other tokenizer name -> None."""
  return name[len(HF_PREFIX):] if isinstance(name, str) and name.startswith(HF_PREFIX) else None


Tokenizer = ByteTokenizer | BPETokenizer | HFTokenizer


def make_tokenizer(
    name: str,
    *,
    vocab_size: int | None = None,
    train_docs: Sequence[bytes] | None = None,
    cache_path: str | os.PathLike | None = None,
) -> Tokenizer:
  """Tokenizer by `data.tokenizer` name; "bpe" is loaded from `cache_path` or trained and saved.

  Example::

    make_tokenizer("byte")
    make_tokenizer("hf:/ckpt/SmolLM-135M")  # its tokenizer.json
    make_tokenizer("bpe", vocab_size=1024, train_docs=docs, cache_path="/tmp/run/tokenizer.json")
  """
  if name == "byte":
    return ByteTokenizer()
  if hf_directory(name) is not None:
    return HFTokenizer.load(hf_directory(name))
  if name != "bpe":
    raise ValueError(f"data.tokenizer={name!r} is not a tokenizer; use one of {', '.join(map(repr, TOKENIZERS))} "
                     "or 'hf:<dir>'")
  _check_bpe_vocab_size(vocab_size)
  if cache_path is not None and os.path.exists(cache_path):
    tok = BPETokenizer.load(cache_path)
    if tok.vocab_size != vocab_size:
      raise ValueError(
          f"data.vocab_size={vocab_size} but the cached tokenizer {str(cache_path)!r} has"
          f" {tok.vocab_size} tokens; set data.vocab_size={tok.vocab_size} or delete the cache"
      )
    return tok
  if not train_docs:
    raise ValueError("data.tokenizer='bpe' needs train_docs (or an existing cache_path) to train on")
  tok = BPETokenizer.train(train_docs, vocab_size)
  if cache_path is not None:
    tok.save(cache_path)
    logging.info("Trained BPE tokenizer (vocab %d) saved to %s", tok.vocab_size, cache_path)
  return tok
