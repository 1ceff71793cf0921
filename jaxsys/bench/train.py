"""The training step timed against the matmul peak and a dot-only baseline: MFU.

The library of `experiments/bench_train.py`; `bench` measures one run, `table` prints it,
and `summarize`/`runs_table` give the median [min, max] over independent runs.

In one process `bench` measures (a) the matmul FLOP/s peak for the compute dtype (square
n=1024 and n=2048 matmuls; on CPU MFU uses the larger, on a GPU/TPU listed in
`jaxsys.metrics.DATASHEET_PEAK_FLOPS` the datasheet's bf16 peak), (b) the train step
built exactly as `jaxsys.train.loop` builds it (same jit, shardings, donation) on a
random packed batch of the config's shape (`jaxsys.data.packing.random_packed_batch`,
`segments` documents a row), and (c) a baseline of plain dots with the model's own
matmul shapes (forward, input-gradient and weight-gradient of every weight, plus
attention's QK^T and PV) and the same FLOP count, in one jitted function with the
step's XLA options. (c) against (a) is how much MFU the matmul shapes alone allow;
(b) against (c) is what everything else (softmax, norms, RoPE, cross-entropy,
optimizer, copies) costs. MFU is given in two conventions (`jaxsys.flops`): PaLM's,
attention over the full T x T square (what (c) computes), and causal, only the (query,
key) pairs inside the batch's documents. The three are timed in `rounds` interleaved
rounds, and the table says how much of the host's CPU other processes took meanwhile: on
a shared machine, compare runs only at similar load.

The rounds of one run share its compiled step, its state and one peak (their best), so
they are not independent samples of the MFU. The binary's `--runs=N` repeats the whole
benchmark N times in the process (each run builds, compiles and measures its peak
afresh) and ends with the median [min, max] of MFU and tokens/s over the runs.

On CPU, XLA allocates the step's temporaries with glibc malloc, which maps fresh 4 KiB
pages every step; the table's page-fault count shows it.
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (glibc >= 2.35) backs them with transparent huge
pages instead.
"""
from __future__ import annotations

import resource
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys import flops as flops_lib
from jaxsys import mesh as mesh_lib
from jaxsys import metrics as metrics_lib
from jaxsys.data import packing
from jaxsys.models import transformer
from jaxsys.train import config_check
from jaxsys.train import step as step_lib
from jaxsys.train.setup import make_setup


def wait_for_idle_host(max_wait_s: float, threshold: float = 0.1) -> float:
  """Sleeps until other processes use under `threshold` of the host's CPU (sampled over
  0.5 s), for at most `max_wait_s`; returns the seconds waited."""
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < max_wait_s:
    a = metrics_lib.host_cpu_seconds()
    time.sleep(0.5)
    b = metrics_lib.host_cpu_seconds()
    if a is None or b is None or (b[0] - a[0]) / max(b[1] - a[1], 1e-9) < threshold:
      break
  return time.perf_counter() - t0


class Timer:
  """Times blocking calls; also counts this process's CPU time and page faults, and how much
  of the host's CPU other processes used meanwhile (the machine may be shared)."""

  def __init__(self):
    self.seconds: list[float] = []
    self.cpu_s = self.faults = self.other_cpu_s = self.host_s = 0.0

  def __call__(self, fn: Callable[[], Any], n: int) -> None:
    for _ in range(n):
      r0, h0 = resource.getrusage(resource.RUSAGE_SELF), metrics_lib.host_cpu_seconds()
      t0 = time.perf_counter()
      fn()
      dt = time.perf_counter() - t0
      r1, h1 = resource.getrusage(resource.RUSAGE_SELF), metrics_lib.host_cpu_seconds()
      self.seconds.append(dt)
      cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
      self.cpu_s += cpu
      self.faults += r1.ru_minflt + r1.ru_majflt - r0.ru_minflt - r0.ru_majflt
      if h0 and h1:
        self.other_cpu_s += max(0.0, h1[0] - h0[0] - cpu)
        self.host_s += h1[1] - h0[1]

  def summary(self) -> dict[str, float]:
    n = max(len(self.seconds), 1)
    return {"median_s": statistics.median(self.seconds), "min_s": min(self.seconds),
            "cpu_s_per_call": self.cpu_s / n, "page_faults_per_call": self.faults / n,
            "other_processes_cpu_share": self.other_cpu_s / self.host_s if self.host_s else None}


