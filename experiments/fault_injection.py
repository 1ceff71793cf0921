r"""Crash safety by fault injection: SIGKILL a training run at random points, resume, compare.

  python -m experiments.fault_injection --workdir=/tmp/jaxsys_faults --crashes=20

Kills a run with a checkpoint every step --crashes times (most with a save in flight),
restarts it each time, and checks every resume and the finished run's losses against an
uninterrupted run's (`jaxsys/bench/faults.py`). Other faults instead: --corruption
(damaged checkpoints: jaxsys/bench/corruption.py), --preemption (SIGTERM at each
moment of start-up and resume: jaxsys/bench/preemptions.py), --bad_input (each kind
of bad input, one `error:` line each: jaxsys/bench/bad_input.py). Prints a table and a
verdict; exit status 1 when a check fails.
"""
from __future__ import annotations

import json
import os
import sys

from absl import app, flags

from jaxsys import xla_flags  # no jax
from jaxsys.bench import faults  # no jax

_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for both runs: absent or empty.")
_CRASHES = flags.DEFINE_integer("crashes", 20, "SIGKILLs before the run may finish.")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the kill points.")
_STEPS = flags.DEFINE_integer("total_steps", 40, "Steps of the run (a checkpoint after each).")
_SOURCE = flags.DEFINE_string("data_source", "stdlib", "data.source of the config.")
_DEVICES = flags.DEFINE_integer("devices", 8, "Simulated CPU devices (the mesh is data=-1).")
_JSON = flags.DEFINE_string("json", "", "Also write the crashes and checks here.")
_CORRUPTION = flags.DEFINE_boolean("corruption", False, "Damage checkpoints instead of killing "
                                   "runs (jaxsys/bench/corruption.py).")
_TRIALS = flags.DEFINE_integer("trials", 2, "--corruption: trials of each kind of damage.")
_PREEMPTION = flags.DEFINE_boolean("preemption", False, "SIGTERM the train binary at each "
                                   "moment of start-up and resume instead "
                                   "(jaxsys/bench/preemptions.py).")
_BAD_INPUT = flags.DEFINE_boolean("bad_input", False, "Give the train binary each kind of bad "
                                  "input instead (jaxsys/bench/bad_input.py).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # jax reads these when it is first imported, in a mode below: before any child is forked.
  os.environ["XLA_FLAGS"] = xla_flags.with_cpu_devices(_DEVICES.value)
  os.environ["JAX_PLATFORMS"] = "cpu"
  workdir = os.path.abspath(_WORKDIR.value)
  if os.path.exists(workdir) and os.listdir(workdir):
    sys.exit(f"error: --workdir {workdir} is not empty")
  if _PREEMPTION.value or _BAD_INPUT.value:  # the binary in processes of its own: no jax here
    os.makedirs(workdir, exist_ok=True)
    if _PREEMPTION.value:
      from jaxsys.bench import preemptions as table
    else:
      from jaxsys.bench import bad_input as table
    result = table.run(workdir, _SOURCE.value)
    print(table.summary(result))
  else:
    faults.prepare_parent(workdir)
    if _CORRUPTION.value:
      from jaxsys.bench import corruption
      result = corruption.run(workdir, _TRIALS.value, _SEED.value, _SOURCE.value)
      print(corruption.summary(result))
    else:
      result = faults.run(workdir, _CRASHES.value, _SEED.value, _STEPS.value, _SOURCE.value)
      print(faults.summary(result))
  if _JSON.value:
    with open(_JSON.value, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
  return 1 if result["problems"] else 0


if __name__ == "__main__":
  flags.mark_flag_as_required("workdir")
  app.run(main)
