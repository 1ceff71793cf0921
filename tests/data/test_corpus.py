"""Tests for jaxsys.data.corpus: sources, stable hash splits, one-line errors."""

import collections
import pathlib
import re
import sys

import pytest

from jaxsys.data import corpus


def _write_tree(root: pathlib.Path, n: int = 300) -> list[pathlib.Path]:
  paths = []
  for i in range(n):
    p = root / f"d{i % 7}" / f"doc{i}.txt"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(f"document {i}\n")
    paths.append(p)
  return paths


def test_directory_splits_are_stable_disjoint_and_cover(tmp_path):
  written = _write_tree(tmp_path)
  (tmp_path / ".hidden").write_text("secret")
  (tmp_path / ".git").mkdir()
  (tmp_path / ".git" / "HEAD").write_text("ref")
  (tmp_path / "__pycache__").mkdir()
  (tmp_path / "__pycache__" / "x.pyc").write_bytes(b"\x00\xff")
  splits = {s: corpus.list_documents(str(tmp_path), s) for s in ("train", "val", "test")}
  everything = corpus.list_documents(str(tmp_path), "all")
  assert everything == sorted(written)  # hidden files/dirs and caches are skipped
  for s, paths in splits.items():
    assert paths == corpus.list_documents(str(tmp_path), s)  # same answer twice
    assert paths == sorted(paths)
  sets = [set(p) for p in splits.values()]
  assert sum(len(s) for s in sets) == len(set().union(*sets))  # disjoint
  assert set().union(*sets) == set(everything)


def test_split_depends_on_relative_path_only(tmp_path):
  _write_tree(tmp_path / "a", 300)
  _write_tree(tmp_path / "b" / "deeper", 300)
  val_a = [p.relative_to(tmp_path / "a") for p in corpus.list_documents(str(tmp_path / "a"), "val")]
  val_b = [p.relative_to(tmp_path / "b" / "deeper") for p in corpus.list_documents(str(tmp_path / "b" / "deeper"), "val")]
  assert val_a == val_b and val_a


def test_glob_source(tmp_path):
  _write_tree(tmp_path, 50)
  (tmp_path / "d0" / "other.md").write_text("# md")
  files = corpus.list_documents(str(tmp_path / "**" / "*.txt"), "all")
  assert len(files) == 50 and all(p.suffix == ".txt" for p in files)
  # Same relative paths as the directory source -> same split assignment.
  by_dir = corpus.list_documents(str(tmp_path), "train")
  by_glob = corpus.list_documents(str(tmp_path / "**" / "*.txt"), "train")
  assert by_glob == [p for p in by_dir if p.suffix == ".txt"]


def test_single_file_source(tmp_path):
  p = tmp_path / "one.txt"
  p.write_text("hello")
  assert corpus.list_documents(str(p), "all") == [p]


def test_read_documents_skips_empty_and_non_utf8(tmp_path):
  (tmp_path / "a.txt").write_bytes("héllo".encode())
  (tmp_path / "b.txt").write_bytes(b"")
  (tmp_path / "c.bin").write_bytes(b"\xff\xfe\x00")
  docs = corpus.read_documents(corpus.list_documents(str(tmp_path), "all"))
  assert docs == ["héllo".encode()]


@pytest.mark.parametrize(
    "make_source, message",
    [
        (lambda tmp: str(tmp / "nope"), "no such directory or file pattern"),
        (lambda tmp: (tmp / "empty").mkdir() or str(tmp / "empty"), "directory has no"),
        (lambda tmp: str(tmp / "**" / "*.nothing"), "glob matches no files"),
    ],
)
def test_bad_source_errors_name_the_field(tmp_path, make_source, message):
  source = make_source(tmp_path)
  with pytest.raises(ValueError) as e:
    corpus.list_documents(source, "train")
  text = str(e.value)
  assert "data.source" in text and repr(source) in text and message in text
  assert "\n" not in text


