"""HDP against static context-parallel meshes, simulated: the library of
`experiments/bench_hdp.py --part=sim` and `colab/hdp.ipynb`.

The cost-model simulation of `experiments/bench_hdp.py --part=sim` (jaxsys/parallel/hdp_sim.py) at 8..1024 devices,
every collective counted as jaxsys's executors compile them (compiled=True). The compute
rates are fitted on this machine's CPU (attention impl="xla" and a matmul, about 10 s),
or given (--rates, e.g. those experiments/hdp_calibrate fitted and checked against a
measured ring step); each global batch holds devices * tokens_per_device * batch_steps *
fill tokens drawn from one length distribution (the stdlib's byte lengths, or a long
tail shaped like ByteScale's data); every seed draws another batch. The simulated model
is 7B-class (d 4096, 32 layers, bf16, cost.dense_params: 6.70B parameters MHA, 5.90B
GQA) with its K/V as MHA (kv_dim 4096) or GQA (8 K/V heads of 128: kv_dim 1024). The
machines:
  cpu:   the fitted CPU rates, --link_gbps (default 100 GB/s) links (0: left out);
  accel@<GB/s>: the same rates scaled so the matmuls run at --accel_tflops, attention
         keeping its fitted cost relative to the matmuls (or each of --attention_ratios),
         one setting per --accel_link_gbps (default 25, 100, 450 GB/s: a 200 Gb/s
         InfiniBand port, a 800 Gb/s one, NVLink-class).
A link figure is one direction of one device's link, for ring hops and all-reduces alike.
HDP is per-rank (jaxsys/parallel/hdp_schedule.py balancing the simulator's own estimate,
hdp_sim.ScheduleCost, its rings widened where that ends sooner; timed as
jaxsys/train/hdp_step.py's HDPStep runs it). The static baselines:
  - one data x context mesh (rings of c_max, for the longest sequence) on FFD-packed rows,
    dealt three ways (lock-step, per-group accumulation, longest processing time first:
    hdp_sim.STATIC_SCHEDULES); "best static mesh" is the best of the three per batch;
  - two-pool: rings of c_max only for sequences over tokens_per_device, plain data
    parallelism (no context parallelism) for the rest, token-packed rows dealt LPT;
  - balanced: the same pools, the short sequences packed by cost over the data-parallel
    devices (Zeppelin-style); both two-pool layouts split the devices per batch
    (hdp_sim.simulate_two_pool);
"strongest" is the fastest of all of them per batch. Beside HDP (in --out's JSON, the
last column of the table): tight rings (widen=False, training's default), a schedule
planned without the rings' own all-reduces ("blind"), and an executor that does not
exist yet with one all-reduce a step ("once", hdp_sim.ALLREDUCES); --per_rank picks which.
It prints a markdown table (median [min, max] over seeds) and draws the chart.
With --tensor=t (and --fsdp=f) the model is sharded: the N devices are N/t slots, each a
tensor group of t (its activation all-reduces on --tensor_link_gbps links), the
parameters sharded over f slots (-1: all of them; ZeRO across HDP ranks) and gathered once
a step; HDP plans the slots, each holding --tokens_per_device tokens, and a batch holds
N/t * tokens_per_device * batch_steps * fill tokens. The static meshes get the same slots.
"""
from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from jaxsys.parallel import cost, hdp_sim

DISTRIBUTIONS = ("long_tail", "stdlib")

# The simulated K/V widths: MHA (32 heads of 128) and GQA (8 K/V heads of 128).
ATTENTIONS = {"MHA": 4096, "GQA": 1024}