def train_matmul_shapes(cfg: transformer.TransformerConfig, batch: int, seq_len: int
                        ) -> list[tuple[str, tuple[int, ...], tuple[int, ...], int]]:
  """(name, lhs, rhs, count) of every matmul of one training step, as dots on 2-D/3-D arrays.

  A weight matmul [M, K] x [K, N] has a forward, an input gradient [M, N] x [N, K] and a
  weight gradient [K, M] x [M, N]; attention's QK^T and PV are batched over B * Hq.
  """
  L, D, F, H, K, hd, V = (cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads,
                          cfg.hd, cfg.vocab_size)
  M, T, BH = batch * seq_len, seq_len, batch * H
  weights = [("wq", D, H * hd, L), ("wk", D, K * hd, L), ("wv", D, K * hd, L),
             ("wo", H * hd, D, L), ("w_gate", D, F, L), ("w_up", D, F, L), ("w_down", F, D, L),
             ("unembedding", D, V, 1)]
  shapes = []
  for name, k, n, count in weights:
    shapes += [(f"{name} fwd", (M, k), (k, n), count), (f"{name} dx", (M, n), (n, k), count),
               (f"{name} dw", (k, M), (M, n), count)]
  shapes += [("qk fwd", (BH, T, hd), (BH, hd, T), L), ("pv fwd", (BH, T, T), (BH, T, hd), L),
             ("qk dq", (BH, T, T), (BH, T, hd), L), ("qk dk", (BH, T, T), (BH, T, hd), L),
             ("pv dp", (BH, T, hd), (BH, hd, T), L), ("pv dv", (BH, T, T), (BH, T, hd), L)]
  return shapes


def _dot_flops(lhs: tuple[int, ...], rhs: tuple[int, ...]) -> int:
  return 2 * int(np.prod(lhs)) * rhs[-1]


def dot_baseline(shapes, dtype: str, compiler_options: dict[str, Any] | None = None
                 ) -> tuple[Callable[[], Any], float]:
  """A blocking call running every dot of `shapes` in one jit, and its FLOP count."""
  dt = jnp.dtype(dtype)
  flops = sum(_dot_flops(l, r) * c for _, l, r, c in shapes)
  key = jax.random.key(0)
  operands = []  # one pair per repeat (layer), so XLA cannot merge repeats of a dot
  for _, l, r, c in shapes:
    for _ in range(c):
      ka, kb = jax.random.split(jax.random.fold_in(key, len(operands)))
      operands.append((jax.random.normal(ka, l, dt), jax.random.normal(kb, r, dt)))
  run = jax.jit(lambda ops: [jnp.matmul(a, b) for a, b in ops], compiler_options=compiler_options)
  run(operands)  # compile
  return lambda: jax.block_until_ready(run(operands)), float(flops)


