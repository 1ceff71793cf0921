"""Text corpora: documents from the stdlib, a directory or a glob, split by a stable hash.

A source is files of one document each (split by their path's hash), or files of records in
one format (`records`): JSONL (`.jsonl`, `.jsonl.gz`, `.jsonl.zst`), Parquet (`.parquet`) or
Arrow (a `datasets.save_to_disk` directory's `.arrow` shards), each record's `data.text_field`
a document, split by the hash of its file's relative path and row (line number in JSONL, row
index in Parquet/Arrow), so appending records moves none. A weighted mixture of sources is
`<weight>:<source>;<weight>:<source>...` (`mixture`): the packed loader draws rows from each
in proportion to its weight.

Example::

    docs = load_documents("stdlib", "train")  # list[bytes]
    docs = load_documents("/data/web/*.jsonl.gz", "val", text_field="text")
    docs = load_documents("/data/hf_saved/train", "train")  # data-00000-of-00004.arrow, ...
    mixture("0.7:/data/web/*.jsonl.gz;0.3:stdlib")  # [(0.7, '/data/web/*.jsonl.gz'), (0.3, 'stdlib')]
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import pathlib
import sysconfig
from collections.abc import Iterable

from absl import logging

from jaxsys.data import records

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


def list_documents(source: str | Source, split: str) -> list[pathlib.Path]:
  """Sorted document paths of `split` in {"train", "val", "test", "all"} of `source`.

  `source` is "stdlib" (every *.py of the interpreter's stdlib, without site-packages),
  a directory (every non-hidden file under it), or a glob (recursive `**` allowed), or its
  `resolve`d form. Documents go to val (2%), test (2%) or train (96%) by a sha1 of their path
  relative to the source root, so adding a file never moves another one between splits.

  Example::

    list_documents("/data/books", "val")  # -> [PosixPath('/data/books/a.txt'), ...]
  """
  _check_split(split)
  src = resolve(source)
  files = list(src.files)
  if split != "all":
    files = [p for p in files if _split_of(p.relative_to(src.root).as_posix()) == split]
    if not files:
      raise ValueError(
          f"data.source={src.spec!r} has no files in split {split!r} (val and test each get"
          f" ~{VAL_FRACTION:.0%} of documents by path hash); use more documents or split='all'"
      )
  return files


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


@dataclasses.dataclass(frozen=True)
class Source:
  """One source resolved: its root, sorted files and their format (None: a file a document).
  The readers take it, so a run lists a directory or glob once however many read it."""
  spec: str  # the data.source value (one part of a mixture)
  root: pathlib.Path
  files: tuple[pathlib.Path, ...]
  format: records.Format | None


def resolve(source: str | Source) -> Source:
  """`source`'s files and format, listed once (a `Source` passes through). A source of records
  in two formats, or of records and other files, is one error."""
  if isinstance(source, Source):
    return source
  root, files = _source_files(source)
  formats = {p: None if source == "stdlib" else records.format_of(p) for p in sorted(files)}
  if any(f is not None and f.name == "Arrow" for f in formats.values()):
    # A `datasets.save_to_disk` directory's metadata beside its shards.
    formats = {p: f for p, f in formats.items() if p.name not in records.HF_SIDECARS}
  named = {f.name: p for p, f in reversed(formats.items()) if f is not None}
  if len(named) > 1:
    examples = ", ".join(f"{name}: {str(p)!r}" for name, p in sorted(named.items()))
    raise ValueError(f"data.source={source!r} holds files of {len(named)} formats ({examples}); "
                     "point a source at one format, and mix formats as a mixture "
                     "'<weight>:<source>;<weight>:<source>'")
  fmt = next((f for f in formats.values() if f is not None), None)
  other = next((p for p, f in formats.items() if f is None), None)
  if fmt is not None and other is not None:
    raise ValueError(f"data.source={source!r} holds {fmt.name} files and others (e.g. "
                     f"{str(other)!r}); point it at one kind: {fmt.name} files (a record a "
                     "document) or text files (a file a document)")
  return Source(source, root, tuple(formats), fmt)


def is_record_source(source: str | Source) -> bool:
  """Whether `source`'s files hold records (JSONL, Parquet, Arrow), not a document each."""
  return resolve(source).format is not None


def _mixture_parts(source: str) -> list[tuple[float, str]]:
  """(weight, source) of each part as written, nothing listed; a malformed part is one error."""
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
    parts.append((w, path))
  total = sum(w for w, _ in parts)
  return [(w / total, path) for w, path in parts]


def mixture(source: str) -> list[tuple[float, str]]:
  """(weight, source) of each part of a mixture '<weight>:<source>;...', the weights summing
  to 1; [(1.0, source)] for one source. A malformed, empty or missing part is one error."""
  parts = _mixture_parts(source)
  if len(parts) > 1:
    for _, path in parts:
      _source_files(path)  # an empty or missing part is its own error
  return parts


def resolve_mixture(source: str) -> list[tuple[float, Source]]:
  """`mixture`'s parts, each `resolve`d once (what a loader reads them through)."""
  return [(w, resolve(path)) for w, path in _mixture_parts(source)]


def load_documents(source: str | Source, split: str, text_field: str = "text") -> list[bytes]:
  """The UTF-8 documents of `split` of `source` (see the module docstring; or its `resolve`d
  form): a file each (`list_documents`, `read_documents`), or a record each (JSONL, Parquet,
  Arrow: `records`). A source that mixes formats or records with other files, a record
  without a string `text_field`, or a file that cannot be read is one error naming the file."""
  _check_split(split)
  if not isinstance(source, Source) and len(parts := _mixture_parts(source)) > 1:
    # every part's documents (e.g. to train a tokenizer on)
    return [doc for _, part in parts for doc in load_documents(part, split, text_field)]
  src = resolve(source)
  root, files, fmt = src.root, src.files, src.format
  if fmt is None:
    return read_documents(list_documents(src, split))
  docs = []
  for path in files:
    relative = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
    for row, text in fmt.read(path, text_field):
      if text and (split == "all" or _split_of(f"{relative}#{row}") == split):
        docs.append(text.encode("utf-8"))
  if not docs:
    raise ValueError(f"data.source={src.spec!r} has no non-empty records in split {split!r} (val "
                     f"and test each get ~{VAL_FRACTION:.0%} of records by hash); use more data")
  return docs
