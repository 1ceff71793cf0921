r"""The outer optimizers timed across a shaped link: two processes, one replica each.

  python -m experiments.lab_outer --out=/tmp/lab_outer.json

For each link rate: data parallelism (mesh data=2) trains --steps steps; each outer
optimizer (mesh replica=2: one replica in each process, so every sync crosses the link)
trains up to --outer_factor times as many on the same global batch, evaluating every
--eval_every steps. Per run: the training clock (the sum of its step times, each sync in
the step it delays; evaluation and saves left out), the clock at which its validation
loss first reaches data parallelism's final one (None if never within its steps), bytes
on the wire (the shaper's count over the whole run), the link's peak utilisation (100 ms bins) and step times: the median step,
and the median of the steps that carry a sync; the first run of each program, which
compiles, counts at its kind's median. One seed: a timing study; the losses'
comparisons across seeds are in docs/results/outer_optimizers.md. Needs root and iproute2.
"""
import json
import os
import shutil

import numpy as np
from absl import app, flags

from jaxsys.lab import link, run

flags.DEFINE_list("bandwidths", ["20mbit", "100mbit", "300mbit"], "Link rates.")
flags.DEFINE_list("runs", ["dp", "diloco_h10", "diloco_h50", "diloco_h100", "diloco_h250",
                           "streaming_h50", "noloco_h50", "co2_h10"],
                  "Runs (dp first: its loss is the target); co2twins_h<H>: CO2 with its "
                  "all-reduce on communication twins (a second CPU device per process).")
flags.DEFINE_integer("steps", 200, "Data parallelism's steps (the token budget).")
flags.DEFINE_integer("outer_factor", 3, "An outer optimizer's steps, in units of --steps.")
flags.DEFINE_integer("eval_every", 20, "Steps between evaluations.")
flags.DEFINE_integer("seed", 0, "Seed of every run.")
flags.DEFINE_integer("log_every", 1, "Steps a metrics row covers. A replica run's steps do not "
                     "communicate, but fetching their metrics is a collective: 1 times every "
                     "step (and sync steps apart); H keeps the link to the syncs.")
flags.DEFINE_string("config", "configs/tiny_lm.py:size=test", "The runner's config.")
flags.DEFINE_list("overrides", [], "More --config.* overrides of every run (without --config.).")
flags.DEFINE_string("workdir", "/tmp/lab_outer", "Scratch directory (replaced).")
flags.DEFINE_string("out", "/tmp/lab_outer.json", "Every run's numbers.")
flags.DEFINE_string("plot", "/tmp/lab_outer.png", "Validation loss against the training clock, "
                    "a panel a link rate ('' for none).")
FLAGS = flags.FLAGS

OUTER = {"diloco": "diloco", "streaming": "streaming_diloco", "noloco": "noloco", "co2": "co2",
         "co2twins": "co2"}


def _overrides(name: str) -> tuple[list[str], int, int]:
  """(the runner's overrides, steps, H) of run `name` (dp, or <method>_h<H>)."""
  if name == "dp":
    return ["--config.mesh=data=2"], FLAGS.steps, 1
  method, _, h = name.partition("_h")
  extra = {"streaming": ["--config.outer.fragments=2"],
           "co2twins": ["--config.outer.comm_device=True"]}.get(method, [])
  return (["--config.mesh=replica=2", f"--config.outer.name={OUTER[method]}",
           f"--config.outer.sync_every={h}", *extra],
          FLAGS.steps * FLAGS.outer_factor, int(h))


