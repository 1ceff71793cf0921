"""Text corpora: documents from the stdlib, a directory or a glob, split by a stable hash.

A source is files of one document each (split by their path's hash), or JSONL files (`.jsonl`,
`.jsonl.gz`) of one JSON object a line whose `data.text_field` holds a document (split by
the hash of its file's path and line number, so appending records moves none). A weighted
mixture of sources is `<weight>:<source>;<weight>:<source>...` (`mixture`): the packed loader
draws rows from each in proportion to its weight.

Example::

    docs = load_documents("stdlib", "train")  # list[bytes]
    docs = load_documents("/data/web/*.jsonl.gz", "val", text_field="text")
    mixture("0.7:/data/web/*.jsonl.gz;0.3:stdlib")  # [(0.7, '/data/web/*.jsonl.gz'), (0.3, 'stdlib')]
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import pathlib
import sysconfig
from collections.abc import Iterable

from absl import logging

SPLITS = ("train", "val", "test", "all")
# Fractions of documents (by hash of the relative path) in the held-out splits.
VAL_FRACTION = 0.02
TEST_FRACTION = 0.02

# Installed third-party packages are not "the standard library" and change from machine
# to machine, which would make the corpus (and every result on it) irreproducible.
_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
# Byte-code caches are binary build outputs, never documents.
_ALWAYS_EXCLUDED_DIRS = frozenset({"__pycache__"})
_GLOB_MAGIC = ("*", "?", "[")
# Files of many documents: one JSON object a line, its text in one field.
RECORD_SUFFIXES = (".jsonl", ".jsonl.gz")


def stdlib_root() -> pathlib.Path:
  """Directory of the running interpreter's standard library (the default corpus)."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _split_of(relative_posix: str) -> str:
  """Stable split for a document: sha1 of its relative path -> u in [0, 1)."""
  digest = hashlib.sha1(relative_posix.encode("utf-8")).digest()
  u = int.from_bytes(digest[:8], "big") / 2.0**64
  if u < VAL_FRACTION:
    return "val"
  if u < VAL_FRACTION + TEST_FRACTION:
    return "test"
  return "train"


def _walk(root: pathlib.Path, *, suffix: str | None, excluded_dirs: frozenset[str]) -> list[pathlib.Path]:
  """Regular files under `root`, skipping hidden entries and `excluded_dirs`."""
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    # Pruning in place stops os.walk from descending (site-packages alone can be GBs).
    dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in excluded_dirs]
    for name in filenames:
      if name.startswith("."):
        continue
      if suffix is not None and not name.endswith(suffix):
        continue
      path = pathlib.Path(dirpath) / name
      if path.is_file():
        found.append(path)
  return found


def _glob_root(pattern: str) -> pathlib.Path:
  """The longest leading directory of `pattern` without glob characters."""
  parts = pathlib.PurePath(pattern).parts
  fixed = []
  for part in parts:
    if any(c in part for c in _GLOB_MAGIC):
      break
    fixed.append(part)
  if len(fixed) == len(parts):  # A plain file path: its directory is the root.
    fixed = fixed[:-1]
  return pathlib.Path(*fixed) if fixed else pathlib.Path(".")


def _source_files(source: str) -> tuple[pathlib.Path, list[pathlib.Path]]:
  """(root, files) for a `data.source` value; raises a one-line ValueError if empty."""
  valid = "use 'stdlib', an existing directory, or a glob such as '/path/**/*.txt'"
  if source == "stdlib":
    root = stdlib_root()
    files = _walk(root, suffix=".py", excluded_dirs=_STDLIB_EXCLUDED_DIRS | _ALWAYS_EXCLUDED_DIRS)
    if not files:
      raise ValueError(f"data.source='stdlib': no *.py files under {str(root)!r}; {valid}")
    return root, files
  if not isinstance(source, str) or not source:
    raise ValueError(f"data.source={source!r}: expected a non-empty string; {valid}")
  if os.path.isdir(source):
    root = pathlib.Path(source)
    files = _walk(root, suffix=None, excluded_dirs=_ALWAYS_EXCLUDED_DIRS)
    if not files:
      raise ValueError(
          f"data.source={source!r}: directory has no (non-hidden) files; {valid}"
      )
    return root, files
  matches = [pathlib.Path(p) for p in glob.glob(source, recursive=True)]
  files = [p for p in matches if p.is_file()]
  if not files:
    if any(c in source for c in _GLOB_MAGIC):
      raise ValueError(f"data.source={source!r}: glob matches no files; {valid}")
    raise ValueError(f"data.source={source!r}: no such directory or file pattern; {valid}")
  return _glob_root(source), files


def _check_split(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"split={split!r} is not a valid split; use one of "
                     f"{', '.join(map(repr, SPLITS))}")


