r"""The packed loader's throughput from JSONL corpora, against what a train step consumes.

  python -m experiments.bench_loader --out=/tmp/bench_loader
  python -m experiments.bench_train --config=configs/llama3.py:size=gpt2 --steps=3 --rounds=1

Writes the standard library's .py files as JSONL records into --out, plain and gzipped
(`--copies` times over, in 4 shards each: no download), then for each corpus, and for a
mixture of three sources, times what `make_loader` does before the first batch (read,
tokenize, pack) and the tokens/s of the batches after it, on one thread
(`data.num_threads=0`), at the config's rows (`data.seq_len`, `data.batch_size`). The step's
own tokens/s is bench_train's: run it on the same config right after.
"""
import dataclasses
import gzip
import json
import pathlib
import time

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from jaxsys.data import corpus, loader
from jaxsys.train import config_check

_CONFIG = config_flags.DEFINE_config_file("config", "configs/llama3.py:size=gpt2",
                                          "The run whose data section and rows are timed.")
_OUT = flags.DEFINE_string("out", "/tmp/bench_loader", "Directory the corpora are written to.")
_COPIES = flags.DEFINE_integer("copies", 2, "Times the standard library is written over.")
_BATCHES = flags.DEFINE_integer("batches", 200, "Batches timed after the first.")


def write_corpora(out: pathlib.Path, texts: list[str], copies: int) -> dict[str, str]:
  """{name: data.source} of `texts` as plain and gzipped JSONL corpora (4 shards each), and
  of a mixture of both with the standard library."""
  sources = {}
  for name, suffix, opener in (("jsonl", ".jsonl", open), ("jsonl.gz", ".jsonl.gz", gzip.open)):
    (out / name).mkdir(parents=True, exist_ok=True)
    for shard in range(4):
      with opener(out / name / f"part{shard}{suffix}", "wt", encoding="utf-8") as f:
        for copy in range(copies):
          for i, text in enumerate(texts[shard::4]):
            f.write(json.dumps({"id": f"{copy}-{shard}-{i}", "text": text}) + "\n")
    sources[name] = str(out / name)
  sources["mixture of 3"] = f"0.5:{sources['jsonl.gz']};0.3:{sources['jsonl']};0.2:stdlib"
  return sources


def time_loader(data_cfg, batches: int) -> dict[str, float]:
  """Seconds to the loader's first batch, then tokens/s of `batches` more."""
  start = time.perf_counter()
  ld = loader.make_loader(data_cfg, "train", batch_size=data_cfg.batch_size, seed=0)
  next(ld)
  ready = time.perf_counter() - start
  start = time.perf_counter()
  tokens = sum(int(np.asarray(next(ld)["inputs"]).size) for _ in range(batches))
  return {"first batch s": ready, "tokens/s": tokens / (time.perf_counter() - start),
          "corpus tokens": ld.num_tokens}


def main(argv):
  del argv
  config = _CONFIG.value
  config.check_memory = False  # the loader's own work: no step runs here
  run = config_check.check_config(config)
  texts = [doc.decode() for doc in corpus.read_documents(corpus.list_documents("stdlib", "all"))]
  sources = write_corpora(pathlib.Path(_OUT.value), texts, _COPIES.value)
  print(f"rows {run.data.batch_size} x {run.data.seq_len}, tokenizer {run.data.tokenizer}, "
        "one thread")
  for name, source in sources.items():
    data = dataclasses.replace(run.data, source=source, num_threads=0)
    r = time_loader(data, _BATCHES.value)
    print(f"{name:>14}: {r['corpus tokens']:,} tokens, first batch after "
          f"{r['first batch s']:.1f} s, then {r['tokens/s']:,.0f} tokens/s")


if __name__ == "__main__":
  app.run(main)