def _one(name: str, bandwidth: str) -> dict:
  overrides, steps, h = _overrides(name)
  workdir = os.path.join(FLAGS.workdir, bandwidth, name)
  shutil.rmtree(workdir, ignore_errors=True)
  twins = name.startswith("co2twins")
  summary = run.run_lab(run.LabConfig(processes=2, bandwidth=bandwidth,
                                      devices_per_process=2 if twins else 1, runner_args=(
      f"--config={FLAGS.config}", f"--config.seed={FLAGS.seed}", f"--config.total_steps={steps}",
      f"--config.log_every={FLAGS.log_every}", f"--config.eval_every={FLAGS.eval_every}",
      "--config.checkpoint_every=0", *overrides, *(f"--config.{o}" for o in FLAGS.overrides),
      f"--workdir={workdir}")), echo=False)
  times = {}  # a row's seconds a step, for each step it covers
  for step, seconds in run.step_times(workdir):
    times.update((s, seconds) for s in range(step - FLAGS.log_every + 1, step + 1))
  # The step that carries a sync: the one after it is due when fused into the next (CO2).
  fused = name.startswith("co2") and not twins
  sync_steps = {s for s in range(1, steps + 1) if h > 1 and (s - fused) % h == 0}
  clock = _clock(times, steps, sync_steps)
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  evals = [(r["step"], float(clock[r["step"] - 1]), r["val_loss"]) for r in rows
           if "val_loss" in r]
  util = [json.loads(l) for l in open(os.path.join(workdir, "lab", "wire.jsonl"))]
  synced = [times[s] for s in sync_steps if s in times] if FLAGS.log_every == 1 else []
  late = [t for s, t in times.items() if s > 2 * max(h, FLAGS.log_every)]  # compiles done
  return dict(name=name, bandwidth=bandwidth, steps=steps, h=h, summary=summary, evals=evals,
              clock_s=float(clock[-1]), final_val_loss=evals[-1][2],
              step_s=float(np.median([t for s, t in times.items() if s not in sync_steps])),
              mean_step_s=float(np.mean(late)) if late else None,
              sync_step_s=float(np.median(synced)) if synced else None,
              # The step after a sync step: CO2's (twins) with the all-reduce in flight.
              after_sync_step_s=float(np.median([times[s + 1] for s in sync_steps
                                                 if s + 1 in times])) if synced else None,
              step_wire_bytes=summary["wire_bytes_per_step"] * summary["timed_steps"],
              wire_bytes=summary["shaper"]["bytes"],  # the whole run's, evaluations included
              peak_share=max(u.get("share", 0.0) for u in util))


def _clock(times: dict[int, float], steps: int, sync_steps: set[int]) -> np.ndarray:
  """The training clock after each step: the sum of step times, where each program's first
  runs (step 1; a sync step among the first two of its kind: the sync's own program, and
  CO2's fused one) compile, so count at their kind's median when over 3x it."""
  kinds = [sorted(s for s in times if s in sync_steps),
           sorted(s for s in times if s not in sync_steps)]
  out = dict(times)
  for kind in kinds:
    if not kind:
      continue
    median = float(np.median([times[s] for s in kind]))
    for s in kind[:2]:
      if times[s] > 3 * median:
        out[s] = median
  plain = float(np.median([times[s] for s in kinds[1]]))
  return np.cumsum([out.get(s, plain) for s in range(1, steps + 1)])


def _reached(evals, target: float) -> float | None:
  """The training clock at the first evaluation at or below `target`."""
  return next((t for _, t, loss in evals if loss <= target + 1e-12), None)


def plot(results: list[dict], path: str) -> None:
  """Validation loss against the training clock, one panel per link rate, a line per run;
  data parallelism's final loss dashed."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  rates = list(dict.fromkeys(r["bandwidth"] for r in results))
  fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 3.6), squeeze=False)
  for ax, rate in zip(axes[0], rates):
    for r in (r for r in results if r["bandwidth"] == rate):
      ax.plot([t for _, t, _ in r["evals"]], [l for _, _, l in r["evals"]], label=r["name"],
              lw=2 if r["name"] == "dp" else 1)
    ax.axhline(next(r["target_val_loss"] for r in results if r["bandwidth"] == rate),
               color="gray", ls="--", lw=0.8)
    ax.set(title=f"link: {rate}", xlabel="training clock (s)", ylabel="validation loss",
           xscale="log", ylim=(2.0, 3.2))
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv):
  del argv
  out = []
  try:
    for bw in FLAGS.bandwidths:
      results = [_one(name, bw) for name in FLAGS.runs]
      target = results[0]["final_val_loss"]
      for r in results:
        r["target_val_loss"] = target
        r["clock_to_target_s"] = _reached(r["evals"], target)
      out.extend(results)
      with open(FLAGS.out, "w") as f:
        json.dump(out, f, indent=1)
  except link.LabError as e:
    raise SystemExit(f"error: {e}") from e
  if FLAGS.plot:
    plot(out, FLAGS.plot)
  print("| link | run | steps | train clock (s) | clock to DP's loss (s) | final val loss "
        "| step (ms) | sync step (ms) | mean step, compiled (ms) | wire MB, steps | wire MB, run "
        "| peak link share |")
  print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for r in out:
    reach = r["clock_to_target_s"]
    sync, mean = r["sync_step_s"], r["mean_step_s"]
    print(f"| {r['bandwidth']} | {r['name']} | {r['steps']} | {r['clock_s']:.1f} | "
          f"{'never' if reach is None else f'{reach:.1f}'} | {r['final_val_loss']:.4f} | "
          f"{r['step_s'] * 1e3:.1f} | {'-' if sync is None else f'{sync * 1e3:.0f}'} | "
          f"{'-' if mean is None else f'{mean * 1e3:.1f}'} | "
          f"{r['step_wire_bytes'] / 1e6:.1f} | {r['wire_bytes'] / 1e6:.1f} | "
          f"{r['peak_share']:.2f} |")


if __name__ == "__main__":
  app.run(main)