def settings(fit: hdp_sim.Fit, *, link_gbps: float, accel_tflops: float,
             accel_link_gbps, attention_ratios=()) -> dict:
  """The simulated machines, by name (see the module docstring), their collectives as the
  executors compile them, all-reducing the MHA model's gradients: "cpu" (unless link_gbps
  is 0) and one "accel@<GB/s>" per accel link (a float: one, named "accel"), each once per
  attention ratio ("accel@<GB/s>,r<ratio>"; none: the fitted ratio, unnamed)."""
  model = dataclasses.replace(fit.model, compiled=True)
  cpu = with_attention(dataclasses.replace(model, link_bytes_per_s=(link_gbps or 1) * 1e9),
                       model.kv_dim)
  speedup = accel_tflops * 1e12 * fit.model.sec_per_linear_flop
  accel = cpu.scaled(speedup)
  out = {"cpu": cpu} if link_gbps else {}
  links = [accel_link_gbps] if isinstance(accel_link_gbps, (int, float)) else accel_link_gbps
  for gbps in links:
    for ratio in attention_ratios or [None]:
      name = "accel" if isinstance(accel_link_gbps, (int, float)) else f"accel@{float(gbps):g}"
      m = dataclasses.replace(accel, link_bytes_per_s=float(gbps) * 1e9)
      if ratio is not None:
        name += f",r{float(ratio):g}"
        m = dataclasses.replace(m, sec_per_attention_flop=float(ratio) * m.sec_per_linear_flop)
      out[name] = m
  return out


def fixed_fit(sec_per_attention_flop: float, sec_per_linear_flop: float) -> hdp_sim.Fit:
  """A Fit of given rates (no timing), e.g. those experiments/hdp_calibrate fitted."""
  return hdp_sim.Fit(cost.CostModel(sec_per_attention_flop=sec_per_attention_flop,
                                       sec_per_linear_flop=sec_per_linear_flop),
                     float("nan"), float("nan"), {})


def with_attention(model: cost.CostModel, kv_dim: int) -> cost.CostModel:
  """`model` with K/V `kv_dim` wide, all-reducing that model's parameters."""
  return dataclasses.replace(model, kv_dim=kv_dim, params=cost.dense_params(
      model.d_model, model.n_layers, kv_dim))


def length_pool(name: str, max_len: int) -> np.ndarray:
  """Lengths a batch is drawn from: the stdlib's, or 200,000 long-tail samples."""
  if name == "stdlib":
    return hdp_sim.stdlib_lengths(max_len)
  if name == "long_tail":
    return hdp_sim.long_tail_lengths(200_000, seed=1234, max_len=max_len)
  raise ValueError(f"distribution={name!r}: must be one of {DISTRIBUTIONS}")


# Per-rank HDP variants: (row key, simulate_per_rank arguments). "blind" plans with an
# estimate that leaves out a ring's own all-reduce (as ScheduleCost did before it counted
# them) and is timed with it; the table leaves it out, the JSON keeps it.
PER_RANK = (("hdp", {}), ("tight", dict(widen=False)), ("blind", dict(estimate="once")),
            ("once", dict(allreduce="once")))


# The two-pool static layouts (hdp_sim.simulate_two_pool): rings of c_max for sequences
# over tpd only, plain data parallelism for the rest, packed by tokens or by cost.
POOLS = (("two_pool", "rows"), ("balanced", "cost"))
STATICS = tuple(f"static_{s}" for s in hdp_sim.STATIC_SCHEDULES) + tuple(k for k, _ in POOLS)


def simulate_batch(lengths, *, num_devices: int, tokens_per_device: int,
                   model: cost.CostModel, max_len: int, seed: int,
                   per_rank=None) -> dict:
  """Seconds of every strategy on one batch, by row key (see PER_RANK, POOLS and
  hdp_sim.STATIC_SCHEDULES), the lower bound, per-rank HDP's steps and padding, and the
  rings each two-pool layout chose. per_rank: PER_RANK keys to time (default all)."""
  kw = dict(num_devices=num_devices, tokens_per_device=tokens_per_device, model=model)
  out = {f"static_{s}": hdp_sim.simulate_static(lengths, max_len=max_len, schedule=s,
                                                seed=seed, **kw).time
         for s in hdp_sim.STATIC_SCHEDULES}
  for key, balance in POOLS:
    result = hdp_sim.simulate_two_pool(lengths, max_len=max_len, balance=balance, **kw)
    out[key], out[f"{key}_rings"] = result.time, result.layout["rings"]
  for key, args in PER_RANK:
    if per_rank is not None and key != "hdp" and key not in per_rank:
      continue
    result = hdp_sim.simulate_per_rank(lengths, **args, **kw)
    out[key] = result.time
    if key == "hdp":
      out.update(hdp_steps=result.steps, hdp_padding=result.padding)
  out["bound"] = hdp_sim.lower_bound(lengths, **kw)
  return out


