r"""Checkpoint save, load and training-loop stall of `jaxsys.checkpoint.manager.Checkpointer`.

  python -m experiments.bench_checkpoint --sizes=tiny,100m --repeats=5 \
      --profile --json=/tmp/bench_checkpoint.json
  python -m experiments.bench_checkpoint --part=run --sizes=100m --run_steps=100 \
      --every=10 --repeats=3 --json=/tmp/bench_checkpoint_run.json

(The script sets 8 simulated CPU devices itself when XLA_FLAGS names no count, and, as
experiments.train does, re-executes itself once with huge-page malloc: `jaxsys.hugepages`;
JAXSYS_HUGE_PAGES=0 measures without.) For each state size (--sizes) the default part
measures the disk's bandwidth, save throughput (asynchronous, synchronous, /dev/shm, orbax
option sets), load throughput (same layout, resharded, layout-converting) and the
training-loop stall per save, and prints two markdown tables; --part=run measures what a
training run loses to its checkpoints (none, asynchronous, synchronous) and prints one.
--json gets every sample; --profile logs where save() spends the caller's time. What each
number is: `jaxsys/bench/checkpoint.py`.
"""
from __future__ import annotations

from jaxsys import hugepages

if __name__ == "__main__":  # as experiments.train does, before jax starts
  hugepages.reexec_with_huge_pages()

from jaxsys import xla_flags

xla_flags.default_cpu_devices(8)

import sys

from absl import app, flags

from jaxsys.bench.checkpoint import (SIZE_NAMES, VARIANTS, check_run_args, log, run,
                                     run_table, run_training, tables)

_SIZES = flags.DEFINE_list("sizes", ["tiny", "100m"], f"State sizes, of {SIZE_NAMES}.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Repeats of every measurement (median [min, max]).")
_DIR = flags.DEFINE_string("dir", "", "Disk directory to measure: a fresh subdirectory is made "
                           "in it and removed at the end (default: the system temp dir).")
_SHM_DIR = flags.DEFINE_string("shm_dir", "/dev/shm", "RAM directory for the in-memory rows "
                               "(a fresh subdirectory, removed at the end); '' to skip them.")
_MESH = flags.DEFINE_string("mesh", "fsdp=8", "Mesh the state is sharded over and saved from.")
_RESHARD_MESH = flags.DEFINE_string("reshard_mesh", "data=2,tensor=4",
                                    "Mesh of the resharding restore.")
_VARIANTS = flags.DEFINE_list("variants", list(VARIANTS),
                              f"orbax option sets, of {list(VARIANTS)}.")
_STEP_SEQ = flags.DEFINE_integer("step_seq", 64, "Tokens per row of the train step (8 rows).")
_PART = flags.DEFINE_enum("part", "saves", ["saves", "run"], "saves: the measurements 1-4; "
                          "run: a training run without, with asynchronous and with synchronous "
                          "checkpoints (5.).")
_RUN_STEPS = flags.DEFINE_integer("run_steps", 100, "--part=run: train steps per mode.")
_EVERY = flags.DEFINE_integer("every", 10, "--part=run: steps between checkpoints.")
_KEEP = flags.DEFINE_integer("keep", 3, "--part=run: checkpoints kept (configs/tiny_lm.py's "
                             "keep_checkpoints).")
_PROFILE = flags.DEFINE_bool("profile", False, "cProfile one async and one sync save(), each "
                            "called right after a train step.")
_JSON = flags.DEFINE_string("json", "", "Optional path of a JSON file with every sample.")


def main(argv):
  del argv
  if _PART.value == "run":
    try:
      check_run_args(_SIZES.value, steps=_RUN_STEPS.value, every=_EVERY.value,
                     repeats=_REPEATS.value, keep=_KEEP.value)
    except ValueError as e:
      sys.exit(f"error: {e}")
    result = run_training(_SIZES.value, steps=_RUN_STEPS.value, every=_EVERY.value,
                          repeats=_REPEATS.value, keep=_KEEP.value, disk_dir=_DIR.value,
                          mesh_spec=_MESH.value, step_seq=_STEP_SEQ.value,
                          json_path=_JSON.value)
    print(run_table(result))
  else:
    result = run(_SIZES.value, repeats=_REPEATS.value, disk_dir=_DIR.value,
                 shm_dir=_SHM_DIR.value or None, mesh_spec=_MESH.value,
                 reshard_spec=_RESHARD_MESH.value, variants=_VARIANTS.value,
                 step_seq=_STEP_SEQ.value, profile=_PROFILE.value, json_path=_JSON.value)
    print(tables(result))
  log(f"done in {sum(s['seconds'] for s in result['sizes']):.0f}s"
      + (f"; wrote {_JSON.value}" if _JSON.value else ""))


if __name__ == "__main__":
  app.run(main)
