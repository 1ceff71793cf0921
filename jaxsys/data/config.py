"""The run config's `data` section: what a step reads (jaxsys.config has the whole run)."""
from __future__ import annotations

import dataclasses
import glob
import os

from jaxsys import fields
from jaxsys.checkpoint import hf
from jaxsys.data import corpus
from jaxsys.data.tokenizer import TOKENIZERS
from jaxsys.fields import field, integer, text


def _source_exists(source: str) -> bool:
  # corpus.mixture raises its own line for a malformed mixture.
  return all(p == "stdlib" or os.path.isdir(p) or next(glob.iglob(p, recursive=True), None)
             is not None for _, p in corpus.mixture(source))


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """What a step reads: the corpus, its tokenizer and the batch's shape."""
  source: str = field(
      "stdlib", "'stdlib', a directory or glob of text files (a file a document) or of records "
      "in one format (a record a document): JSONL (.jsonl, .jsonl.gz, .jsonl.zst), Parquet "
      "(.parquet) or Arrow (a datasets.save_to_disk directory); or a mixture "
      "'<weight>:<source>;...'",
      text("'stdlib', an existing directory, or a file or glob that matches files, such as "
           "'/path/**/*.txt', '/data/web/*.jsonl.zst', '/data/web/*.parquet' or a "
           "datasets.save_to_disk directory, or a mixture of them '<weight>:<source>;...'",
           _source_exists))
  tokenizer: str = field(
      "byte", "'byte', 'bpe', or 'hf:<dir>' (its tokenizer.json)", fields.Rule(
          lambda v: isinstance(v, str) and (v in TOKENIZERS or v.startswith(hf.PREFIX)),
          choices=(*TOKENIZERS, "hf:<dir> (its tokenizer.json)")))
  vocab_size: int = field(256, "the tokenizer's vocabulary", integer(1))
  seq_len: int = field(256, "tokens a row (HDP: a slot's tokens a micro-step)", integer(1))
  batch_size: int = field(16, "global rows (packed) a step", integer(1))
  num_threads: int = field(2, "loader threads",
                           integer(0, meaning="0: load in the training thread"))
  variable_length: bool = field(False, "whole documents (for parallel.hdp) instead of packed rows")
  max_len: int = field(1024, "the longest whole document, in tokens", integer(1))
  truncate_long: bool = field(False, "cut a longer document (counted in the log), not refuse it")
  text_field: str = field("text", "a record's field (JSONL) or column (Parquet, Arrow) that "
                          "holds its text",
                          text("the name of the records' text field or column, e.g. 'text'",
                               bool))
  token_cache: str = field(
      "", "a directory of pre-tokenized splits (packed rows): written once, memory-mapped by "
      "later runs, rebuilt when the source's files or the tokenizer change; '' = off",
      text("'' (off) or a directory path (created if missing), not a file",
           lambda v: not os.path.exists(v) or os.path.isdir(v)))