def _ratios(t: dict) -> dict:
  """The table's ratios of one batch's times: speed-ups over the best static mesh (the
  best of the one mesh's three schedules), over each two-pool layout, and over the
  strongest of all of them."""
  statics = {s: t[f"static_{s}"] for s in hdp_sim.STATIC_SCHEDULES}
  best = min(statics, key=statics.get)
  strongest = min(STATICS, key=lambda k: t[k])
  out = dict(best_static=best, best_static_time=statics[best],
             static_over_bound=statics[best] / t["bound"], hdp_over_bound=t["hdp"] / t["bound"],
             strongest=strongest, strongest_time=t[strongest],
             strongest_over_bound=t[strongest] / t["bound"],
             vs_strongest=t[strongest] / t["hdp"])
  out.update({f"{key}_speedup": statics[best] / t[key] for key, _ in PER_RANK if key in t})
  out.update({f"speedup_{s}": statics[s] / t["hdp"] for s in statics})
  out.update({f"vs_{key}": t[key] / t["hdp"] for key, _ in POOLS})
  if "once" in t:
    out["once_vs_strongest"] = t[strongest] / t["once"]
  return out


def sharded(model: cost.CostModel, *, tensor: int, fsdp: int, slots: int,
            tensor_link_gbps: float) -> cost.CostModel:
  """`model` on slots that are tensor groups of `tensor`, sharded over `fsdp` slots (-1:
  all `slots`); unchanged when both are 1."""
  if tensor == 1 and fsdp == 1:
    return model
  return dataclasses.replace(model, tensor=tensor, fsdp=slots if fsdp == -1 else fsdp,
                             tensor_link_bytes_per_s=tensor_link_gbps * 1e9)


def run_sim(models: dict, *, devices, seeds: int, tokens_per_device: int, batch_steps: int,
            max_len: int, distributions=DISTRIBUTIONS, fill: float = 0.95,
            attentions=None, tensor: int = 1, fsdp: int = 1,
            tensor_link_gbps: float = 100.0, per_rank=None) -> list[dict]:
  """One row per (distribution, N, setting, attention, seed): each strategy's seconds and
  HDP's speed-ups over the static meshes (see `_ratios`). attentions: {name: kv_dim},
  default ATTENTIONS. tensor, fsdp: the N devices as N / tensor slots (see `sharded`)."""
  rows = []
  for dist in distributions:
    pool = length_pool(dist, max_len)
    for n in devices:
      slots = n // tensor
      for seed in range(seeds):
        lengths = hdp_sim.sample_batch(
            pool, int(fill * slots * tokens_per_device * batch_steps), seed)
        for setting, model in models.items():
          for attention, kv_dim in (attentions or ATTENTIONS).items():
            split = sharded(with_attention(model, kv_dim), tensor=tensor, fsdp=fsdp,
                            slots=slots, tensor_link_gbps=tensor_link_gbps)
            times = simulate_batch(lengths, num_devices=slots,
                                   tokens_per_device=tokens_per_device, model=split,
                                   max_len=max_len, seed=seed, per_rank=per_rank)
            rows.append(dict(distribution=dist, devices=n, setting=setting,
                             link_gbps=split.link_bytes_per_s / 1e9,
                             attention_ratio=split.sec_per_attention_flop
                             / split.sec_per_linear_flop,
                             attention=attention, seed=seed, sequences=int(lengths.size),
                             tokens=int(lengths.sum()), tensor=split.tensor, fsdp=split.fsdp,
                             **times, **_ratios(times)))
  return rows


def _spread(values) -> str:
  """median [min, max]"""
  v = np.asarray(values)
  return f"{np.median(v):.2f} [{v.min():.2f}, {v.max():.2f}]"


def _median(values) -> str:
  return f"{np.median(values):.2f}"


