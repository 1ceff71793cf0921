r"""Hybrid Data Parallelism (HDP) against static context-parallel meshes.

  python -m experiments.bench_hdp --part=sim --chart=docs/hdp_sim.png
  python -m experiments.bench_hdp --part=sim --link_gbps=0 --accel_link_gbps=25,100,450 \
      --devices=64,256,1024 --seeds=5 --rates=1.2e-11,9e-12 --per_rank=hdp,once
  python -m experiments.bench_hdp --part=sim --tensor=2 --fsdp=-1 --devices=64,128,256,512,1024
  python -m experiments.bench_hdp --part=real

--part=real: one training step per global batch of whole stdlib documents on 8
simulated devices, laid out by HDP, by a static mesh padding each document to its ring,
and by a static mesh packing them, through the same executor (jaxsys/bench/hdp_real.py);
it prints micro-steps, padding waste, per-micro-step imbalance and step time.
(The script sets 8 simulated CPU devices itself when XLA_FLAGS does not name a count.)

--part=sim: the cost-model simulation at 8..1024 devices against static layouts; what it
simulates, the machines and the baselines are described in jaxsys/bench/hdp.py. It prints
a markdown table (median [min, max] over seeds) and draws the chart.
"""
from __future__ import annotations

from jaxsys import xla_flags

xla_flags.default_cpu_devices(8)

import json

from absl import app, flags

from jaxsys.bench import hdp_real
from jaxsys.bench.hdp import PER_RANK, sim_part

PARTS = ("sim", "real")


def _define_flags() -> None:
  """Defines the flags: only when this file runs as a script, so tests can import it
  beside other benchmarks (absl refuses a flag name defined twice in one process)."""
  global _PART, _DEVICES, _SEEDS, _TPD, _BATCH_STEPS, _FILL, _MAX_LEN, _LINK, _ACCEL_TFLOPS, \
         _ACCEL_LINK, _CHART, _OUT, _REAL_SIZE, _REAL_TPD, _REAL_MAX_LEN, _REAL_BATCH_STEPS, \
         _REAL_BATCHES, _TENSOR, _FSDP, _TENSOR_LINK, _RATIOS, _RATES, _PER_RANK
  _PART = flags.DEFINE_enum("part", "sim", PARTS, "Which benchmark to run.")
  _DEVICES = flags.DEFINE_list("devices", ["8", "16", "32", "64", "128", "256", "512", "1024"],
                               "Device counts N (powers of two).")
  _SEEDS = flags.DEFINE_integer("seeds", 3, "Global batches (seeds) per point.")
  _TPD = flags.DEFINE_integer("tokens_per_device", 32768, "Tokens one device holds per micro-step.")
  _BATCH_STEPS = flags.DEFINE_integer("batch_steps", 4, "Global batch budget = N * tpd * this "
                                      "* --fill tokens.")
  _FILL = flags.DEFINE_float("fill", 0.95, "Fraction of batch_steps micro-steps' slots the batch's "
                             "token budget holds (slack for ring rounding and packing).")
  _MAX_LEN = flags.DEFINE_integer("max_len", 262144, "Longest sequence (static ring size).")
  _LINK = flags.DEFINE_float("link_gbps", 100.0, "cpu setting: link GB/s per direction; 0 "
                             "leaves the cpu setting out.")
  _ACCEL_TFLOPS = flags.DEFINE_float("accel_tflops", 400.0, "accel setting: matmul TFLOP/s.")
  _ACCEL_LINK = flags.DEFINE_list("accel_link_gbps", ["25", "100", "450"],
                                  "accel settings: link GB/s, one setting each.")
  _RATIOS = flags.DEFINE_list("attention_ratios", [], "accel: attention's cost per FLOP over a "
                              "matmul FLOP's, one setting each; none: the fitted ratio.")
  _RATES = flags.DEFINE_list("rates", [], "s per attention FLOP,s per linear FLOP: use these "
                             "(e.g. experiments/hdp_calibrate's fit) instead of fitting.")
  _PER_RANK = flags.DEFINE_list("per_rank", [k for k, _ in PER_RANK], "Per-rank HDP variants "
                                "to time (hdp always).")
  _TENSOR = flags.DEFINE_integer("tensor", 1, "sim: devices per slot's tensor group.")
  _FSDP = flags.DEFINE_integer("fsdp", 1, "sim: slots the parameters are sharded over (ZeRO); "
                               "-1: all slots.")
  _TENSOR_LINK = flags.DEFINE_float("tensor_link_gbps", 100.0, "sim: a tensor group's link "
                                    "GB/s per direction (NVLink-class, inside a node).")
  _CHART = flags.DEFINE_string("chart", "", "Write the speed-up chart here (PNG).")
  _OUT = flags.DEFINE_string("out", "", "Write every number here (JSON).")
  _REAL_SIZE = flags.DEFINE_string("real_size", "tiny", "real: configs/tiny_lm.py model size.")
  _REAL_TPD = flags.DEFINE_integer("real_tokens_per_device", 1024, "real: tokens per device.")
  _REAL_MAX_LEN = flags.DEFINE_integer("real_max_len", 8192, "real: data.max_len (truncated).")
  _REAL_BATCH_STEPS = flags.DEFINE_integer("real_batch_steps", 8,
                                           "real: global batch = 8 * tpd * this tokens.")
  _REAL_BATCHES = flags.DEFINE_integer("real_batches", 3, "real: timed global batches.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  devices = []
  for v in _DEVICES.value:
    n = int(v)
    if n < 1 or n & (n - 1):
      raise app.UsageError(f"--devices: {v} is not a power of two")
    if n % _TENSOR.value or (_FSDP.value > 0 and (n // _TENSOR.value) % _FSDP.value):
      raise app.UsageError(f"--devices: {n} does not split into slots of --tensor="
                           f"{_TENSOR.value} sharded over --fsdp={_FSDP.value}")
    devices.append(n)
  if _PART.value == "real":
    rows = hdp_real.real_part(size=_REAL_SIZE.value, tokens_per_device=_REAL_TPD.value,
                              max_len=_REAL_MAX_LEN.value, batch_steps=_REAL_BATCH_STEPS.value,
                              batches=_REAL_BATCHES.value)
    print(hdp_real.real_table(rows))
    if _OUT.value:
      with open(_OUT.value, "w") as f:
        json.dump(rows, f, indent=1, default=float)
  if _PART.value == "sim":
    sim_part(devices, seeds=_SEEDS.value, tokens_per_device=_TPD.value,
             batch_steps=_BATCH_STEPS.value, max_len=_MAX_LEN.value,
             link_gbps=_LINK.value, accel_tflops=_ACCEL_TFLOPS.value,
             accel_link_gbps=[float(g) for g in _ACCEL_LINK.value], chart=_CHART.value, out=_OUT.value,
             fill=_FILL.value, tensor=_TENSOR.value, fsdp=_FSDP.value,
             tensor_link_gbps=_TENSOR_LINK.value,
             attention_ratios=[float(r) for r in _RATIOS.value],
             rates=[float(r) for r in _RATES.value] or None, per_rank=_PER_RANK.value)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
