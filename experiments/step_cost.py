"""The compiled cost of a run's train step, per device: FLOPs, HBM bytes, memory.

Builds the step exactly as the runner does (`train.setup.make_setup`) for the config and
mesh given, compiles it for abstract inputs (nothing is trained, no data is read) and
prints one device's matmul FLOPs and HBM bytes read from its HLO with every loop trip
counted (`jaxsys.hlo_flops`; a pipeline's conditional ticks at their dearest branch, an
upper bound), XLA's cost analysis (which counts a loop body once) and memory analysis,
beside plain data parallelism on the same devices and global batch:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.step_cost \
      --config=configs/tiny_lm.py --config.mesh=replica=2,stage=2,context=2 \
      --config.outer.name=diloco --config.pipeline.schedule=1f1b
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from absl import app
from ml_collections import config_flags

from jaxsys import hlo_flops
from jaxsys import mesh as mesh_lib
from jaxsys.data.packing import FIELDS
from jaxsys.train import config_check
from jaxsys.train.setup import make_setup

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/<name>.py[:arg]",
                                          lock_config=True)


def step_cost(config) -> dict[str, float]:
  """Per-device FLOPs and HBM bytes (every loop trip, and XLA's), argument and temporary
  bytes of `config`'s train step."""
  run = config_check.check_config(config)
  setup = make_setup(run, mesh_lib.make_mesh(run.mesh))
  shape = (config.data.batch_size, config.data.seq_len)
  batch = {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32,
                                   sharding=setup.batch_sh) for k in FIELDS}
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       setup.abstract, setup.state_sh)
  compiled = setup.train_fn.lower(state, batch).compile()
  cost, memory = compiled.cost_analysis(), compiled.memory_analysis()
  text = compiled.as_text()
  return {"matmul_flops": hlo_flops.dot_flops(text), "hbm_bytes": hlo_flops.hbm_bytes(text),
          "flops": cost.get("flops", 0.0), "bytes": cost.get("bytes accessed", 0.0),
          "argument_bytes": memory.argument_size_in_bytes,
          "temp_bytes": memory.temp_size_in_bytes}


def main(argv) -> None:
  del argv
  config = _CONFIG.value
  try:
    config_check.check_config(config)
  except ValueError as e:
    sys.exit(f"error: {e}")
  baseline = config.copy_and_resolve_references()
  with baseline.unlocked():
    baseline.mesh = "data=-1"
    baseline.outer.name = "none"
    baseline.optimizer.grad_accum_steps = 1
    baseline.pipeline.schedule = "none"
    baseline.pipeline.vocab_parallel = False
    baseline.pipeline.routing = "fixed"
  rows = {config.mesh: step_cost(config), "data parallel": step_cost(baseline)}
  print(f"{'per device':<32} {'matmul GFLOP':>12} {'HBM GB':>8} {'XLA GFLOP':>10} "
        f"{'XLA GB':>8} {'args MiB':>9} {'temp MiB':>9}")
  print(f"{'':<32} {'(loops in full)':>21} {'(a loop body once)':>19}")
  for name, c in rows.items():
    print(f"{name:<32} {c['matmul_flops'] / 1e9:>12.3f} {c['hbm_bytes'] / 1e9:>8.3f} "
          f"{c['flops'] / 1e9:>10.3f} {c['bytes'] / 1e9:>8.3f} "
          f"{c['argument_bytes'] / 2**20:>9.1f} {c['temp_bytes'] / 2**20:>9.1f}")


if __name__ == "__main__":
  app.run(main)
