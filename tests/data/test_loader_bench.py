"""jaxsys/bench/loader.py's corpora: every format holds every record (bench_loader's input)."""
import pytest

from jaxsys.bench import loader as bench_loader
from jaxsys.data import corpus


def test_every_format_holds_every_record(tmp_path):
  pytest.importorskip("pyarrow")
  pytest.importorskip("zstandard")
  texts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(40)]
  sources = bench_loader.write_corpora(tmp_path, texts, copies=2)
  assert set(bench_loader.FORMATS) < set(sources)
  for name in bench_loader.FORMATS:
    got = sorted(d.decode() for d in corpus.load_documents(sources[name], "all"))
    assert got == sorted(texts * 2), name