def list_documents(source: str, split: str) -> list[pathlib.Path]:
  """Sorted document paths of `split` in {"train", "val", "test", "all"} of `source`.

  `source` is "stdlib" (every *.py of the interpreter's stdlib, without site-packages),
  a directory (every non-hidden file under it), or a glob (recursive `**` allowed).
  Documents go to val (2%), test (2%) or train (96%) by a sha1 of their path relative to
  the source root, so adding a file never moves another one between splits.

  Example::

    list_documents("/data/books", "val")  # -> [PosixPath('/data/books/a.txt'), ...]
  """
  _check_split(split)
  root, files = _source_files(source)
  if split != "all":
    files = [p for p in files if _split_of(p.relative_to(root).as_posix()) == split]
    if not files:
      raise ValueError(
          f"data.source={source!r} has no files in split {split!r} (val and test each get"
          f" ~{VAL_FRACTION:.0%} of documents by path hash); use more documents or split='all'"
      )
  return sorted(files)


def read_documents(paths: Iterable[str | os.PathLike], *, require_utf8: bool = True) -> list[bytes]:
  """Raw bytes of each file, skipping empty files and (by default) files that are not UTF-8.

  Non-UTF-8 files are skipped because a byte-level BPE can only round-trip valid text
  (a handful of stdlib test files are deliberately mis-encoded); the count is logged.
  """
  docs = []
  skipped_empty = skipped_binary = 0
  for path in paths:
    data = pathlib.Path(path).read_bytes()
    if not data:
      skipped_empty += 1
      continue
    if require_utf8:
      try:
        data.decode("utf-8")
      except UnicodeDecodeError:
        skipped_binary += 1
        continue
    docs.append(data)
  if skipped_empty or skipped_binary:
    logging.info(
        "read_documents: kept %d, skipped %d empty and %d non-UTF-8 files",
        len(docs), skipped_empty, skipped_binary,
    )
  return docs


def _is_records(path: pathlib.Path) -> bool:
  return path.name.endswith(RECORD_SUFFIXES)


def is_record_source(source: str) -> bool:
  """Whether `source`'s files are JSONL (a record a document), not a file a document."""
  return source != "stdlib" and all(map(_is_records, _source_files(source)[1]))


def mixture(source: str) -> list[tuple[float, str]]:
  """(weight, source) of each part of a mixture '<weight>:<source>;...', the weights summing
  to 1; [(1.0, source)] for one source. A malformed part is one error naming it."""
  if ";" not in source and not source.partition(":")[0].replace(".", "", 1).isdigit():
    return [(1.0, source)]
  parts = []
  for part in filter(None, (p.strip() for p in source.split(";"))):
    weight, _, path = part.partition(":")
    try:
      w = float(weight)
    except ValueError:
      w = -1.0
    if not path or not w > 0:
      raise ValueError(f"data.source={source!r}: the part {part!r} is not <weight>:<source> with "
                       "a weight > 0; a mixture is e.g. '0.7:/data/web/*.jsonl.gz;0.3:stdlib'")
    _source_files(path)  # an empty or missing part is its own error
    parts.append((w, path))
  total = sum(w for w, _ in parts)
  return [(w / total, path) for w, path in parts]


def load_documents(source: str, split: str, text_field: str = "text") -> list[bytes]:
  """The UTF-8 documents of `split` of `source` (see the module docstring): a file each
  (`list_documents`, `read_documents`), or a JSONL record each. A source that mixes JSONL
  with other files, a line that is not a JSON object with a string `text_field`, or a file
  that cannot be read is one error naming the file (and line)."""
  _check_split(split)
  parts = mixture(source)
  if len(parts) > 1:  # every part's documents (e.g. to train a tokenizer on)
    return [doc for _, part in parts for doc in load_documents(part, split, text_field)]
  root, files = _source_files(source)
  records = [p for p in files if _is_records(p)]
  if source == "stdlib" or not records:
    return read_documents(list_documents(source, split))
  if len(records) != len(files):
    other = next(p for p in files if not _is_records(p))
    raise ValueError(f"data.source={source!r} holds JSONL files and others (e.g. {str(other)!r}); "
                     "point it at one kind: JSONL files (a record a document) or text files "
                     "(a file a document)")
  docs = []
  for path in sorted(records):
    relative = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
    for line, text in _records(path, text_field):
      if text and (split == "all" or _split_of(f"{relative}#{line}") == split):
        docs.append(text.encode("utf-8"))
  if not docs:
    raise ValueError(f"data.source={source!r} has no non-empty records in split {split!r} (val "
                     f"and test each get ~{VAL_FRACTION:.0%} of records by hash); use more data")
  return docs


def _records(path: pathlib.Path, text_field: str):
  """(line number, text) of every non-blank line of a JSONL file, gzipped or not."""
  opener = gzip.open if path.name.endswith(".gz") else open
  try:
    with opener(path, "rt", encoding="utf-8") as f:
      for number, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{path} line {number}: not JSON ({e.msg}); each line of a JSONL "
                           "corpus must be one JSON object") from None
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
          keys = sorted(record) if isinstance(record, dict) else type(record).__name__
          raise ValueError(f"{path} line {number}: no string field data.text_field="
                           f"{text_field!r} (the record has {keys}); set data.text_field to "
                           "the field that holds the text")
        yield number, text
  except (OSError, EOFError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: cannot be read as {'gzipped ' if opener is gzip.open else ''}"
                     f"UTF-8 JSONL ({e}); fix or remove the file") from None