def test_empty_split_and_unknown_split(tmp_path):
  (tmp_path / "only.txt").write_text("x")
  raised = []
  for split in ("train", "val", "test"):
    try:
      corpus.list_documents(str(tmp_path), split)
    except ValueError as e:
      assert f"has no files in split {split!r}" in str(e) and "data.source=" in str(e)
      raised.append(split)
  assert len(raised) == 2  # the one document lands in exactly one split
  with pytest.raises(ValueError, match="split='dev'.*'train', 'val', 'test', 'all'"):
    corpus.list_documents(str(tmp_path), "dev")


def test_stdlib_split_is_disjoint_stable_and_about_96_2_2():
  root = corpus.stdlib_root()
  splits = {s: corpus.list_documents("stdlib", s) for s in ("train", "val", "test")}
  everything = corpus.list_documents("stdlib", "all")
  assert all(p.suffix == ".py" for p in everything)
  assert not any("site-packages" in p.parts or "dist-packages" in p.parts for p in everything)
  assert all(root in p.parents for p in everything)
  assert splits["val"] == corpus.list_documents("stdlib", "val")
  counts = collections.Counter({s: len(v) for s, v in splits.items()})
  assert sum(counts.values()) == len(everything) == len(set().union(*map(set, splits.values())))
  n = len(everything)
  assert n > 500
  for s in ("val", "test"):
    assert 0.01 < counts[s] / n < 0.035, counts


def _write_jsonl(root: pathlib.Path, files: int = 3, records: int = 400, field: str = "text"):
  """JSONL shards (the last gzipped) of `records` records each; every record's text unique."""
  import gzip  # pylint: disable=import-outside-toplevel
  import json  # pylint: disable=import-outside-toplevel
  texts = []
  for f in range(files):
    lines = []
    for r in range(records):
      texts.append(f"shard {f} record {r}: héllo")
      lines.append(json.dumps({"id": r, field: texts[-1]}))
    lines.insert(5, "")  # a blank line is no record
    data = "\n".join(lines) + "\n"
    if f == files - 1:
      (root / f"part{f}.jsonl.gz").write_bytes(gzip.compress(data.encode()))
    else:
      (root / f"part{f}.jsonl").write_text(data)
  return texts


def test_jsonl_records_are_documents_split_by_record(tmp_path):
  """A record a document, plain and gzipped, split ~96/2/2 by record (not by file: 3 files
  would leave val empty), the splits disjoint and covering every record."""
  texts = _write_jsonl(tmp_path)
  assert corpus.is_record_source(str(tmp_path))
  splits = {s: [d.decode() for d in corpus.load_documents(str(tmp_path), s)]
            for s in ("train", "val", "test")}
  got = splits["train"] + splits["val"] + splits["test"]
  assert sorted(got) == sorted(texts) and len(set(got)) == len(texts)
  assert 0 < len(splits["val"]) < 0.06 * len(texts) and 0 < len(splits["test"]) < 0.06 * len(texts)
  glob_docs = corpus.load_documents(str(tmp_path / "*.jsonl*"), "val")
  assert [d.decode() for d in glob_docs] == splits["val"]  # a glob over the same files
  # Text files stay a file a document through the same function.
  paths = _write_tree(tmp_path / "txt", 20)
  assert sorted(corpus.load_documents(str(tmp_path / "txt"), "all")) == sorted(
      p.read_bytes() for p in paths)
  assert not corpus.is_record_source(str(tmp_path / "txt"))


@pytest.mark.parametrize("content, message", [
    ('{"text": "a"}\n{"text": \n', r"part0.jsonl line 2: not JSON \(Expecting value\); each "
     "line of a JSONL corpus must be one JSON object"),
    ('{"body": "a"}\n', r"part0.jsonl line 1: no string field data.text_field='text' \(the "
     r"record has \['body'\]\); set data.text_field to the field that holds the text"),
    (b"\xff\xfe", r"part0.jsonl: cannot be read as UTF-8 JSONL"),
])
def test_bad_jsonl_is_one_line_naming_file_and_line(tmp_path, content, message):
  path = tmp_path / "part0.jsonl"
  path.write_bytes(content if isinstance(content, bytes) else content.encode())
  with pytest.raises(ValueError, match=message) as e:
    corpus.load_documents(str(tmp_path), "all")
  assert "\n" not in str(e.value)


