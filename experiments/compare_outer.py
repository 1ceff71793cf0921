r"""Compares data parallel with DiLoCo, Streaming DiLoCo, NoLoCo and CO2: final val bpb, bytes.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.compare_outer \
      --config=configs/compare_outer.py --workdir=/tmp/jaxsys_outer_warm [--runs=dp,noloco_k4_h50]

Trains (or reads back) every row of the config in --workdir/<run>, from a shared
data-parallel warm start when `pretrain_steps > 0`, and writes results.md, results.json and
outer_comparison.png there; `--seeds=0,1,2` repeats it per seed in --workdir/seed<N> and
adds results_seeds.md (mean ± std, paired gaps). --time_sync runs' sync cost is timed
against a plain inner step. What each number is: `jaxsys/bench/compare_outer.py`.
"""
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from jaxsys import metrics as metrics_lib
from jaxsys.bench import compare_outer
from jaxsys.train import config_check

_CONFIG = config_flags.DEFINE_config_file("config", "configs/compare_outer.py",
                                          "Comparison config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.")
_RUNS = flags.DEFINE_list("runs", None, "Subset of config.runs to train (default: all).")
_TIME_RUNS = flags.DEFINE_list("time_sync", ["diloco_k4_h50", "noloco_k4_h50", "co2_k4_h50"],
                               "Runs whose sync cost is timed against a plain inner step.")
_TIME_REPS = flags.DEFINE_integer("time_reps", 20, "Timed repetitions per measurement.")
_SEEDS = flags.DEFINE_list("seeds", None, "Repeat the comparison under each seed, in "
                           "--workdir/seed<N>, and add a mean ± std table (results_seeds.md).")
flags.mark_flags_as_required(["workdir"])


def _seeds(values: list[str] | None) -> list[int] | None:
  if not values:
    return None
  try:
    seeds = [int(v) for v in values]
  except ValueError:
    raise app.UsageError(f"--seeds={','.join(values)}: expected comma-separated integers, "
                         "e.g. --seeds=0,1,2") from None
  if len(set(seeds)) != len(seeds):
    raise app.UsageError(f"--seeds={','.join(values)}: a seed is repeated")
  return seeds


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  metrics_lib.quiet_library_logs()
  base = _CONFIG.value
  names = base.runs.split(",")
  unknown = sorted(set(_RUNS.value or []) - set(names))
  if unknown:
    raise app.UsageError(f"--runs: unknown run(s) {unknown}; valid: {', '.join(names)}")
  names = [n for n in names if n in (_RUNS.value or names)]
  seeds = _seeds(_SEEDS.value)
  row = ""
  try:  # the workdir and every row's config, before the pretrain spends minutes
    config_check.check_workdir(_WORKDIR.value)
    for row in names:
      config_check.check_config(compare_outer.run_config(base, base.run_specs[row].to_dict()))
  except ValueError as e:
    sys.exit(f"error: {f'run {row}: ' if row else ''}{e}")
  workdir = os.path.abspath(_WORKDIR.value)
  table, results_md = compare_outer.run(base, names, workdir, seeds, _TIME_RUNS.value,
                                        _TIME_REPS.value)
  print(table)
  print(f"results: {results_md}" + (", results.json, outer_comparison.png" if seeds is None else
                                    " (one results.md and plot per seed in seed<N>/)"))


if __name__ == "__main__":
  app.run(main)
