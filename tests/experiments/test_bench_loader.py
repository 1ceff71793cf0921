"""experiments/bench_loader.py's corpora and timing on a few records."""
import dataclasses

from conftest import import_binary, load_run_config
from jaxsys.data import corpus

bench_loader = import_binary("bench_loader")  # its absl flags set aside: binaries share names


def test_corpora_hold_every_record_and_the_loader_is_timed(tmp_path):
  texts = [f"def f{i}(x):\n    return x + {i}\n" * 20 for i in range(400)]
  sources = bench_loader.write_corpora(tmp_path, texts, copies=2)
  for name in ("jsonl", "jsonl.gz"):
    got = sorted(d.decode() for d in corpus.load_documents(sources[name], "all"))
    assert got == sorted(texts * 2), name
  assert [w for w, _ in corpus.mixture(sources["mixture of 3"])] == [0.5, 0.3, 0.2]
  data = dataclasses.replace(load_run_config().data, source=sources["jsonl.gz"], seq_len=64,
                             batch_size=4, num_threads=0)
  result = bench_loader.time_loader(data, batches=5)
  assert result["tokens/s"] > 0 and result["first batch s"] > 0
  assert result["corpus tokens"] > 0.9 * sum(map(len, texts)) * 2  # train's ~96%
