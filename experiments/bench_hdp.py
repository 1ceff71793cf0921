r"""Hybrid Data Parallelism (HDP) against a static context-parallel mesh.

  python -m experiments.bench_hdp --part=sim --chart=docs/hdp_sim.png
  python -m experiments.bench_hdp --part=real

--part=real: one training step per global batch of whole stdlib documents on 8
simulated devices, laid out by HDP, by a static mesh padding each document to its ring,
and by a static mesh packing them, through the same executor (experiments/hdp_real.py);
it prints micro-steps, padding waste, per-micro-step imbalance and step time.
(The script sets 8 simulated CPU devices itself when XLA_FLAGS does not name a count.)

--part=sim: the cost-model simulation (jaxsys/parallel/hdp_sim.py) at 8..1024 devices.
The compute rates are fitted on this machine's CPU (attention impl="xla" and a matmul,
about 10 s); each global batch holds devices * tokens_per_device * batch_steps tokens
drawn from one length distribution (the stdlib's byte lengths, or a long tail shaped
like ByteScale's data); every seed draws another batch. Two settings:
  cpu:   the fitted CPU rates, --link_gbps (default 100 GB/s, NVLink-class) links;
  accel: the same rates scaled so the matmuls run at --accel_tflops (attention keeps its
         fitted cost relative to the matmuls), --accel_link_gbps links (default 25 GB/s,
         a 200 Gb/s InfiniBand port): an accelerator where ring traffic is not free.
The headline HDP is per-rank (jaxsys/parallel/hdp_schedule.py, timed as
jaxsys/train/hdp_step.py's PerRankHDPStep runs it: each ring one program on its block,
every device its own local micro-batches, only the gradient all-reduce waiting for all),
its rings widened where the simulator's own time estimate, link time included, says they
end sooner (hdp_sim.ScheduleCost); beside it the same schedule with tight rings
(widen=False, training's default).
Lock-step HDP (hdp.plan, every micro-step one program over all devices) is timed beside
it two ways: as ByteScale runs a ring ("ideal": only ring members move K/V) and as
jaxsys's lock-step executor does (each micro-step one program over its largest ring's
view, so every device joins that ring's hops). It prints a markdown table (median [min,
max] over seeds) and draws the chart.
"""
from __future__ import annotations

from jaxsys import xla_flags

xla_flags.default_cpu_devices(8)

import dataclasses
import json
import time

import numpy as np
from absl import app, flags

from experiments import hdp_real
from jaxsys.parallel import hdp, hdp_sim

PARTS = ("sim", "real")
DISTRIBUTIONS = ("long_tail", "stdlib")


def _define_flags() -> None:
  """Defines the flags: only when this file runs as a script, so tests can import it
  beside other benchmarks (absl refuses a flag name defined twice in one process)."""
  global _PART, _DEVICES, _SEEDS, _TPD, _BATCH_STEPS, _FILL, _MAX_LEN, _LINK, _ACCEL_TFLOPS, \
         _ACCEL_LINK, _CHART, _OUT, _REAL_SIZE, _REAL_TPD, _REAL_MAX_LEN, _REAL_BATCH_STEPS, \
         _REAL_BATCHES
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
  _LINK = flags.DEFINE_float("link_gbps", 100.0, "cpu setting: link GB/s per direction.")
  _ACCEL_TFLOPS = flags.DEFINE_float("accel_tflops", 400.0, "accel setting: matmul TFLOP/s.")
  _ACCEL_LINK = flags.DEFINE_float("accel_link_gbps", 25.0, "accel setting: link GB/s.")
  _CHART = flags.DEFINE_string("chart", "", "Write the speed-up chart here (PNG).")
  _OUT = flags.DEFINE_string("out", "", "Write every number here (JSON).")
  _REAL_SIZE = flags.DEFINE_string("real_size", "tiny", "real: configs/tiny_lm.py model size.")
  _REAL_TPD = flags.DEFINE_integer("real_tokens_per_device", 1024, "real: tokens per device.")
  _REAL_MAX_LEN = flags.DEFINE_integer("real_max_len", 8192, "real: data.max_len (truncated).")
  _REAL_BATCH_STEPS = flags.DEFINE_integer("real_batch_steps", 8,
                                           "real: global batch = 8 * tpd * this tokens.")
  _REAL_BATCHES = flags.DEFINE_integer("real_batches", 3, "real: timed global batches.")