def bench(config, steps: int, warmup: int, segments: int, rounds: int, wait_idle: float = 0.0
          ) -> dict[str, Any]:
  """Every measurement of the benchmark for `config`, as a dict of numbers.

  The peak, the train step and the dot baseline are measured in `rounds` interleaved
  rounds, so load from other processes hits all three alike.
  """
  run = config_check.check_config(config)
  model_cfg, B, T = run.model, run.data.batch_size, run.data.seq_len
  mesh = mesh_lib.make_mesh(run.mesh)
  setup = make_setup(run, mesh)
  train_fn, batch_sh = setup.train_fn, setup.batch_sh
  state = setup.init_state(config.seed)
  host_batch = packing.random_packed_batch(B, T, docs_per_row=segments,
                                           vocab_size=model_cfg.vocab_size, seed=config.seed)
  batch = jax.device_put(host_batch, batch_sh)

  t0 = time.perf_counter()
  state, m = train_fn(state, batch)
  jax.block_until_ready(m)
  compile_s = time.perf_counter() - t0
  memory = train_fn.lower(state, batch).compile().memory_analysis()
  temp_bytes = getattr(memory, "temp_size_in_bytes", None)

  def one_step():
    nonlocal state, m
    state, m = train_fn(state, batch)
    jax.block_until_ready(m)

  flops_per_token = transformer.train_flops_per_token(model_cfg, T)  # PaLM: full T x T
  step_flops = flops_per_token * B * T
  pairs_per_row = flops_lib.attention_pairs(T, B, segment_ids=host_batch["segment_ids"]) / B
  causal_flops = (transformer.train_flops_per_token(model_cfg, T, pairs_per_row=pairs_per_row)
                  * B * T)
  # The same XLA options as the step, so the baseline differs from it in nothing but the non-dots.
  dots_fn, dots_flops = dot_baseline(train_matmul_shapes(model_cfg, B, T), model_cfg.dtype,
                                     step_lib.compiler_options(model_cfg, mesh))
  if abs(dots_flops - step_flops) > 1e-6 * step_flops:
    raise AssertionError(f"dot baseline has {dots_flops:.4g} FLOPs, the model {step_flops:.4g}")

  for _ in range(warmup):
    one_step()
    dots_fn()
  rounds = max(1, min(rounds, steps))
  peaks: dict[int, list[float]] = {1024: [], 2048: []}
  step_timer, dots_timer = Timer(), Timer()
  for r in range(rounds):
    for n in peaks:
      wait_for_idle_host(wait_idle)
      peaks[n].append(metrics_lib.measure_matmul_flops(model_cfg.dtype, n))
    per_round = steps // rounds + (r < steps % rounds)
    # One untimed call first: the first call after other work pays for fresh memory
    # (page faults, huge-page compaction) that back-to-back training steps do not.
    for timer, fn in ((step_timer, one_step), (dots_timer, dots_fn)):
      wait_for_idle_host(wait_idle)
      fn()
      timer(fn, per_round)
  peak_by_n = {n: max(v) for n, v in peaks.items()}
  sheet = metrics_lib.datasheet_peak()
  peak, peak_source = sheet or (max(peak_by_n.values()), f"measured {model_cfg.dtype} matmul peak")
  st, dt = step_timer.summary(), dots_timer.summary()
  step_s, dots_s = st["median_s"], dt["median_s"]
  return {
      "machine": metrics_lib.machine_info(),
      "config": {"model": model_cfg.__dict__, "batch": B, "seq_len": T, "mesh": config.mesh,
                 "segments": segments},
      "params_m": transformer.param_count(model_cfg) / 1e6,
      "flops_per_token": flops_per_token, "flops_per_token_causal": causal_flops / (B * T),
      "attention_pairs_per_row": pairs_per_row, "rounds": rounds,
      "peak_flops": peak, "peak_source": peak_source,
      "peak_flops_by_n": {str(n): v for n, v in peak_by_n.items()},
      "compile_s": compile_s, "temp_bytes": temp_bytes, "step": st,
      "step_s_all": step_timer.seconds,
      "loss": float(m["loss"]),
      "tokens_per_s": B * T / step_s, "model_flops_per_s": step_flops / step_s,
      "mfu": step_flops / step_s / peak, "mfu_causal": causal_flops / step_s / peak,
      "dots": dt, "dots_flops_per_s": dots_flops / dots_s, "dots_mfu": dots_flops / dots_s / peak,
  }


