"""Data parallel against DiLoCo, Streaming DiLoCo, NoLoCo and CO2: final val bpb, bytes.

The library of `experiments/compare_outer.py`; `run` does all of it, `compare` one seed.

With `pretrain_steps > 0` a data-parallel run first trains that many steps in
<workdir>/pretrain and every row starts from its parameters (`init_from`), as in
DiLoCo (arXiv 2311.08105 Sec. 3); 0 compares from scratch. Writes results.md,
results.json and outer_comparison.png (val loss against step and against bytes sent
per worker) to the workdir; each run trains in <workdir>/<run> (a finished run is read
back, not retrained). Bytes are compared with data parallel at the same number of
workers k: a ring all-reduce of the gradients every step.

With seeds (`--seeds=0,1,2`) it repeats all of it per seed in <workdir>/seed<N> (its own
pretrain, data order and init) and writes results_seeds.md: each row's mean ± std val bpb
and its gaps to data parallel and to DiLoCo at the same k and H, taken per seed, with the
95% t-interval of their mean ("indistinguishable" where it contains 0).

`run` then times the sync of each run it is asked to (`time_sync`) against a plain inner
step and adds that table to the results file (and writes sync_timing.json).
"""
import copy
import dataclasses
import json
import os
import time

import jax
import numpy as np
from absl import logging

from jaxsys import comm_bytes
from jaxsys import mesh as mesh_lib
from jaxsys import metrics as metrics_lib
from jaxsys import stats
from jaxsys.checkpoint.reader import read_params
from jaxsys.models import transformer
from jaxsys.optim import outer as outer_lib
from jaxsys.train import config_check
from jaxsys.train import replicas as replicas_lib
from jaxsys.train.loop import Validation, train_and_evaluate
from jaxsys.train.setup import make_setup


def _merge(node, overrides) -> None:
  for key, value in overrides.items():
    if hasattr(value, "items"):
      _merge(node[key], value)
    else:
      node[key] = value


def run_config(base, overrides):
  """`base` without the comparison fields, with one run's nested overrides applied."""
  config = copy.deepcopy(base)
  with config.unlocked():
    del config["runs"], config["run_specs"], config["pretrain_steps"]
    del config["continue_schedule"], config["final_eval_batches"]
  _merge(config, overrides)
  if base.continue_schedule and base.pretrain_steps:  # one curve over pretrain + row
    config.optimizer.schedule_steps = base.pretrain_steps + base.total_steps
  return config


def summarize(name: str, config, workdir: str, wall_s: float | None, scored: dict) -> dict:
  """One table row (and the curves for the plot) from a finished run's metrics and final eval."""
  rows = metrics_lib.read_metrics(workdir)
  evals = [r for r in rows if "val_bpb" in r]
  if not evals:
    raise ValueError(f"run {name} in {workdir} has no eval rows; set eval_every > 0")
  run = config_check.parse(config)
  params = jax.eval_shape(lambda: transformer.init_params(run.model, jax.random.key(0)))
  k = outer_lib.num_workers(run.mesh)
  step_bytes = comm_bytes.ring_allreduce_bytes(comm_bytes.tree_bytes(params), k)
  dp_bytes = run.total_steps * step_bytes
  o = run.outer
  outer = replicas_lib.make_outer_optimizer(o)
  final = evals[-1]
  return {"run": name, "method": o.name if o.name != "none" else "data parallel",
          "workers": k, "sync_every": o.sync_every if o.name != "none" else 1,
          "compression": o.compression if o.name == "diloco" else "none",
          "steps": final["step"], "val_bpb": scored["val_bpb"],
          "val_bpb_replica_mean": scored.get("val_bpb_replica_mean"),
          "replica_distance": scored.get("replica_distance"),
          "val_bpb_outer": scored.get("val_bpb_outer"),
          "val_bpb_last_eval": final["val_bpb"],
          "comm_bytes": _between_workers(final), "dp_bytes_same_k": dp_bytes,
          # the most one sync sends (data parallel: every step's gradient all-reduce)
          "peak_bytes_per_sync": outer.peak_bytes_per_sync(params, k) if outer else step_bytes,
          "bytes_reduction": (dp_bytes / _between_workers(final) if _between_workers(final)
                              else None),
          "wall_s": wall_s,
          "curve": [(r["step"], r["val_loss"], _between_workers(r)) for r in evals]}