def _wins(names) -> str:
  """How often each static mesh was the best, e.g. "lpt 4, groups 1"."""
  counts = {name: list(names).count(name) for name in dict.fromkeys(names)}
  return ", ".join(f"{name} {k}" for name, k in sorted(counts.items(), key=lambda c: -c[1]))


def _keys(rows):
  """(distribution, setting, attention, N) of the rows, in the table's order (settings by
  link speed, then attention ratio)."""
  speed = {r["setting"]: (r.get("link_gbps", 0), r.get("attention_ratio", 0)) for r in rows}
  order = lambda k: (DISTRIBUTIONS.index(k[0]) if k[0] in DISTRIBUTIONS else 9,
                     k[1] != "cpu", speed[k[1]], k[1],
                     list(ATTENTIONS).index(k[2]) if k[2] in ATTENTIONS else 9, k[3])
  return sorted({(r["distribution"], r["setting"], r["attention"], r["devices"]) for r in rows},
                key=order)


def sim_table(rows: list[dict]) -> str:
  """Markdown: one line per (distribution, setting, attention, N), spread over seeds:
  per-rank HDP's speed-up over each static baseline and the strongest of them."""
  lines = ["| distribution | setting | link GB/s | attention / matmul FLOP | K/V | N | "
           "HDP vs best static mesh | HDP vs two-pool | HDP vs balanced | HDP vs strongest "
           "static | strongest (batches) | strongest / bound | HDP / bound | one all-reduce "
           "vs strongest |",
           "|---|---|---:|---:|---|---:|---|---|---|---|---|---|---|---|"]
  for key in _keys(rows):
    rs = [r for r in rows if (r["distribution"], r["setting"], r["attention"], r["devices"])
          == key]
    col = lambda k: [r[k] for r in rs]
    once = _spread(col("once_vs_strongest")) if all("once_vs_strongest" in r for r in rs) \
        else "-"
    lines.append(
        f"| {key[0]} | {key[1]} | {rs[0]['link_gbps']:g} | {rs[0]['attention_ratio']:.2f} | "
        f"{key[2]} | {key[3]} | {_spread(col('hdp_speedup'))} | {_spread(col('vs_two_pool'))} | "
        f"{_spread(col('vs_balanced'))} | {_spread(col('vs_strongest'))} | "
        f"{_wins(col('strongest'))} | {_spread(col('strongest_over_bound'))} | "
        f"{_spread(col('hdp_over_bound'))} | {once} |")
  return "\n".join(lines)


def plot_sim(rows: list[dict], path: str | None = None, *, setting: str | None = None):
  """Per-rank HDP's speed-up over the best static mesh (its seeds' range shaded), and
  both over the lower bound, against N; returns the figure."""
  import matplotlib
  if path:
    matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
  colors = {("cpu", "MHA"): "tab:blue", ("cpu", "GQA"): "tab:cyan",
            ("accel", "MHA"): "tab:red", ("accel", "GQA"): "tab:orange"}
  styles = {"long_tail": "-", "stdlib": "--"}
  for dist, st, attention in sorted({k[:3] for k in _keys(rows)}):
    if setting and st != setting:
      continue
    ns = sorted({r["devices"] for r in rows if r["distribution"] == dist})
    vals = lambda key: [[r[key] for r in rows if (r["distribution"], r["setting"],
                                                  r["attention"], r["devices"])
                         == (dist, st, attention, n)] for n in ns]
    color, style = colors.get((st, attention)), styles.get(dist, ":")
    label = f"{dist}, {st}, {attention}"
    speedup = vals("hdp_speedup")
    ax1.plot(ns, [np.median(v) for v in speedup], style, color=color, marker="o",
             markersize=4, label=label)
    ax1.fill_between(ns, [min(v) for v in speedup], [max(v) for v in speedup], color=color,
                     alpha=0.12)
    ax2.plot(ns, [np.median(v) for v in vals("hdp_over_bound")], style, color=color,
             marker="o", markersize=4, label=f"HDP, {label}")
    ax2.plot(ns, [np.median(v) for v in vals("static_over_bound")], style, color=color,
             marker="x", markersize=5, alpha=0.5)
  for ax in (ax1, ax2):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices N")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
  ax1.axhline(1.0, color="gray", lw=0.8)
  ax1.set_ylabel("best static mesh's time / per-rank HDP's time")
  ax1.set_title("per-rank HDP over the best static mesh (lock-step, per-group, LPT)")
  ax2.set_ylabel("time / lower bound")
  ax2.set_title("per-rank HDP (o) and the best static mesh (x) over the bound")
  fig.tight_layout()
  if path:
    fig.savefig(path, dpi=110)
  return fig