def table(r: dict[str, Any]) -> str:
  m, c = r["machine"], r["config"]
  mc = c["model"]
  lines = [
      f"machine: {m['cpu']}, {m['cores']} cores, jax {m['jax']}, backend {m['backend']} "
      f"({m['devices']} devices)" + "".join(f", {k.upper()}={m[k]}"
                                            for k in ("xla_flags", "glibc_tunables") if m[k]),
      f"model: d_model={mc['d_model']} layers={mc['n_layers']} heads={mc['n_heads']}/"
      f"{mc['n_kv_heads']} d_ff={mc['d_ff']} dtype={mc['dtype']}; batch={c['batch']} x "
      f"seq_len={c['seq_len']} ({c['segments']} docs/row); {r['params_m']:.2f}M params, "
      f"compile {r['compile_s']:.1f} s"
      + (f"; XLA temporaries {r['temp_bytes'] / 2**20:,.0f} MiB per step" if r["temp_bytes"]
         else ""),
      f"FLOP/token: {r['flops_per_token'] / 1e6:.2f} M with attention's full T x T square (PaLM), "
      f"{r['flops_per_token_causal'] / 1e6:.2f} M with only the causal pairs inside the batch's "
      f"documents ({r['attention_pairs_per_row']:,.0f} a row); MFU against "
      f"{r['peak_flops'] / 1e9:,.1f} GFLOP/s, the {r['peak_source']}",
      "",
      "| measurement | time/step | tokens/s | GFLOP/s (PaLM) | MFU (PaLM, full T x T) "
      "| MFU (causal, documents) |",
      "|---|---:|---:|---:|---:|---:|",
  ]
  for n, v in r["peak_flops_by_n"].items():
    lines.append(f"| matmul peak {mc['dtype']} n={n} (measured) | | | {v / 1e9:.1f} | "
                 f"{v / r['peak_flops']:.0%} | |")
  tokens = c["batch"] * c["seq_len"]
  for name, key, gflops, causal in (
      ("dots only (model's matmul shapes, same FLOPs)", "dots", r["dots_flops_per_s"], ""),
      ("train step", "step", r["model_flops_per_s"], f"{r['mfu_causal']:.1%}")):
    x = r[key]
    lines.append(f"| {name} | {x['median_s'] * 1e3:.0f} ms | {tokens / x['median_s']:,.0f} | "
                 f"{gflops / 1e9:.1f} | {gflops / r['peak_flops']:.1%} | {causal} |")
  lines.append("")
  for name, key in (("train step", "step"), ("dots only", "dots")):
    x = r[key]
    other = x["other_processes_cpu_share"]
    lines.append(f"{name}: min {x['min_s'] * 1e3:.0f} ms, {x['cpu_s_per_call']:.2f} CPU-s and "
                 f"{x['page_faults_per_call']:,.0f} page faults per call"
                 + (f"; other processes used {other:.0%} of the host's CPU meanwhile"
                    if other is not None else ""))
  return "\n".join(lines)


# The numbers `--runs` summarizes: (key, label, format of one value).
SUMMARY = (("mfu", "MFU (PaLM)", "{:.1%}"), ("mfu_causal", "MFU (causal)", "{:.1%}"),
           ("tokens_per_s", "tokens/s", "{:,.0f}"), ("step_s", "step", "{:.3f} s"),
           ("peak_flops", "peak GFLOP/s", "{:.1f}"), ("dots_mfu", "dots-only MFU", "{:.1%}"))


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
  """{key: {median, min, max}} of SUMMARY's numbers over independent runs of `bench`."""
  out = {}
  for key, _, _ in SUMMARY:
    xs = [r["step"]["median_s"] if key == "step_s" else r[key] for r in results]
    out[key] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
  return out


def runs_table(results: list[dict[str, Any]]) -> str:
  """One row per run, then the median [min, max] over them."""
  scale = lambda key, x: x / 1e9 if key == "peak_flops" else x
  lines = ["| run | " + " | ".join(label for _, label, _ in SUMMARY)
           + " | other processes' CPU (step, dots: the larger) |",
           "|---|" + "---:|" * (len(SUMMARY) + 1)]
  for i, r in enumerate(results, 1):
    one = summarize([r])
    shares = [r[k]["other_processes_cpu_share"] for k in ("step", "dots")
              if r[k]["other_processes_cpu_share"] is not None]
    lines.append(f"| {i} | " + " | ".join(fmt.format(scale(key, one[key]["median"]))
                                          for key, _, fmt in SUMMARY)
                 + f" | {f'{max(shares):.0%}' if shares else ''} |")
  summary = summarize(results)
  cell = lambda key, fmt: "{} [{}, {}]".format(
      *(fmt.format(scale(key, summary[key][k])) for k in ("median", "min", "max")))
  lines.append(f"| median [min, max] of {len(results)} | "
               + " | ".join(cell(key, fmt) for key, _, fmt in SUMMARY) + " | |")
  return "\n".join(lines)