def _between_workers(row: dict) -> float:
  """Bytes one worker sent to the others: a replica run's outer syncs (`outer_bytes`; its
  replicas' own gradient all-reduces stay inside each worker), data parallel's gradients."""
  return row.get("outer_bytes", row["comm_bytes"])


def final_eval(config, run_dir: str, batches: int) -> dict:
  """val bpb of the run's last checkpoint over its first `batches` val batches (0: all of them).

  Scores replica 0, the model a worker holds (and the one the run's own evals
  scored), and for replica runs also the mean of the replicas, which NoLoCo never
  forms: the gap between the two is what its replicas still disagree on. For Streaming
  DiLoCo also its outer (global) parameters, which every replica holds. Replica runs also
  get the replicas' distance to their mean in parameter space (`replica_distance`). Cached
  in <run_dir>/final_eval.json while the batches and the run's step count are unchanged.
  """
  cache = os.path.join(run_dir, "final_eval.json")
  streaming = config.outer.name == "streaming_diloco"
  if os.path.exists(cache):
    cached = json.load(open(cache))
    if ((cached["batches"], cached["step"]) == (batches, config.total_steps)
        and (not streaming or "val_bpb_outer" in cached)):
      if "val_bpb_replica_mean" in cached and "replica_distance" not in cached:  # older cache
        cached["replica_distance"] = replica_distance(read_params(run_dir, cached["step"]).params)
        with open(cache, "w") as f:
          json.dump(cached, f)
      return cached
  run = config_check.parse(config)
  saved = read_params(run_dir, expect_model=dataclasses.asdict(run.model))
  if saved is None:
    raise ValueError(f"run {run_dir} has no checkpoint to evaluate; set checkpoint_every > 0")
  # The parameters replicated, the batch split over every device.
  val = Validation(run, mesh_lib.make_mesh("data=-1"), workdir=run_dir)
  score = lambda p: val.score(p, batches or 1 << 30)["val_bpb"]
  result = {"batches": batches, "step": saved.step, "val_bpb": score(saved.one())}
  if saved.replicas:
    result["val_bpb_replica_mean"] = score(jax.tree.map(lambda x: x.mean(0), saved.params))
    result["replica_distance"] = replica_distance(saved.params)
  if streaming:  # the global parameters every replica holds (most fragments mid-round)
    outer = read_params(run_dir, saved.step, field=("outer", "anchor"))
    result["val_bpb_outer"] = score(outer.one())
  with open(cache, "w") as f:
    json.dump(result, f)
  return result


def replica_distance(params) -> float:
  """How far R stacked replicas are from their mean: ||p_r - mean|| / ||mean|| over all
  parameters, averaged over r (0 for replicas that just synced to one value)."""
  flat = np.concatenate([np.asarray(x, np.float64).reshape(x.shape[0], -1)
                         for x in jax.tree.leaves(params)], axis=1)
  mean = flat.mean(0)
  return float(np.mean(np.linalg.norm(flat - mean, axis=1)) / np.linalg.norm(mean))


def _fmt_bytes(n: float) -> str:
  for unit in ("B", "KB", "MB", "GB", "TB"):
    if abs(n) < 1000:
      return f"{n:.1f} {unit}"
    n /= 1000
  return f"{n:.1f} PB"


def pretrain(base, workdir: str) -> tuple[str, str]:
  """The shared data-parallel warm start: (its workdir or "", the protocol line for the table)."""
  steps = base.pretrain_steps
  if not steps:
    return "", f"Protocol: every row from scratch, {base.total_steps} inner steps."
  config = run_config(base, {})
  config.total_steps = steps
  config.seed = base.seed + 1  # another data order: the rows do not replay its batches
  run_dir = os.path.join(workdir, "pretrain")
  logging.info("pretraining: data parallel, %d steps in %s", steps, run_dir)
  train_and_evaluate(config, run_dir)
  bpb = f", val bpb {final_eval(config, run_dir, base.final_eval_batches)['val_bpb']:.4f}"
  return run_dir, (f"Protocol: every row starts from one data-parallel run pretrained for {steps} "
                   f"steps ({run_dir}{bpb}), then trains {base.total_steps} more inner steps "
                   "(fresh inner and outer optimizer states, same global batch"
                   + (", the learning-rate curve continued" if base.continue_schedule else
                      ", the learning rate warmed up again") + ").")