def bar_segments(steps, lengths, *, num_devices: int, tokens_per_device: int,
                 model: cost.CostModel):
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
              model: cost.CostModel, title: str) -> float:
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


def draw_schedule(ax, sched, lengths, *, tokens_per_device: int, model: cost.CostModel,
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


def describe(models: dict) -> str:
  """The simulated machines' link figures and what one gradient all-reduce carries."""
  lines = []
  for name, model in models.items():
    grads = ", ".join(f"{a} {with_attention(model, kv).params / 1e9:.2f}B parameters, "
                      f"{with_attention(model, kv).grad_bytes() / 1e9:.1f} GB"
                      for a, kv in ATTENTIONS.items())
    lines.append(f"{name}: links {model.link_bytes_per_s / 1e9:g} GB/s per direction (hops "
                 f"and all-reduces); gradients all-reduced in f32: {grads}")
  return "\n".join(lines)


def sim_part(argv_devices, *, seeds, tokens_per_device, batch_steps, max_len, link_gbps,
             accel_tflops, accel_link_gbps, chart, out, distributions=DISTRIBUTIONS,
             fit_kwargs=None, fill: float = 0.95, tensor: int = 1, fsdp: int = 1,
             tensor_link_gbps: float = 100.0, attention_ratios=(), rates=None,
             per_rank=None) -> dict:
  """The --part=sim benchmark: fit (or take `rates`: s per attention and per linear
  FLOP), simulate, print the table, draw, save."""
  start = time.perf_counter()
  if rates:
    fit = fixed_fit(*rates)
    print(f"given rates: {fit.model.sec_per_attention_flop:.3e} s per attention FLOP, "
          f"{fit.model.sec_per_linear_flop:.3e} s per linear FLOP")
  else:
    fit = hdp_sim.fit_cost_model(**(fit_kwargs or {}))
    print(f"fitted on this CPU: {fit.model.sec_per_attention_flop:.3e} s per attention FLOP "
          f"(R^2 {fit.attention_r2:.4f}), {fit.model.sec_per_linear_flop:.3e} s per linear "
          f"FLOP (R^2 {fit.linear_r2:.4f}); fit took {time.perf_counter() - start:.1f} s")
  print(f"attention costs {fit.model.sec_per_attention_flop / fit.model.sec_per_linear_flop:.2f}"
        f"x a matmul FLOP")
  models = settings(fit, link_gbps=link_gbps, accel_tflops=accel_tflops,
                    accel_link_gbps=accel_link_gbps, attention_ratios=attention_ratios)
  print(describe(models))
  if tensor > 1 or fsdp != 1:
    print(f"sharded: N / {tensor} slots, each a tensor group of {tensor} ({tensor_link_gbps:g} "
          f"GB/s links), parameters sharded over {'all' if fsdp == -1 else fsdp} slots")
  rows = run_sim(models, devices=argv_devices, seeds=seeds,
                 tokens_per_device=tokens_per_device, batch_steps=batch_steps,
                 max_len=max_len, distributions=distributions, fill=fill, tensor=tensor,
                 fsdp=fsdp, tensor_link_gbps=tensor_link_gbps, per_rank=per_rank)
  print(sim_table(rows))
  print(f"total {time.perf_counter() - start:.1f} s")
  if chart:
    plot_sim(rows, chart)
  result = dict(fit=dict(attention_r2=fit.attention_r2, linear_r2=fit.linear_r2,
                         models={k: dataclasses.asdict(m) for k, m in models.items()}),
                attentions=ATTENTIONS, rows=rows)
  if out:
    with open(out, "w") as f:
      json.dump(result, f, indent=1, default=float)
  return result