def test_jsonl_mixed_with_text_files_is_refused(tmp_path):
  _write_jsonl(tmp_path, files=1, records=3)
  (tmp_path / "notes.txt").write_text("x")
  with pytest.raises(ValueError, match=r"holds JSONL files and others \(e.g. .*notes.txt'\); "
                                       "point it at one kind"):
    corpus.load_documents(str(tmp_path), "train")


def _write_records(root: pathlib.Path, fmt: str, texts: list[str], shards: int = 2,
                   field: str = "text") -> None:
  """`texts` as `shards` files of `fmt` ('jsonl.zst', 'parquet', or 'arrow': a
  `datasets.save_to_disk` directory of IPC streams with its metadata), written with
  pyarrow/zstandard themselves (`datasets` is not needed)."""
  import json  # pylint: disable=import-outside-toplevel
  pa = pytest.importorskip("pyarrow")  # the data extra (in dev)
  pq = pytest.importorskip("pyarrow.parquet")
  zstandard = pytest.importorskip("zstandard")
  root.mkdir(parents=True, exist_ok=True)
  for s in range(shards):
    part = texts[s::shards]
    table = pa.table({"id": list(range(len(part))), field: part})
    if fmt == "jsonl.zst":
      lines = "".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(part))
      (root / f"part{s}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    elif fmt == "parquet":
      pq.write_table(table, root / f"part{s}.parquet", row_group_size=97)
    else:
      with pa.OSFile(str(root / f"data-{s:05d}-of-{shards:05d}.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
          writer.write_table(table, max_chunksize=97)
  if fmt == "arrow":
    (root / "dataset_info.json").write_text("{}")
    (root / "state.json").write_text('{"_data_files": []}')


@pytest.mark.parametrize("fmt", ["jsonl.zst", "parquet", "arrow"])
def test_zst_parquet_and_arrow_records_are_documents_split_by_row(tmp_path, fmt):
  """Each format's records are the documents, in file and row order, split ~96/2/2 by a hash
  of (relative path, row) -- disjoint, covering, the same through a glob; nulls and empty
  texts are no documents."""
  texts = [f"{fmt} record {i}: héllo" for i in range(800)]
  _write_records(tmp_path / "c", fmt, texts, field="body")
  source = str(tmp_path / "c")
  assert corpus.is_record_source(source)
  every = [d.decode() for d in corpus.load_documents(source, "all", "body")]
  assert every == texts[0::2] + texts[1::2]  # shard 0, then shard 1, rows in order
  splits = {s: [d.decode() for d in corpus.load_documents(source, s, "body")]
            for s in ("train", "val", "test")}
  got = splits["train"] + splits["val"] + splits["test"]
  assert sorted(got) == sorted(texts)
  assert 0 < len(splits["val"]) < 0.06 * len(texts) and 0 < len(splits["test"]) < 0.06 * len(texts)
  pattern = {"jsonl.zst": "*.jsonl.zst", "parquet": "*.parquet", "arrow": "*.arrow"}[fmt]
  via_glob = corpus.load_documents(str(tmp_path / "c" / pattern), "val", "body")
  assert [d.decode() for d in via_glob] == splits["val"]


def test_nulls_empty_texts_dictionary_strings_and_the_arrow_file_format(tmp_path):
  """Null and empty texts are no documents; a dictionary-encoded string column (a pandas
  categorical) is strings; an .arrow file in IPC file (not stream) format reads too."""
  pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
  table = pa.table({"text": pa.array(["a", None, "", "b"]).dictionary_encode()})
  pq.write_table(table, tmp_path / "p.parquet")
  assert corpus.load_documents(str(tmp_path), "all") == [b"a", b"b"]
  with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as sink, pa.ipc.new_file(
      sink, table.schema) as writer:
    writer.write_table(table)
  assert corpus.load_documents(str(tmp_path / "*.arrow"), "all") == [b"a", b"b"]


def _spoil(tmp_path: pathlib.Path, how: str) -> pathlib.Path:
  """A one-shard corpus of `how`'s format, spoiled as `how` says; returns the bad file."""
  fmt = how.split()[0]
  _write_records(tmp_path / "c", fmt, [f"text {i} " * 30 for i in range(300)], shards=1)
  path = next(p for p in (tmp_path / "c").iterdir() if not p.name.endswith(".json"))
  data = path.read_bytes()
  if "truncated" in how:
    path.write_bytes(data[: len(data) // 2])
  elif "corrupt" in how:
    path.write_bytes(data[:8] + b"\x00garbage\x01" * 20 + data[-16:])
  return path


@pytest.mark.parametrize("how, field, message", [
    ("parquet", "content", r"{path}: no column data.text_field='content' \(the Parquet file has "
     r"\['id', 'text'\]\); set data.text_field to the column that holds the text"),
    ("arrow", "content", r"{path}: no column data.text_field='content' \(the Arrow file has "
     r"\['id', 'text'\]\)"),
    ("parquet", "id", r"{path}: column data.text_field='id' holds int64, not strings; set "
     r"data.text_field to a string column \(the file's: \['text'\]\)"),
    ("arrow", "id", r"{path}: column data.text_field='id' holds int64, not strings"),
    ("parquet truncated", "text", r"{path}: cannot be read as Parquet \(.*\); fix or remove"),
    ("parquet corrupt", "text", r"{path}: cannot be read as Parquet \(.*\); fix or remove"),
    ("arrow truncated", "text", r"{path}: cannot be read as Arrow IPC \(.*\); fix or remove"),
    ("jsonl.zst truncated", "text", r"{path}: cannot be read as zstd-compressed UTF-8 JSONL "
     r"\(the file ends inside a zstd frame \(truncated\)\); fix or remove the file"),
    ("jsonl.zst corrupt", "text", r"{path}: cannot be read as zstd-compressed UTF-8 JSONL "
     r"\(.*\); fix or remove the file"),
])
def test_bad_record_files_are_one_line_naming_file_and_column(tmp_path, how, field, message):
  path = _spoil(tmp_path, how)
  with pytest.raises(ValueError, match=message.format(path=re.escape(str(path)))) as e:
    corpus.load_documents(str(tmp_path / "c"), "all", field)
  assert "\n" not in str(e.value)


def test_formats_mixed_in_one_source_are_refused(tmp_path):
  _write_records(tmp_path, "parquet", ["a", "b"], shards=1)
  _write_jsonl(tmp_path, files=1, records=3)
  with pytest.raises(ValueError, match=r"holds files of 2 formats \(JSONL: .*part0.jsonl.gz', "
                                       r"Parquet: .*part0.parquet'\); point a source at one "
                                       "format, and mix formats as a mixture") as e:
    corpus.load_documents(str(tmp_path), "train")
  assert "\n" not in str(e.value)
  # The same files as a mixture of two sources are fine.
  both = corpus.load_documents(f"1:{tmp_path}/*.parquet;1:{tmp_path}/*.jsonl.gz", "all")
  assert both[:2] == [b"a", b"b"] and len(both) == 5


@pytest.mark.parametrize("fmt, module", [("parquet", "pyarrow"), ("arrow", "pyarrow"),
                                         ("jsonl.zst", "zstandard")])
def test_a_missing_package_names_the_extra(tmp_path, monkeypatch, fmt, module):
  _write_records(tmp_path, fmt, ["a", "b"], shards=1)
  for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
    monkeypatch.setitem(sys.modules, name, None)  # `import` of it raises ImportError
  with pytest.raises(ValueError, match=rf"reading .* needs the {module} package, which is not "
                                       r"installed; install the data extra: pip install "
                                       r"'jaxsys\[data\]'") as e:
    corpus.load_documents(str(tmp_path), "all")
  assert "\n" not in str(e.value)
