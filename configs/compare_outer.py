"""Data parallel vs DiLoCo vs NoLoCo vs CO2 on a small byte-level LM, at equal steps and tokens.

Run (about 15-20 minutes on a 2-core CPU, 8 simulated devices):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.compare_outer \
      --config=configs/compare_outer.py --workdir=/tmp/jaxsys_outer

Every run trains the same model for `total_steps` inner steps on the same global
batch of `data.batch_size` rows: k replicas take B/k rows each, data parallel
splits the batch over k workers too. `runs` names the rows of the table; `run_specs`
holds each run's config overrides (nested like the config).
"""
import importlib.util
import pathlib

import ml_collections


def _tiny_lm():
  spec = importlib.util.spec_from_file_location(
      "tiny_lm", pathlib.Path(__file__).with_name("tiny_lm.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _outer(name, k, h, **kw):
  return dict(mesh=f"replica={k},data={8 // k}",
              optimizer=dict(outer=name, outer_sync_every=h, **kw))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg:
    raise ValueError(f"configs/compare_outer.py takes no argument; got {arg!r}")
  c = _tiny_lm().get_config("size=test")
  # Between the `test` and `tiny` sizes: big enough that the methods separate, small enough
  # that the 12 runs fit in about 20 minutes on 2 quiet CPU cores.
  c.model.update(dict(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=384))
  c.data.update(dict(seq_len=128, batch_size=32, num_threads=2))
  c.total_steps = 400  # 4 syncs at H=100
  c.log_every = 50
  c.eval_every = 50
  c.eval_steps = 4
  c.checkpoint_every = 100  # a crashed comparison resumes its run from here
  c.keep_checkpoints = 1
  c.optimizer.update(dict(learning_rate=3e-3, warmup_steps=20))
  c.mesh = "data=-1"  # data parallel: 8 workers; the table compares bytes at the same k

  runs = {"dp": dict()}
  for k in (4, 8):
    for h in (10, 50, 100):
      runs[f"diloco_k{k}_h{h}"] = _outer("diloco", k, h)
  runs["diloco_k4_h50_int8"] = _outer("diloco", 4, 50, outer_compression="int8")
  runs["noloco_k4_h50"] = _outer("noloco", 4, 50)
  runs["co2_k4_h50"] = _outer("co2", 4, 50)
  # Diagnostics: plain parameter averaging (outer SGD, lr 1, no momentum) at the same k, H;
  # CO2 without outer momentum (one-step-delayed averaging).
  runs["avg_k4_h50"] = _outer("diloco", 4, 50, outer_lr=1.0, outer_momentum=0.0)
  runs["co2_k4_h50_m0"] = _outer("co2", 4, 50, outer_momentum=0.0)
  c.runs = ",".join(runs)
  c.run_specs = ml_collections.ConfigDict(runs)
  return c
