r"""Compiles a run's programs for a TPU slice on this host (no TPU needed) and reports their cost.

  jaxsys-compile --config=llama3:size=8b --topology=v5p-128 --config.mesh=fsdp=16,tensor=4
  python -m experiments.compile --config=configs/llama3.py:size=1b --topology=v5e-8

Builds the run exactly as the trainer would (its config check, setup and kernels, the
Pallas TPU kernels chosen for the slice) over the slice's devices from libtpu, compiles the
train step, the evaluation step and (with an outer optimizer) the outer sync, and prints
per device: memory against the chip's HBM (fits, or by how much it overflows), matmul
FLOPs, HBM bytes read and written (every loop trip), the bytes of each kind of collective,
a roofline lower bound on each program's time, and the train step's recompute bound
(model FLOPs / compiled FLOPs).

`--topology`: a Cloud TPU slice name (`v5e-8`, `v5p-128`: v4 and v5p count TensorCores)
or a shape (`v6e:4x4`, `v4:2x2x2`). The mesh must use the slice's devices. A program that
does not fit is reported, not an error. Bad input (an unknown topology, a mesh of another
size, no libtpu) is one `error:` line, exit 1.
"""
import json
import os
import sys
import time

from jaxsys import platforms

platforms.choose("cpu")  # the host compiles; the slice is described

import jax  # pylint: disable=wrong-import-position
from absl import app, flags  # pylint: disable=wrong-import-position
from ml_collections import config_flags  # pylint: disable=wrong-import-position

from jaxsys import chips  # pylint: disable=wrong-import-position
from jaxsys import metrics as metrics_lib  # pylint: disable=wrong-import-position
from jaxsys.cli import args  # pylint: disable=wrong-import-position
from jaxsys.train import aot, config_check  # pylint: disable=wrong-import-position

_CONFIG = config_flags.DEFINE_config_file("config", None, "A config file's path or a packaged "
                                          "config's name (:arg optional).",
                                          lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", None, "The TPU slice to compile for: "
                                + chips.valid_names())
_JSON = flags.DEFINE_string("json", None, "Also write the report's figures to this JSON file.")
flags.mark_flags_as_required(["config", "topology"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  metrics_lib.quiet_library_logs()
  try:
    slice_ = chips.slice_devices(_TOPOLOGY.value)
    run = config_check.check_config(_CONFIG.value, devices=slice_.devices)
  except (ValueError, RuntimeError) as e:
    sys.exit(f"error: {e}")
  start = time.perf_counter()
  setup, programs = aot.compile_run(run, slice_)
  seconds = time.perf_counter() - start
  print(aot.report(run, setup, programs))
  print(f"compiled in {seconds:.1f} s on {os.cpu_count()} CPU cores (jax {jax.__version__})")
  if _JSON.value:
    with open(_JSON.value, "w", encoding="utf-8") as f:
      json.dump(aot.summary(run, setup, programs) | {"compile_seconds": seconds}, f, indent=1)
  return 0


def run() -> None:
  """The binary: absl's flags (config overrides included), then `main`."""
  app.run(main, flags_parser=args.parse_flags)


if __name__ == "__main__":
  run()
