r"""The packed loader's throughput from each corpus format, against what a train step consumes.

  python -m experiments.bench_loader --out=/tmp/bench_loader
  python -m experiments.bench_train --config=configs/llama3.py:size=gpt2 --steps=3 --rounds=1

Writes the standard library's .py files as records into --out (`--copies` times over, 4
shards each: JSONL plain, gzipped and zstd-compressed, Parquet, and Arrow as a
datasets.save_to_disk directory; no download), then for each corpus, and for a mixture of
three sources, times what `make_loader` does before the first batch (read, tokenize, pack)
and the tokens/s of the batches after it, on one thread (`data.num_threads=0`), at the
config's rows (`data.seq_len`, `data.batch_size`). Then the first batch of the --cached
corpora without `data.token_cache`, with it cold and warm, with the byte tokenizer and a BPE.
The step's own tokens/s is bench_train's: run it on the same config right after. What is
timed: `jaxsys/bench/loader.py`.
"""
import dataclasses
import pathlib

from absl import app, flags
from ml_collections import config_flags

from jaxsys.bench.loader import time_loader, time_token_cache, write_corpora
from jaxsys.data import corpus, tokenizer
from jaxsys.train import config_check

_CONFIG = config_flags.DEFINE_config_file("config", "configs/llama3.py:size=gpt2",
                                          "The run whose data section and rows are timed.")
_OUT = flags.DEFINE_string("out", "/tmp/bench_loader", "Directory the corpora are written to.")
_COPIES = flags.DEFINE_integer("copies", 2, "Times the standard library is written over.")
_BATCHES = flags.DEFINE_integer("batches", 200, "Batches timed after the first.")
_CACHED = flags.DEFINE_list("cached", ["parquet"], "Corpora whose first batch is timed without "
                            "and with data.token_cache (cold, then warm).")
_BPE_VOCAB = flags.DEFINE_integer("bpe_vocab", 8192, "Also time the cache with a BPE of this "
                                  "vocabulary (trained on 1,000 documents first); 0: byte only.")


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
  tokenizers = {"byte": None}
  if _BPE_VOCAB.value:
    tokenizers[f"bpe {_BPE_VOCAB.value}"] = tokenizer.BPETokenizer.train(
        [t.encode() for t in texts[:1000]], _BPE_VOCAB.value)
  for name in _CACHED.value:
    for tok_name, tok in tokenizers.items():
      data = dataclasses.replace(run.data, source=sources[name], num_threads=0)
      r = time_token_cache(data, pathlib.Path(_OUT.value) / "token_cache", _BATCHES.value, tok)
      print(f"{name:>14} {tok_name}: {r['corpus tokens']:,} tokens, first batch after "
            f"{r['off s']:.1f} s without the cache, {r['cold s']:.1f} s writing it, "
            f"{r['warm s']:.2f} s reading it; then {r['warm tokens/s']:,.0f} tokens/s")


if __name__ == "__main__":
  app.run(main)
