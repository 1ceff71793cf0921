"""The packed loader's throughput from each corpus format (experiments/bench_loader.py).

Corpora are the same texts in every format (4 shards each, no download); the loader runs
on one thread at a config's rows, timed to its first batch (read, tokenize, pack) and then
in tokens/s; with `data.token_cache`, the first batch of a cold run (which tokenizes and
writes it) and of a warm one (which memory-maps it).
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import pathlib
import shutil
import time

import numpy as np

from jaxsys.data import loader

SHARDS = 4
# Names of the corpora `write_corpora` writes, in table order.
FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow")


def _records(texts: list[str], shard: int, copies: int) -> tuple[list[str], list[str]]:
  ids, out = [], []
  for copy in range(copies):
    for i, text in enumerate(texts[shard::SHARDS]):
      ids.append(f"{copy}-{shard}-{i}")
      out.append(text)
  return ids, out


def _write_shard(path: pathlib.Path, fmt: str, ids: list[str], texts: list[str]) -> None:
  if fmt.startswith("jsonl"):
    lines = "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(ids, texts))
    data = lines.encode()
    if fmt == "jsonl.gz":
      data = gzip.compress(data)
    elif fmt == "jsonl.zst":
      import zstandard  # pylint: disable=import-outside-toplevel  # the data extra
      data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return
  import pyarrow as pa  # pylint: disable=import-outside-toplevel  # the data extra
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  table = pa.table({"id": ids, "text": texts})
  if fmt == "parquet":
    pq.write_table(table, path)
    return
  with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
    writer.write_table(table, max_chunksize=1000)  # as datasets.save_to_disk writes shards


def write_corpora(out: pathlib.Path, texts: list[str], copies: int,
                  formats: tuple[str, ...] = FORMATS) -> dict[str, str]:
  """{name: data.source} of `texts` (`copies` times over) in each of `formats`, 4 shards each
  (Arrow as a datasets.save_to_disk directory), and a mixture of three sources."""
  sources = {}
  for fmt in formats:
    (out / fmt).mkdir(parents=True, exist_ok=True)
    for shard in range(SHARDS):
      name = (f"data-{shard:05d}-of-{SHARDS:05d}.arrow" if fmt == "arrow"
              else f"part{shard}.{fmt}")
      _write_shard(out / fmt / name, fmt, *_records(texts, shard, copies))
    if fmt == "arrow":
      (out / fmt / "dataset_info.json").write_text("{}")
      (out / fmt / "state.json").write_text("{}")
    sources[fmt] = str(out / fmt)
  if {"jsonl", "jsonl.gz"} <= set(formats):
    sources["mixture of 3"] = f"0.5:{sources['jsonl.gz']};0.3:{sources['jsonl']};0.2:stdlib"
  return sources


def time_loader(data_cfg, batches: int, tokenizer=None) -> dict[str, float]:
  """Seconds to the loader's first batch, then tokens/s of `batches` more."""
  start = time.perf_counter()
  ld = loader.make_loader(data_cfg, "train", batch_size=data_cfg.batch_size, seed=0,
                          tokenizer=tokenizer)
  next(ld)
  ready = time.perf_counter() - start
  start = time.perf_counter()
  tokens = sum(int(np.asarray(next(ld)["inputs"]).size) for _ in range(batches))
  return {"first batch s": ready, "tokens/s": tokens / (time.perf_counter() - start),
          "corpus tokens": ld.num_tokens}


def time_token_cache(data_cfg, cache_dir: pathlib.Path, batches: int,
                     tokenizer=None) -> dict[str, float]:
  """Seconds to the first batch without `data.token_cache`, then with it cold (tokenized and
  written) and warm (memory-mapped); the warm loader's tokens/s after it."""
  shutil.rmtree(cache_dir, ignore_errors=True)
  off = time_loader(data_cfg, batches, tokenizer)
  cached = dataclasses.replace(data_cfg, token_cache=str(cache_dir))
  cold, warm = (time_loader(cached, batches, tokenizer) for _ in range(2))
  return {"off s": off["first batch s"], "cold s": cold["first batch s"],
          "warm s": warm["first batch s"], "warm tokens/s": warm["tokens/s"],
          "corpus tokens": warm["corpus tokens"]}