def settings(fit: hdp_sim.Fit, *, link_gbps: float, accel_tflops: float,
             accel_link_gbps: float) -> dict:
  """The two simulated machines, by name (see the module docstring)."""
  cpu = dataclasses.replace(fit.model, link_bytes_per_s=link_gbps * 1e9)
  speedup = accel_tflops * 1e12 * fit.model.sec_per_linear_flop
  accel = dataclasses.replace(cpu.scaled(speedup), link_bytes_per_s=accel_link_gbps * 1e9)
  return {"cpu": cpu, "accel": accel}


def length_pool(name: str, max_len: int) -> np.ndarray:
  """Lengths a batch is drawn from: the stdlib's, or 200,000 long-tail samples."""
  if name == "stdlib":
    return hdp_sim.stdlib_lengths(max_len)
  if name == "long_tail":
    return hdp_sim.long_tail_lengths(200_000, seed=1234, max_len=max_len)
  raise ValueError(f"distribution={name!r}: must be one of {DISTRIBUTIONS}")


def run_sim(models: dict, *, devices, seeds: int, tokens_per_device: int, batch_steps: int,
            max_len: int, distributions=DISTRIBUTIONS, fill: float = 0.95) -> list[dict]:
  """One row per (distribution, N, setting, seed): times relative to the lower bound."""
  rows = []
  for dist in distributions:
    pool = length_pool(dist, max_len)
    for n in devices:
      for seed in range(seeds):
        lengths = hdp_sim.sample_batch(pool, int(fill * n * tokens_per_device * batch_steps),
                                       seed)
        for setting, model in models.items():
          r = hdp_sim.simulate(lengths, num_devices=n, tokens_per_device=tokens_per_device,
                               model=model, max_len=max_len, seed=seed)
          bound, h, pr = r["bound"], r["hdp"], r["hdp_per_rank"]
          # Tight rings (widen=False): what training runs by default, its FLOP estimate
          # knowing no link speed.
          tight = hdp_sim.simulate_per_rank(lengths, num_devices=n,
                                            tokens_per_device=tokens_per_device,
                                            model=model, widen=False)
          rows.append(dict(
              distribution=dist, devices=n, setting=setting, seed=seed,
              sequences=int(lengths.size), tokens=int(lengths.sum()),
              min_steps=hdp.min_steps(lengths, num_devices=n,
                                      tokens_per_device=tokens_per_device),
              **{f"{k}_{f}": getattr(r[k], f)
                 for k in ("hdp_per_rank", "hdp", "hdp_step_ring", "static_loader",
                           "static_sorted", "static_padded")
                 for f in ("time", "steps", "imbalance", "padding")},
              **{f"tight_{f}": getattr(tight, f)
                 for f in ("time", "steps", "imbalance", "padding")},
              bound=bound,
              per_rank_speedup_loader=r["static_loader"].time / pr.time,
              per_rank_speedup_sorted=r["static_sorted"].time / pr.time,
              per_rank_speedup_padded=r["static_padded"].time / pr.time,
              per_rank_over_bound=pr.time / bound,
              static_over_bound=r["static_loader"].time / bound,
              tight_speedup_loader=r["static_loader"].time / tight.time,
              tight_over_bound=tight.time / bound,
              speedup_loader=r["static_loader"].time / h.time,
              speedup_sorted=r["static_sorted"].time / h.time,
              speedup_padded=r["static_padded"].time / h.time,
              speedup_step_ring=r["static_loader"].time / r["hdp_step_ring"].time,
              hdp_over_bound=h.time / bound,
              lockstep_bound=r["lockstep_bound"],
              lockstep_over_bound=r["lockstep_bound"] / bound))
  return rows


