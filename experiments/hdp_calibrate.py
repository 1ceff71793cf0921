r"""The HDP simulator's cost model against measured ring-attention steps: compute fitted to
whole steps, then checked on held-out mixes and over a real link.

  python -m experiments.hdp_calibrate --bandwidths=100mbit,200mbit --out=/tmp/hdp_cal.json

Times the CPU's matmul and attention rates, fits the simulator's compute terms (--terms)
to in-process ring-attention steps of --fit_mixes, predicts --heldout_mixes, then runs
--lab_mix over two processes joined by the network lab's link at each of --bandwidths and
prints each prediction against the measurement (every number in --out). The model, the
fit and the two link models: `jaxsys/bench/hdp_calibrate.py`. Needs root and iproute2 for
the shaped links (--bandwidths= skips them).
"""
from __future__ import annotations

import json
import sys

from absl import app, flags

from jaxsys.bench import hdp_calibrate
from jaxsys.lab import link as link_lib
from jaxsys.parallel import hdp_sim

_BANDWIDTHS = flags.DEFINE_list("bandwidths", ["100mbit", "200mbit"],
                                "Lab link rates (none: unshaped; empty: no lab cases).")
_TOPOLOGY = flags.DEFINE_enum("topology", "switched", ["shared", "switched"], "The lab's network.")
_UNSHAPED = flags.DEFINE_float("unshaped_mbit", None, "The unshaped path's rate (Mbit/s); "
                               "default network_lab.md's for the topology.")
_FIT_MIXES = flags.DEFINE_list("fit_mixes", ["2x4096", "8x1024", "2x2048"],
                               "In-process mixes (ROWSxTOKENS a row) the compute is fitted to.")
_HELDOUT_MIXES = flags.DEFINE_list("heldout_mixes", ["4x2048", "16x512"],
                                   "In-process mixes predicted, not fitted.")
_LAB_MIX = flags.DEFINE_string("lab_mix", "2x4096", "The mix the lab cases run (one of the "
                               "fitted or held-out mixes: its in-process step is their compute).")
_TERMS = flags.DEFINE_list("terms", ["sec_per_attention_flop", "sec_per_element", "sec_per_step"],
                           f"CostModel terms fitted to the whole steps (of {hdp_sim.STEP_TERMS}).")
_STEPS = flags.DEFINE_integer("steps", 6, "Training steps a case (the first compiles).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/hdp_calibrate", "Scratch directory (replaced).")
_OUT = flags.DEFINE_string("out", "/tmp/hdp_calibrate.json", "Every number (JSON).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  mixes = hdp_calibrate.mix_roles(_FIT_MIXES.value, _HELDOUT_MIXES.value)
  for mix in mixes:
    hdp_calibrate.parse_mix(mix)
  if set(_FIT_MIXES.value) & set(_HELDOUT_MIXES.value):
    raise app.UsageError(f"--fit_mixes and --heldout_mixes share "
                         f"{sorted(set(_FIT_MIXES.value) & set(_HELDOUT_MIXES.value))}")
  if _BANDWIDTHS.value and _LAB_MIX.value not in mixes:
    raise app.UsageError(f"--lab_mix={_LAB_MIX.value}: must be one of the measured mixes "
                         f"{sorted(mixes)} (its in-process step is the lab cases' compute)")
  try:
    result = hdp_calibrate.run(
        _WORKDIR.value, fit_mixes=_FIT_MIXES.value, heldout_mixes=_HELDOUT_MIXES.value,
        lab_mix=_LAB_MIX.value, bandwidths=_BANDWIDTHS.value, topology=_TOPOLOGY.value,
        unshaped_mbit=_UNSHAPED.value, terms=_TERMS.value, steps=_STEPS.value)
  except link_lib.LabError as e:
    sys.exit(f"error: {e}")
  with open(_OUT.value, "w") as f:
    json.dump(result, f, indent=1, default=float)


if __name__ == "__main__":
  app.run(main)
