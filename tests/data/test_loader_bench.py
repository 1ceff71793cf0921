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


def test_the_token_cache_is_timed_off_cold_and_warm(tmp_path):
  import dataclasses  # pylint: disable=import-outside-toplevel
  from conftest import load_run_config  # pylint: disable=import-outside-toplevel
  texts = [f"def f{i}(x):\n    return x + {i}\n" * 5 for i in range(200)]
  sources = bench_loader.write_corpora(tmp_path, texts, copies=1, formats=("jsonl",))
  data = dataclasses.replace(load_run_config().data, source=sources["jsonl"], seq_len=32,
                             batch_size=4, num_threads=0)
  r = bench_loader.time_token_cache(data, tmp_path / "cache", batches=3)
  assert min(r["off s"], r["cold s"], r["warm s"], r["warm tokens/s"]) > 0
  assert len(list((tmp_path / "cache").iterdir())) == 1
