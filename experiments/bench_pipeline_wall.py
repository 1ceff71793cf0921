r"""A pipelined step's wall time against the time its schedule predicts, one core a stage.

  python -m experiments.bench_pipeline_wall --out=/tmp/bench_pipeline_wall.json

Runs stage=p as p processes (workers of this binary, --process_id >= 0) joined by
`jax.distributed` on loopback, one CPU device and core each, or across a shaped link
(--bandwidth=100mbit; root, iproute2); measures each schedule's chunk and send costs, its
predicted and measured step and the tick's own work, and prints a markdown table (every
number in --out). What each column measures: `jaxsys/bench/pipeline_wall.py`. The host
needs p cores with nothing else on them.
"""
from __future__ import annotations

import json
import sys

import jax
from absl import app, flags

from jaxsys.bench import pipeline_wall
from jaxsys.lab import link as link_lib
from jaxsys.parallel import schedules


def _define_flags() -> None:
  """The binary's flags, defined only when it runs: importing it defines none, so its
  names (--stages, --out, shared with bench_pipeline) cannot clash in one process."""
  flags.DEFINE_integer("stages", 2, "Stages p: p processes, one device and core each.")
  flags.DEFINE_list("microbatches", ["4", "8"], "Microbatches m.")
  flags.DEFINE_list("schedules", list(schedules.SCHEDULES), "Schedules to run.")
  flags.DEFINE_integer("d_model", 256, "Model width.")
  flags.DEFINE_integer("n_layers", 8, "Layers (a multiple of 2p).")
  flags.DEFINE_integer("seq", 256, "Tokens per microbatch (one row).")
  flags.DEFINE_integer("vocab_size", 256, "Vocabulary size.")
  flags.DEFINE_integer("repeats", 5, "Timed runs per number (median).")
  flags.DEFINE_string("out", "/tmp/bench_pipeline_wall.json", "JSON file with every number.")
  flags.DEFINE_string("bandwidth", "none", "The stages' link: a rate (100mbit, 1gbit; root) "
                      "or none (the host's loopback).")
  flags.DEFINE_integer("process_id", -1, "Internal: this worker's process (-1: the launcher, "
                       "which starts the p workers).")
  flags.DEFINE_string("coordinator", "", "Internal: the workers' coordinator.")


def main(argv):
  del argv  # every flag is passed on to the workers as given (sys.argv)
  f = flags.FLAGS
  if f.process_id < 0:
    try:
      rate = link_lib.parse_rate(f.bandwidth)
      if rate and link_lib.missing_privileges():
        raise link_lib.LabError(f"--bandwidth={f.bandwidth} shapes a link: it needs "
                                f"{', '.join(link_lib.missing_privileges())}")
    except link_lib.LabError as e:
      sys.exit(f"error: {e}")
    worker = [sys.executable, "-m", "experiments.bench_pipeline_wall", *sys.argv[1:]]
    try:
      pipeline_wall.launch(f.stages, worker, rate_bps=rate)
    except ValueError as e:  # too few cores: a flag the host cannot serve
      raise app.UsageError(str(e)) from e
    with open(f.out) as out:
      print(pipeline_wall.table(json.load(out)))
    return
  jax.distributed.initialize(coordinator_address=f.coordinator, num_processes=f.stages,
                             process_id=f.process_id)
  result = pipeline_wall.rows(f.schedules, f.stages, [int(m) for m in f.microbatches],
                              d_model=f.d_model, n_layers=f.n_layers, seq=f.seq,
                              vocab_size=f.vocab_size, repeats=f.repeats)
  if jax.process_index() == 0:
    with open(f.out, "w") as out:
      json.dump(dict(result, bandwidth=f.bandwidth), out, indent=1)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
