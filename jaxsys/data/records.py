"""Files of many documents: one reader per format, each yielding (row, text) of a file.

JSONL (`.jsonl`, `.jsonl.gz`, `.jsonl.zst`: one JSON object a line, row = its line number
from 1), Parquet (`.parquet`) and Arrow IPC (`.arrow`, as Hugging Face `datasets.save_to_disk`
writes it; row = its index from 0), the text in the field or column `text_field`. pyarrow
and zstandard are the optional `data` extra; a file that needs one without it is one error.

Example::

  fmt = format_of(pathlib.Path("/data/web/part0.parquet"))  # FORMATS["parquet"]
  for row, text in fmt.read(path, "text"): ...              # text None for a null cell
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib
import io
import json
import pathlib
from collections.abc import Callable, Iterator

# What `datasets.save_to_disk` writes beside its .arrow shards: metadata, never documents.
HF_SIDECARS = frozenset({"dataset_info.json", "state.json", "dataset_dict.json"})
_EXTRA = "pip install 'jaxsys[data]' (pyarrow, zstandard)"
_BATCH_ROWS = 8192  # Parquet rows decoded at a time: bounded memory, few Python calls


def _need(module: str, path: pathlib.Path, what: str):
  """`module`, or one error naming the file and the extra that provides it."""
  try:
    return importlib.import_module(module)
  except ImportError:
    raise ValueError(f"{path}: reading {what} needs the {module.split('.')[0]} package, "
                     f"which is not installed; install the data extra: {_EXTRA}") from None


class _ZstdFrames(io.RawIOBase):
  """A .zst file's decompressed bytes, frame after frame; a file that ends inside a frame
  raises (zstandard's own readers return the partial data of a truncated file silently)."""

  def __init__(self, path: pathlib.Path):
    super().__init__()
    self._zstd = _need("zstandard", path, "a .zst file")
    self._path = path
    self._chunks = self._decompress()
    self._buf, self._at = b"", 0

  def _decompress(self) -> Iterator[bytes]:
    new = lambda: self._zstd.ZstdDecompressor().decompressobj()
    frame, in_frame = new(), False
    with open(self._path, "rb") as f:
      while chunk := f.read(1 << 20):
        while chunk:
          in_frame = True
          yield frame.decompress(chunk)
          if not frame.eof:
            break
          chunk, frame, in_frame = frame.unused_data, new(), False
    if in_frame:
      raise EOFError("the file ends inside a zstd frame (truncated)")

  def readable(self) -> bool:
    return True

  def readinto(self, b) -> int:
    while self._at == len(self._buf):
      chunk = next(self._chunks, None)
      if chunk is None:
        return 0
      self._buf, self._at = chunk, 0
    n = min(len(b), len(self._buf) - self._at)
    b[:n] = memoryview(self._buf)[self._at:self._at + n]
    self._at += n
    return n


def _open_text(path: pathlib.Path):
  if path.name.endswith(".gz"):
    return gzip.open(path, "rt", encoding="utf-8")
  if path.name.endswith(".zst"):
    return io.TextIOWrapper(io.BufferedReader(_ZstdFrames(path)), encoding="utf-8")
  return open(path, "rt", encoding="utf-8")


def _jsonl(path: pathlib.Path, text_field: str) -> Iterator[tuple[int, str]]:
  """(line number, text) of every non-blank line of a JSONL file, compressed or not."""
  compression = {".gz": "gzipped ", ".zst": "zstd-compressed "}.get(path.suffix, "")
  try:
    with _open_text(path) as f:
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
    raise ValueError(f"{path}: cannot be read as {compression}UTF-8 JSONL ({e}); fix or "
                     "remove the file") from None
  except Exception as e:  # zstandard's ZstdError (a corrupt frame) subclasses only Exception
    if type(e).__name__ != "ZstdError":
      raise
    raise ValueError(f"{path}: cannot be read as {compression}UTF-8 JSONL ({e}); fix or "
                     "remove the file") from None


def _is_strings(pa, kind) -> bool:
  if pa.types.is_dictionary(kind):  # e.g. a pandas categorical column
    kind = kind.value_type
  return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(
      kind)


def _text_column(pa, path: pathlib.Path, schema, text_field: str, kind: str) -> None:
  """Refuses a schema whose `text_field` is missing or not strings, naming what it has."""
  if text_field not in schema.names:
    raise ValueError(f"{path}: no column data.text_field={text_field!r} (the {kind} file has "
                     f"{schema.names}); set data.text_field to the column that holds the text")
  kind_of = schema.field(text_field).type
  if not _is_strings(pa, kind_of):
    strings = [f.name for f in schema if _is_strings(pa, f.type)]
    raise ValueError(f"{path}: column data.text_field={text_field!r} holds {kind_of}, not "
                     f"strings; set data.text_field to a string column (the file's: {strings})")


def _rows(batches, first: int = 0) -> Iterator[tuple[int, str | None]]:
  row = first
  for batch in batches:
    for text in batch.column(0).to_pylist():
      yield row, text
      row += 1


def _parquet(path: pathlib.Path, text_field: str) -> Iterator[tuple[int, str | None]]:
  """(row index, text) of a Parquet file's `text_field` column, read a row group at a time."""
  pa = _need("pyarrow", path, "a Parquet file")
  pq = _need("pyarrow.parquet", path, "a Parquet file")
  try:
    f = pq.ParquetFile(path, memory_map=True)
    _text_column(pa, path, f.schema_arrow, text_field, "Parquet")
    yield from _rows(f.iter_batches(batch_size=_BATCH_ROWS, columns=[text_field]))
  except (pa.ArrowException, OSError) as e:
    raise ValueError(f"{path}: cannot be read as Parquet ({str(e).splitlines()[0]}); fix or "
                     "remove the file") from None


def _arrow(path: pathlib.Path, text_field: str) -> Iterator[tuple[int, str | None]]:
  """(row index, text) of an Arrow IPC file, stream format (what `datasets` writes) or file
  format, memory-mapped: only the text column's buffers are touched."""
  pa = _need("pyarrow", path, "an Arrow file")
  try:
    with pa.memory_map(str(path)) as source:
      try:
        reader = pa.ipc.open_stream(source)
        batches = iter(reader)
      except pa.ArrowInvalid:  # not a stream: the random-access file format
        source.seek(0)
        reader = pa.ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
      _text_column(pa, path, reader.schema, text_field, "Arrow")
      column = reader.schema.get_field_index(text_field)
      yield from _rows(b.select([column]) for b in batches)
  except (pa.ArrowException, OSError) as e:
    raise ValueError(f"{path}: cannot be read as Arrow IPC ({str(e).splitlines()[0]}); fix or "
                     "remove the file") from None


@dataclasses.dataclass(frozen=True)
class Format:
  """A kind of file of many documents: its name, file suffixes and reader."""
  name: str
  suffixes: tuple[str, ...]
  read: Callable[[pathlib.Path, str], Iterator[tuple[int, str | None]]]


FORMATS = {
    "jsonl": Format("JSONL", (".jsonl", ".jsonl.gz", ".jsonl.zst"), _jsonl),
    "parquet": Format("Parquet", (".parquet",), _parquet),
    "arrow": Format("Arrow", (".arrow",), _arrow),
}
SUFFIXES = tuple(s for fmt in FORMATS.values() for s in fmt.suffixes)


def format_of(path: pathlib.Path) -> Format | None:
  """The format of a file of many documents, None for a file that is one document."""
  return next((f for f in FORMATS.values() if path.name.endswith(f.suffixes)), None)