def _gap_pct(row: dict, reference: dict) -> float:
  """How much worse `row`'s val bpb is than `reference`'s, in percent."""
  return 100 * (row["val_bpb"] / reference["val_bpb"] - 1)


def write_table(results: list[dict], workdir: str, protocol: str = "") -> str:
  dp = next((r for r in results if r["method"] == "data parallel"), None)
  lines = [protocol, ""] if protocol else []
  lines += ["| run | method | k | H | compression | val bpb | vs DP | replicas' mean bpb | "
            "outer params bpb | bytes sent / worker | x fewer than DP (same k) | "
            "peak bytes / sync | wall s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    rel = f"{_gap_pct(r, dp):+.2f}%" if dp else "-"
    red = f"{r['bytes_reduction']:.1f}x" if r["bytes_reduction"] else "-"
    wall = f"{r['wall_s']:.0f}" if r["wall_s"] else "-"
    mean = f"{r['val_bpb_replica_mean']:.4f}" if r["val_bpb_replica_mean"] else "-"
    outer = f"{r['val_bpb_outer']:.4f}" if r.get("val_bpb_outer") else "-"
    lines.append(f"| {r['run']} | {r['method']} | {r['workers']} | {r['sync_every']} | "
                 f"{r['compression']} | {r['val_bpb']:.4f} | {rel} | {mean} | {outer} | "
                 f"{_fmt_bytes(r['comm_bytes'])} | {red} | "
                 f"{_fmt_bytes(r['peak_bytes_per_sync']) if 'peak_bytes_per_sync' in r else '-'} "
                 f"| {wall} |")
  table = "\n".join(lines) + "\n"
  with open(os.path.join(workdir, "results.md"), "w") as f:
    f.write(table)
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  return table


def plot(results: list[dict], path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
  colors = plt.cm.tab20.colors
  for i, r in enumerate(results):
    steps, loss, comm = zip(*r["curve"])
    style = "-" if r["method"] == "data parallel" else "--" if r["workers"] == 8 else "-."
    kw = dict(color=colors[(2 * i) % 20 + (2 * i) // 20 % 2], label=r["run"])
    a.plot(steps, loss, style, **kw)
    pts = [(c, l) for c, l in zip(comm, loss) if c > 0]
    if pts:
      b.plot(*zip(*pts), style, marker=".", **kw)
  a.set(xlabel="inner step", ylabel="val loss (nats/token)", title="val loss vs step")
  b.set(xlabel="bytes sent per worker", ylabel="val loss (nats/token)", xscale="log",
        title="val loss vs communication")
  b.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def time_sync(config, reps: int) -> dict:
  """Seconds of an inner step alone vs the step that includes the outer sync, in one process.

  DiLoCo/NoLoCo: the step, then the sync program. CO2: the one program that runs the
  sync and the next inner step (its all-reduce is only consumed at the next sync, so
  XLA may overlap it with the step). Interleaved, on random tokens, after compiling
  calls; the median of `reps`. On simulated CPU devices a collective is a memory copy
  inside one process and XLA:CPU runs it synchronously: this shows the sync's compute
  cost, not network overlap.
  """
  run = config_check.check_config(config)
  mesh = mesh_lib.make_mesh(run.mesh)
  model_cfg = run.model
  setup = make_setup(run, mesh)
  b, t = config.data.batch_size, config.data.seq_len
  tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (b, t + 1))
  batch = jax.device_put({
      "inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
      "segment_ids": np.ones((b, t), np.int32),
      "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1)),
      "loss_mask": np.ones((b, t), np.float32)}, setup.batch_sh)
  state = setup.init_state(0)
  state, m = setup.train_fn(state, batch)
  state = setup.sync_fn(state)
  if setup.sync_train_fn is not None:
    state, m = setup.sync_train_fn(state, batch)
  jax.block_until_ready(state)
  plain, synced = [], []
  for _ in range(reps):
    t0 = time.perf_counter()
    state, m = setup.train_fn(state, batch)
    jax.block_until_ready((state, m))
    plain.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    if setup.sync_train_fn is not None:  # CO2: the sync fused into the step that follows it
      state, m = setup.sync_train_fn(state, batch)
    else:
      state, m = setup.train_fn(state, batch)
      state = setup.sync_fn(state)
    jax.block_until_ready((state, m))
    synced.append(time.perf_counter() - t0)
  p, q = float(np.median(plain)), float(np.median(synced))
  return {"step_s": p, "step_with_sync_s": q, "ratio": q / p}


def compare(base, names: list[str], workdir: str) -> tuple[list[dict], str]:
  """Pretrains (if asked), trains or reads back each named row; writes the table and plot."""
  os.makedirs(workdir, exist_ok=True)
  init_from, protocol = pretrain(base, workdir)
  scope = (f"its first {base.final_eval_batches} batches" if base.final_eval_batches else
           "all of it")
  protocol += (f" val bpb: the final parameters (replica 0) on the val split, {scope}; the "
               f"curves: its first {base.eval_steps} batches every {base.eval_every} steps.")
  results = []
  for i, name in enumerate(names):
    config = run_config(base, base.run_specs[name].to_dict())
    config.init_from = init_from
    if base.continue_schedule and init_from:
      config.optimizer.schedule_offset = base.pretrain_steps
    run_dir = os.path.join(workdir, name)
    logging.info("[%d/%d] %s: mesh %s, outer %s, seed %d", i + 1, len(names), name, config.mesh,
                 config.outer.name, config.seed)
    t = time.perf_counter()
    result = train_and_evaluate(config, run_dir)
    wall_file = os.path.join(run_dir, "wall_s.json")
    if "val_bpb" in result:  # trained (or finished) now: keep its wall time for later reads
      with open(wall_file, "w") as f:
        json.dump(time.perf_counter() - t, f)
    wall = json.load(open(wall_file)) if os.path.exists(wall_file) else None
    row = summarize(name, config, run_dir, wall,
                    final_eval(config, run_dir, base.final_eval_batches))
    logging.info("[%d/%d] %s done: val_bpb=%.4f, %s sent per worker, %.0f s", i + 1, len(names),
                 name, row["val_bpb"], _fmt_bytes(row["comm_bytes"]), wall or 0.0)
    results.append(row)
    write_table(results, workdir, protocol)
  table = write_table(results, workdir, protocol)
  plot(results, os.path.join(workdir, "outer_comparison.png"))
  return results, table


def _diloco_reference(row: dict, rows: list[dict]) -> dict | None:
  """The uncompressed DiLoCo row at the same k and H as `row` (None for it or if absent)."""
  if row["method"] in ("data parallel", "diloco"):
    return None
  return next((r for r in rows if r["method"] == "diloco" and r["compression"] == "none"
               and r["workers"] == row["workers"] and r["sync_every"] == row["sync_every"]), None)


def _mean_std(values: list[float], fmt: str) -> str:
  if len(values) < 2:
    return format(values[0], fmt)
  return f"{format(np.mean(values), fmt)} ± {format(np.std(values, ddof=1), fmt.lstrip('+'))}"


def _gap(values: list[float]) -> str:
  """A per-seed gap: its mean and 95% t-interval (one seed: the value)."""
  return stats.paired_interval(values).format() if len(values) > 1 else format(values[0], "+.2f")


def write_seed_table(per_seed: dict[int, list[dict]], workdir: str) -> str:
  """Mean ± sample std over seeds of each row's val bpb, its gaps to DP and to DiLoCo, and
  for replica runs what the replicas disagree on: how far replica 0 scores behind their
  mean, and how far their parameters are from it."""
  seeds = sorted(per_seed)
  gaps = {}  # run -> {"bpb": [...], "dp": [...], "diloco": [...], ...}, one entry per seed
  for s in seeds:
    rows = per_seed[s]
    dp = next((r for r in rows if r["method"] == "data parallel"), None)
    for r in rows:
      g = gaps.setdefault(r["run"], {"row": r, "bpb": [], "dp": [], "diloco": [], "spread": [],
                                     "distance": []})
      g["bpb"].append(r["val_bpb"])
      if r.get("val_bpb_replica_mean"):
        g["spread"].append(100 * (r["val_bpb"] / r["val_bpb_replica_mean"] - 1))
      if r.get("replica_distance") is not None:
        g["distance"].append(r["replica_distance"])
      if dp is not None:
        g["dp"].append(_gap_pct(r, dp))
      ref = _diloco_reference(r, rows)
      if ref is not None:
        g["diloco"].append(_gap_pct(r, ref))
  lines = [f"Mean ± sample std over seeds {', '.join(map(str, seeds))} (each seed: its own "
           "pretrain, data order and init). Gaps are paired: taken per seed, then their mean "
           f"and 95% t-interval over the {len(seeds)} seeds ('indistinguishable' where it "
           "contains 0).", "",
           "| run | k | H | val bpb | vs DP (%) | vs DiLoCo, same k and H (%) | per seed vs DP | "
           "replica 0 vs replicas' mean (%) | replicas' distance to their mean |",
           "|---|---|---|---|---|---|---|---|---|"]
  for run, g in gaps.items():
    r = g["row"]
    vs_dp = _gap(g["dp"]) if g["dp"] and r["method"] != "data parallel" else "-"
    vs_dl = _gap(g["diloco"]) if g["diloco"] else "-"
    per = " / ".join(f"{x:+.2f}" for x in g["dp"]) if r["method"] != "data parallel" else "-"
    spread = _mean_std(g["spread"], "+.2f") if g["spread"] else "-"
    distance = _mean_std(g["distance"], ".5f") if g["distance"] else "-"
    lines.append(f"| {run} | {r['workers']} | {r['sync_every']} | {_mean_std(g['bpb'], '.4f')} | "
                 f"{vs_dp} | {vs_dl} | {per} | {spread} | {distance} |")
  table = "\n".join(lines) + "\n"
  with open(os.path.join(workdir, "results_seeds.md"), "w") as f:
    f.write(table)
  with open(os.path.join(workdir, "results_seeds.json"), "w") as f:
    json.dump({run: {k: v for k, v in g.items() if k != "row"} for run, g in gaps.items()}, f,
              indent=1)
  return table


def run(base, names: list[str], workdir: str, seeds: list[int] | None, time_runs: list[str],
        time_reps: int) -> tuple[str, str]:
  """The comparison (under each of `seeds` in workdir/seed<N>, with the seed table), then the
  sync cost of the `time_runs` among `base.runs`; (the table, the results file holding it)."""
  if seeds is None:
    _, table = compare(base, names, workdir)
  else:
    per_seed = {}
    for s in seeds:
      seeded = copy.deepcopy(base)
      seeded.seed = s
      logging.info("seed %d of %s: %s", s, seeds, os.path.join(workdir, f"seed{s}"))
      per_seed[s], _ = compare(seeded, names, os.path.join(workdir, f"seed{s}"))
    table = write_seed_table(per_seed, workdir)
  timing = {}
  for name in [n for n in time_runs if n in base.runs.split(",")]:
    timing[name] = time_sync(run_config(base, base.run_specs[name].to_dict()), time_reps)
    logging.info("sync cost %s: step %.3f s, step + sync %.3f s (x%.3f)", name,
                 timing[name]["step_s"], timing[name]["step_with_sync_s"], timing[name]["ratio"])
  results_md = os.path.join(workdir, "results.md" if seeds is None else "results_seeds.md")
  if timing:
    lines = ["| run | inner step s | step + sync s | ratio |", "|---|---|---|---|"]
    lines += [f"| {n} | {t['step_s']:.3f} | {t['step_with_sync_s']:.3f} | {t['ratio']:.3f} |"
              for n, t in timing.items()]
    table += "\n" + "\n".join(lines) + "\n"
    with open(results_md, "w") as f:
      f.write(table)
    with open(os.path.join(workdir, "sync_timing.json"), "w") as f:
      json.dump(timing, f, indent=1)
  return table, results_md