def _spread(values) -> str:
  """median [min, max]"""
  v = np.asarray(values)
  return f"{np.median(v):.2f} [{v.min():.2f}, {v.max():.2f}]"


def _median(values) -> str:
  return f"{np.median(values):.2f}"


def sim_table(rows: list[dict]) -> str:
  """Markdown: one line per (distribution, setting, N), spread over seeds; per-rank HDP
  first (widened, then tight rings), lock-step HDP after it."""
  head = ("| distribution | setting | N | sequences | per-rank HDP speed-up vs static, "
          "loader order | static / bound (the most any schedule gains) | vs static, "
          "cost-sorted / padded | per-rank HDP / bound | "
          "per-rank micro-batches (most on a device) / padding | tight rings vs static, "
          "loader | tight rings / bound | lock-step HDP vs static, loader | lock-step "
          "jaxsys executor vs static, loader | lock-step HDP / bound | lock-step bound / "
          "bound | imbalance per-rank / lock-step | padding lock-step / static |\n"
          "|---|---|---:|---:|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  lines = [head]
  keys = sorted({(r["distribution"], r["setting"], r["devices"]) for r in rows},
                key=lambda k: (DISTRIBUTIONS.index(k[0]) if k[0] in DISTRIBUTIONS else 9,
                               k[1], k[2]))
  for dist, setting, n in keys:
    rs = [r for r in rows if (r["distribution"], r["setting"], r["devices"]) == (dist, setting, n)]
    col = lambda k: [r[k] for r in rs]
    mean = lambda k, digits: f"{np.mean(col(k)):.{digits}f}"
    lines.append(
        f"| {dist} | {setting} | {n} | {mean('sequences', 0)} | "
        f"{_spread(col('per_rank_speedup_loader'))} | "
        f"{_spread(col('static_over_bound'))} | "
        f"{_median(col('per_rank_speedup_sorted'))} / "
        f"{_median(col('per_rank_speedup_padded'))} | "
        f"{_spread(col('per_rank_over_bound'))} | "
        f"{mean('hdp_per_rank_steps', 1)} / {mean('hdp_per_rank_padding', 2)} | "
        f"{_spread(col('tight_speedup_loader'))} | {_spread(col('tight_over_bound'))} | "
        f"{_spread(col('speedup_loader'))} | "
        f"{_spread(col('speedup_step_ring'))} | {_spread(col('hdp_over_bound'))} | "
        f"{_spread(col('lockstep_over_bound'))} | "
        f"{mean('hdp_per_rank_imbalance', 2)} / {mean('hdp_imbalance', 2)} | "
        f"{mean('hdp_padding', 2)} / {mean('static_loader_padding', 2)} |")
  return "\n".join(lines)


def plot_sim(rows: list[dict], path: str | None = None, *, setting: str | None = None):
  """Speed-up over static CP and time over the bound against N, per-rank HDP (circles,
  with its seeds' range shaded) beside lock-step HDP (squares); returns the figure."""
  import matplotlib
  if path:
    matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
  styles = {"cpu": "-", "accel": "--"}
  colors = {"long_tail": "tab:red", "stdlib": "tab:blue"}
  lines = {ax1: (("per_rank_speedup_loader", "o", "per-rank HDP"),
                 ("speedup_loader", "s", "lock-step HDP")),
           ax2: (("per_rank_over_bound", "o", "per-rank HDP"),
                 ("hdp_over_bound", "s", "lock-step HDP"),
                 ("lockstep_over_bound", "^", "lock-step bound"))}
  for (dist, st) in sorted({(r["distribution"], r["setting"]) for r in rows}):
    if setting and st != setting:
      continue
    ns = sorted({r["devices"] for r in rows if r["distribution"] == dist})
    for ax, keys in lines.items():
      for k, (key, marker, what) in enumerate(keys):
        vals = [[r[key] for r in rows if (r["distribution"], r["setting"], r["devices"]) ==
                 (dist, st, n)] for n in ns]
        ax.plot(ns, [np.median(v) for v in vals], styles.get(st, ":") if k == 0 else ":",
                color=colors.get(dist), marker=marker, alpha=1.0 if k == 0 else 0.5,
                markersize=5 if k == 0 else 4, label=f"{what}, {dist}, {st}")
        if k == 0:
          ax.fill_between(ns, [min(v) for v in vals], [max(v) for v in vals],
                          color=colors.get(dist), alpha=0.15)
  for ax in (ax1, ax2):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices N")
    ax.grid(alpha=0.3)
  ax1.axhline(2.0, color="gray", lw=0.8)
  ax1.set_ylabel("static CP (packed, loader order) time / HDP time")
  ax1.set_title("HDP speed-up over a static data x context mesh")
  ax1.legend(fontsize=6)
  ax2.axhline(1.3, color="gray", lw=0.8)
  ax2.set_ylabel("time / lower bound")
  ax2.set_title("per-rank HDP (o), lock-step HDP (s), lock-step bound (^)")
  ax2.legend(fontsize=6)
  fig.tight_layout()
  if path:
    fig.savefig(path, dpi=110)
  return fig


def bar_segments(steps, lengths, *, num_devices: int, tokens_per_device: int,
                 model: hdp_sim.CostModel):
  """Per micro-step: (sequence index, device ids, seconds on each) bars to draw.

  steps: per micro-step, (sequence indices run together, device ids) groups (an hdp.plan
  entry's index wrapped in a list, or a static_plan row). A ring's time is split among
  its sequences in proportion to their compute; single-device sequences count real
  tokens only, so padding shows as the gap before the step's end.
  """
  lengths = np.asarray(lengths, np.int64)
  out = []
  for step in steps:
    bars = []
    for idx, devs in step:
      own = [float(3.0 * model.n_layers * (model.attention(lengths[i])
                                           + model.linear(lengths[i]))) for i in idx]
      if len(devs) > 1:
        total = hdp_sim.group_time(model, lengths[idx], len(devs), tokens_per_device)
        own = [total * o / sum(own) for o in own]
      bars.extend((i, devs, o) for i, o in zip(idx, own))
    out.append(bars)
  return out


def draw_plan(ax, steps, lengths, *, num_devices: int, tokens_per_device: int,
              model: hdp_sim.CostModel, title: str) -> float:
  """Device-by-time chart; each micro-step's column is as wide as its slowest device.

  A colour per sequence; heavy sequences (longer than tpd, so they need a ring) hatched,
  light ones plain; white is idle time or padding. Returns the plan's seconds.
  """
  import matplotlib.pyplot as plt

  lengths = np.asarray(lengths, np.int64)
  cmap = plt.get_cmap("tab20")
  bars = bar_segments(steps, lengths, num_devices=num_devices,
                      tokens_per_device=tokens_per_device, model=model)
  # Column widths are the simulator's step times (padding compute included).
  times = hdp_sim.device_times([[(lengths[idx].tolist(), devs) for idx, devs in step]
                                for step in steps], num_devices=num_devices,
                               tokens_per_device=tokens_per_device, model=model)
  t0 = 0.0
  for m, step in enumerate(bars):
    used = np.zeros(num_devices)
    for i, devs, secs in step:
      heavy = lengths[i] > tokens_per_device
      for d in devs:
        ax.barh(d, secs, left=t0 + used[d], height=0.8, color=cmap(i % 20),
                hatch="///" if heavy else None, edgecolor="black", linewidth=0.3)
        used[d] += secs
    t0 += float(times[m].max(initial=0.0))
    ax.axvline(t0, color="black", lw=1.2)
  ax.set_yticks(range(num_devices))
  ax.set_ylabel("device")
  ax.set_xlabel("simulated seconds (black lines: micro-step ends)")
  ax.set_title(f"{title}: {len(bars)} micro-steps, {t0:.3g} s")
  ax.invert_yaxis()
  return t0


def draw_schedule(ax, sched, lengths, *, tokens_per_device: int, model: hdp_sim.CostModel,
                  title: str) -> float:
  """Device-by-time chart of a per-rank schedule (hdp_schedule.schedule), timed by
  hdp_sim.schedule_jobs: each ring or local micro-batch a run of bars on its devices.

  Colours and hatching as draw_plan; a member's busy time is split among the sequences
  in its cell by their compute; white is idle time (a ring member waiting for its
  slowest) or padding. A tick closes each micro-batch; the black line is the gradient
  all-reduce, when the slowest device is done. Returns the schedule's seconds.
  """
  import matplotlib.pyplot as plt

  lengths = np.asarray(lengths, np.int64)
  cmap = plt.get_cmap("tab20")
  jobs = hdp_sim.schedule_jobs(sched, lengths, tokens_per_device=tokens_per_device,
                               model=model)
  for job in jobs:
    c = len(job.devices)
    for k, d in enumerate(job.devices):
      mine = [(i, len(rel)) for i, rel in job.entries if len(rel) == c or rel == (k,)]
      own = [float(model.attention(lengths[i]) / ring + model.linear(lengths[i] / ring))
             for i, ring in mine]
      left = job.start
      for (i, _), o in zip(mine, own):
        secs = float(job.busy[k]) * o / sum(own)
        ax.barh(d, secs, left=left, height=0.8, color=cmap(i % 20),
                hatch="///" if lengths[i] > tokens_per_device else None,
                edgecolor="black", linewidth=0.3)
        left += secs
      ax.plot([job.end, job.end], [d - 0.45, d + 0.45], color="black", lw=0.8)
  end = max((job.end for job in jobs), default=0.0)
  ax.axvline(end, color="black", lw=1.2)
  ax.set_yticks(range(sched.num_devices))
  ax.set_ylabel("device")
  ax.set_xlabel("simulated seconds (ticks: micro-batch ends; line: gradient all-reduce)")
  ax.set_title(f"{title}: {len(sched.rings)} rings, "
               f"{sum(len(b) for b in sched.local)} local micro-batches, {end:.3g} s")
  ax.invert_yaxis()
  return end


def sim_part(argv_devices, *, seeds, tokens_per_device, batch_steps, max_len, link_gbps,
             accel_tflops, accel_link_gbps, chart, out, distributions=DISTRIBUTIONS,
             fit_kwargs=None, fill: float = 0.95) -> dict:
  """The --part=sim benchmark: fit, simulate, print the table, draw, save."""
  start = time.perf_counter()
  fit = hdp_sim.fit_cost_model(**(fit_kwargs or {}))
  print(f"fitted on this CPU: {fit.model.sec_per_attention_flop:.3e} s per attention FLOP "
        f"(R^2 {fit.attention_r2:.4f}), {fit.model.sec_per_linear_flop:.3e} s per linear "
        f"FLOP (R^2 {fit.linear_r2:.4f}); fit took {time.perf_counter() - start:.1f} s")
  models = settings(fit, link_gbps=link_gbps, accel_tflops=accel_tflops,
                    accel_link_gbps=accel_link_gbps)
  rows = run_sim(models, devices=argv_devices, seeds=seeds,
                 tokens_per_device=tokens_per_device, batch_steps=batch_steps,
                 max_len=max_len, distributions=distributions, fill=fill)
  print(sim_table(rows))
  print(f"total {time.perf_counter() - start:.1f} s")
  if chart:
    plot_sim(rows, chart)
  result = dict(fit=dict(attention_r2=fit.attention_r2, linear_r2=fit.linear_r2,
                         models={k: dataclasses.asdict(m) for k, m in models.items()}),
                rows=rows)
  if out:
    with open(out, "w") as f:
      json.dump(result, f, indent=1, default=float)
  return result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  devices = []
  for v in _DEVICES.value:
    n = int(v)
    if n < 1 or n & (n - 1):
      raise app.UsageError(f"--devices: {v} is not a power of two")
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
             accel_link_gbps=_ACCEL_LINK.value, chart=_CHART.value, out=_OUT.value,
             fill=_FILL.value)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
