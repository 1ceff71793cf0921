r"""Benchmarks the training step against the matmul peak and a dot-only baseline: MFU.

  python -m experiments.bench_train --config=configs/tiny_lm.py
  python -m experiments.bench_train --config=configs/tiny_lm.py --config.model.d_model=512 \
      --steps=20 --out=/tmp/bench.json

Measures the matmul peak, the train step (as `jaxsys.train.loop` builds it) on a random
packed batch, and plain dots of the model's matmul shapes, in --rounds interleaved rounds;
prints the table of MFU (PaLM's and causal) and tokens/s, and writes every number to --out.
`--runs=N` repeats the whole benchmark, each run built and compiled afresh, and adds the
median [min, max] over the runs:

  python -m experiments.bench_train --config=configs/tiny_lm.py --runs=5

On CPU, huge pages for XLA's temporaries (the table counts page faults):

  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python -m experiments.bench_train

What each number is: `jaxsys/bench/train.py`.
"""
from __future__ import annotations

import json
import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from jaxsys.bench import train

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_lm.py",
                                          "Path to a config file (:arg optional).",
                                          lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps (the median is reported).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps after compilation.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Interleaved rounds of peak, step and dot timing.")
_RUNS = flags.DEFINE_integer("runs", 1, "Runs of the whole benchmark, each built, compiled and "
                             "measured afresh; > 1 adds their median [min, max].")
_SEGMENTS = flags.DEFINE_integer("segments", 4, "Packed documents per row of the random batch.")
_WAIT_IDLE = flags.DEFINE_float("wait_idle", 0.0, "On a shared host, wait up to this many "
                                "seconds before each timed piece for other processes to go idle.")
_OUT = flags.DEFINE_string("out", None, "Optional path of a JSON file with every number.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _RUNS.value < 1:
    sys.exit(f"error: --runs={_RUNS.value} must be >= 1")
  results = []
  for i in range(_RUNS.value):
    results.append(train.bench(_CONFIG.value, _STEPS.value, _WARMUP.value, _SEGMENTS.value,
                               _ROUNDS.value, _WAIT_IDLE.value))
    if _RUNS.value > 1:
      print(("\n" if i else "") + f"## run {i + 1} of {_RUNS.value}\n")
    print(train.table(results[-1]), flush=True)
  if len(results) > 1:
    print(f"\n## {len(results)} runs, each built, compiled and measured against its own peak\n")
    print(train.runs_table(results))
  if _OUT.value:
    with open(_OUT.value, "w", encoding="utf-8") as f:
      json.dump(results[0] if len(results) == 1 else
                {"runs": results, "summary": train.summarize(results)}, f, indent=1)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  jax.config.config_with_absl()
  app.run(main)
