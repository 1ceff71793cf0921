r"""The lab against physics: a data-parallel step over P processes at several link rates.

  python -m experiments.lab_check --bandwidths=20mbit,100mbit,1gbit --out=/tmp/lab_check.json

Times the compute alone first: one process, one device pinned to one core, training one
process's share of the batch (batch/P, mesh data=1: the same program less its all-reduce).
Then runs the data-parallel training (--config and the --config.* overrides below, mesh
data=P, P processes of one device on their own cores) unshaped and at each rate, and
predicts each step as that compute plus the compiled train step's collective bytes, with
their packets' headers, through the shared link (`jaxsys.lab.physics`); prints measured
against predicted, and wire bytes against the compiled collectives. --topology=switched:
the same on a link per process (each uplink carries one process's share). Needs root and
iproute2.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
from absl import app, flags

from jaxsys import xla_flags
from jaxsys.lab import link, physics, run

flags.DEFINE_integer("processes", 2, "Processes P (mesh data=P, one device each).")
flags.DEFINE_list("bandwidths", ["20mbit", "100mbit", "300mbit", "1gbit"], "Link rates to time.")
flags.DEFINE_string("config", "configs/tiny_lm.py:size=test", "The runner's config.")
flags.DEFINE_list("overrides", ["model.d_model=128", "model.d_ff=512", "model.n_layers=4"],
                  "The runner's --config.* overrides (without --config.).")
flags.DEFINE_enum("topology", "shared", ["shared", "switched"], "The lab's network.")
flags.DEFINE_integer("batch_size", 16, "Global batch (rows), split over the processes.")
flags.DEFINE_integer("steps", 12, "Training steps per run (the first compiles).")
flags.DEFINE_string("workdir", "/tmp/lab_check", "Scratch directory (replaced).")
flags.DEFINE_string("out", "/tmp/lab_check.json", "Every run's summary and the table's rows.")
FLAGS = flags.FLAGS


def _args(name: str, *extra: str) -> tuple[str, ...]:
  workdir = os.path.join(FLAGS.workdir, name)
  shutil.rmtree(workdir, ignore_errors=True)
  return (f"--config={FLAGS.config}", f"--config.total_steps={FLAGS.steps}",
          "--config.log_every=1", "--config.eval_every=0", "--config.checkpoint_every=0",
          f"--config.data.batch_size={FLAGS.batch_size}",
          *(f"--config.{o}" for o in FLAGS.overrides), *extra, f"--workdir={workdir}")


def _run(bandwidth: str) -> dict:
  args = _args(bandwidth, f"--config.mesh=data={FLAGS.processes}")
  return run.run_lab(run.LabConfig(processes=FLAGS.processes, bandwidth=bandwidth,
                                   runner_args=args, topology=FLAGS.topology), echo=False)


def _compute_alone(batch_size: int) -> list[float]:
  """Step times of one process's share of the batch, alone on core 0 (the first step,
  which compiles, left out)."""
  args = _args("compute", "--config.mesh=data=1",
               f"--config.data.batch_size={batch_size // FLAGS.processes}")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags.with_cpu_devices(1))
  subprocess.run(["taskset", "-c", "0", sys.executable, "-m", run.RUNNER, *args], env=env,
                 check=True, capture_output=True)
  return [t for _, t in run.step_times(args[-1].split("=", 1)[1])]


def main(argv):
  del argv
  try:
    compute = _compute_alone(FLAGS.batch_size)
    compute_s = float(np.median(compute))
    base = _run("none")
    busiest = lambda total: physics.link_payload(total, FLAGS.processes, FLAGS.topology)
    cap = physics.capacity(busiest(base["wire_bytes_per_step"]), base["step_time_s"], compute_s)
    rows = []
    for bw in ["none", *FLAGS.bandwidths]:
      s = base if bw == "none" else _run(bw)
      payload = s["collective_bytes_per_step"]
      predicted = physics.step_time(compute_s, busiest(payload), s["bandwidth_bps"], cap)
      rows.append(dict(bandwidth=bw, measured_s=s["step_time_s"],
                       spread_s=s["step_time_min_max_s"], predicted_s=predicted,
                       error=s["step_time_s"] / predicted - 1, comm_s=s["comm_s"],
                       wire_bytes=s["wire_bytes_per_step"],
                       wire_payload_bytes=s["wire_payload_bytes_per_step"],
                       collective_bytes=payload,
                       predicted_wire_bytes=physics.wire_bytes(payload), summary=s))
  except link.LabError as e:
    raise SystemExit(f"error: {e}") from e
  with open(FLAGS.out, "w") as f:
    json.dump({"compute_s": compute, "capacity_bps": cap, "rows": rows}, f, indent=1)
  print(f"compute alone (one process's share, one core): {compute_s * 1e3:.1f} ms "
        f"({min(compute) * 1e3:.1f}-{max(compute) * 1e3:.1f}); the unshaped loopback carries "
        f"{cap / 1e6:.0f} Mbit/s (the 'none' row, which calibrates it)")
  print("| link | measured step (ms, min-max) | predicted (ms) | error | link busy (ms) "
        "| wire bytes | TCP payload | compiled collectives | wire / predicted wire |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    lo, hi = r["spread_s"]
    print(f"| {r['bandwidth']} | {r['measured_s'] * 1e3:.1f} ({lo * 1e3:.1f}-{hi * 1e3:.1f}) | "
          f"{r['predicted_s'] * 1e3:.1f} | {r['error']:+.1%} | {r['comm_s'] * 1e3:.1f} | "
          f"{r['wire_bytes']:,.0f} | {r['wire_payload_bytes']:,.0f} | {r['collective_bytes']:,} | "
          f"{r['wire_bytes'] / r['predicted_wire_bytes']:.3f} |")


if __name__ == "__main__":
  app.run(main)
