r"""HDP's planning time per step: which offered documents a step takes, and its plan.

  python -m experiments.bench_hdp_planner --devices=8,64,256,1024 --steps=3

Prints a markdown table of the plans and CPU seconds a step takes to fit the offered
documents (training's one schedule, a binary search, one plan per document) and the
capacity they fill; then the programs HDP's step compiles over --batches steps at each of
--program_devices and their padding; with --relocation_ring, what relocating a ring
program costs against compiling it. What each measures: `jaxsys/bench/hdp_planner.py`.
"""
from __future__ import annotations

import json

from absl import app, flags

from jaxsys.bench import hdp_planner


def _define_flags() -> None:
  """Defines the flags, only when run as a script: importing it defines none."""
  global _DEVICES, _TOKENS, _MICRO_STEPS, _STEPS, _BASELINE_MAX, _OUT
  _DEVICES = flags.DEFINE_list("devices", ["8", "64", "256", "1024"], "Pool sizes.")
  _TOKENS = flags.DEFINE_integer("tokens_per_device", 16384, "Tokens per slot.")
  _MICRO_STEPS = flags.DEFINE_integer("micro_steps", 4, "Micro-batches a step.")
  _STEPS = flags.DEFINE_integer("steps", 3, "Steps (offers) per case.")
  _BASELINE_MAX = flags.DEFINE_integer("baseline_max_devices", 64,
                                       "Largest pool the one-plan-per-document baseline runs.")
  _OUT = flags.DEFINE_string("out", None, "Optional JSON path with every number.")
  global _PROGRAM_DEVICES, _BATCHES
  _PROGRAM_DEVICES = flags.DEFINE_list("program_devices", ["8", "64", "1024"],
                                       "Pool sizes whose compiled programs are counted.")
  _BATCHES = flags.DEFINE_integer("batches", 100, "Steps whose programs are counted.")
  global _RELOCATION_RING, _RELOCATION_TPD
  _RELOCATION_RING = flags.DEFINE_integer("relocation_ring", 0,
                                          "Ring size whose relocation is timed (0: none).")
  _RELOCATION_TPD = flags.DEFINE_integer("relocation_tpd", 1024, "Its tokens per cell.")


def main(argv):
  del argv
  rows = hdp_planner.run(devices=[int(d) for d in _DEVICES.value],
                         tokens_per_device=_TOKENS.value, micro_steps=_MICRO_STEPS.value,
                         steps=_STEPS.value, baseline_max_devices=_BASELINE_MAX.value)
  print(hdp_planner.table(rows))
  counts = [hdp_planner.count_programs(devices=int(n), tokens_per_device=_TOKENS.value,
                                       micro_steps=_MICRO_STEPS.value, batches=_BATCHES.value,
                                       distribution=distribution)
            for distribution in ("stdlib", "long_tail") for n in _PROGRAM_DEVICES.value]
  print(hdp_planner.programs_table(counts))
  relocation = None
  if _RELOCATION_RING.value:
    relocation = hdp_planner.relocation_seconds(ring=_RELOCATION_RING.value,
                                                tokens_per_device=_RELOCATION_TPD.value)
    print(relocation)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump({"planning": rows, "programs": counts, "relocation": relocation}, f, indent=1)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
