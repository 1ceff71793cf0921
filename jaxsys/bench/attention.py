"""Attention impls timed against each other: time, TFLOP/s of unmasked work, compiled temp memory.

The library of `experiments/bench_attention.py`; `run` measures, `markdown` makes the table
and `cpu_target`/`tokamax_target` check the CPU targets.

For every T, mode (causal: one document of T tokens; packed: causal documents of random
lengths averaging T/8 in each row, passed as segment ids) and pass (fwd; fwd+bwd, the
vjp with a random cotangent), the impls are timed in interleaved rounds, so load from
other processes on a shared machine falls on all of them alike; the median is reported.

Impls (`--impls`; the default is what exists on the backend):
  xla               jaxsys blockwise attention, `attention(..., impl="xla")`
  pallas            jaxsys Pallas kernels (`impl="pallas"`; on CPU interpret mode only,
                    so not in the CPU default)
  cudnn_or_xla_dpa  the baseline: `jax.nn.dot_product_attention`, implementation="cudnn"
                    on GPU and "xla" elsewhere; packed mode passes a [B, 1, T, T] mask
                    built from the segment ids inside the jitted function
  jax_pallas        jax's own `pallas.ops.gpu.attention.mha` (GPU only; k/v heads repeated
                    for GQA, since it has none)
  tokamax_xla_chunked, tokamax_xla
                    the pure-XLA peers: `tokamax.dot_product_attention` with
                    implementation="xla_chunked" (chunked online softmax, memory linear in
                    T) and "xla" (dense); in the CPU default when tokamax is installed
                    (`pip install -e '.[tokamax]'`). Its API has no segment ids, so packed
                    rows pass the dense [B, 1, T, T] mask, as for the baseline
A jaxsys impl is reached through `jaxsys.kernels.attention.attention`. An impl that fails
is recorded as "n/a" with its error and the run goes on. Before timing, every impl is
checked against `reference_attention` (values and the vjp, causal and packed) on a small
case with the run's heads, D and dtype; one that differs is reported and not timed.

`--doc_lens=512,1024,...` adds one mode per length L: every row packed with documents of
exactly L tokens, so the unmasked work is T*(L+1)/2 per row. With block skipping the time
should follow L (the sum of the documents' T_i^2), not T^2: the "ms per M pairs" column
of those rows stays flat.

FLOP convention (`jaxsys.flops`, only unmasked work counts): a forward pass does 4*D
flops per unmasked (query, key) pair per query head (2*D for q.k, 2*D for p.v); fwd+bwd
counts 3.5x the forward (FlashAttention-2's count). Unmasked pairs: T(T+1)/2 per row for
causal, sum over documents of T_i(T_i+1)/2 for packed (`flops.attention_pairs`); packed
rows come from `jaxsys.data.packing.random_packed_batch`. Memory is
`memory_analysis().temp_size_in_bytes` of the compiled function (inputs and outputs
excluded), i.e. the peak of XLA's temporaries.

`--max_seconds_per_case` bounds a slow impl: once one call takes longer than that over
(repeats + 1), it is timed once at that T and skipped at longer T.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys import flops as flops_lib
from jaxsys import metrics as metrics_lib
from jaxsys.data import packing
from jaxsys.kernels import attention as attention_lib

# name -> tokamax's `implementation`.
TOKAMAX_IMPLS = {"tokamax_xla_chunked": "xla_chunked", "tokamax_xla": "xla"}
ALL_IMPLS = ("xla", "pallas", "cudnn_or_xla_dpa", "jax_pallas", *TOKAMAX_IMPLS)
# Impls without segment ids: their packed rows get the dense [B, 1, T, T] mask.
DENSE_MASK_IMPLS = ("cudnn_or_xla_dpa", *TOKAMAX_IMPLS)


# ----------------------------------------------------------------------------- impls


def _jaxsys_fn(impl: str) -> tuple[Callable, str]:
  """fn(q, k, v, seg) for a jaxsys impl, through the public dispatcher."""
  return (lambda q, k, v, seg: attention_lib.attention(
      q, k, v, segment_ids=seg, causal=True, impl=impl)), f"attention(impl={impl!r})"


def _dpa_fn() -> tuple[Callable, str]:
  implementation = "cudnn" if jax.default_backend() == "gpu" else "xla"

  def fn(q, k, v, seg):
    mask = None if seg is None else (seg[:, :, None] == seg[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                        implementation=implementation)

  return fn, f"jax.nn.dot_product_attention(implementation={implementation!r})"


def _jax_pallas_fn() -> tuple[Callable, str]:
  if jax.default_backend() != "gpu":
    raise NotImplementedError("jax's pallas.ops.gpu.attention runs on GPU only")
  from jax.experimental.pallas.ops.gpu import attention as jax_attention

  def fn(q, k, v, seg):
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    return jax_attention.mha(q, k, v, seg, sm_scale=1.0 / np.sqrt(q.shape[-1]), causal=True)

  return fn, "jax.experimental.pallas.ops.gpu.attention.mha"


def tokamax_installed() -> bool:
  return importlib.util.find_spec("tokamax") is not None


def _tokamax_fn(name: str) -> tuple[Callable, str]:
  implementation = TOKAMAX_IMPLS[name]
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f"{name} needs tokamax: pip install -e '.[tokamax]'") from e

  def fn(q, k, v, seg):
    mask = None if seg is None else (seg[:, :, None] == seg[:, None, :])[:, None]
    # The scale is tokamax's default too; explicit, so both sides visibly compute the same.
    return tokamax.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                         scale=1.0 / math.sqrt(q.shape[-1]),
                                         implementation=implementation)

  return fn, f"tokamax.dot_product_attention(implementation={implementation!r})"


def make_impl(name: str) -> tuple[Callable, str]:
  if name in ("xla", "pallas"):
    return _jaxsys_fn(name)
  if name == "cudnn_or_xla_dpa":
    return _dpa_fn()
  if name == "jax_pallas":
    return _jax_pallas_fn()
  if name in TOKAMAX_IMPLS:
    return _tokamax_fn(name)
  raise ValueError(f"--impls: unknown impl {name!r}; choose from {', '.join(ALL_IMPLS)}")


def default_impls() -> list[str]:
  if jax.default_backend() == "gpu":
    return ["xla", "pallas", "cudnn_or_xla_dpa", "jax_pallas"]
  if jax.default_backend() == "tpu":
    return ["xla", "pallas", "cudnn_or_xla_dpa"]
  # Pallas on CPU is interpret mode: a test path. tokamax's XLA impls are the CPU peers.
  return ["xla", "cudnn_or_xla_dpa", *(TOKAMAX_IMPLS if tokamax_installed() else ())]


def check_impl_names(names: list[str]) -> None:
  """Raises ValueError (the CLI's one error line) for an unknown impl or a missing package."""
  for name in names:
    if name not in ALL_IMPLS:
      raise ValueError(f"--impls: unknown impl {name!r}; choose from {', '.join(ALL_IMPLS)}")
    if name in TOKAMAX_IMPLS and not tokamax_installed():
      raise ValueError(f"--impls: {name} needs tokamax: pip install -e '.[tokamax]'")


def _with_pass(fn: Callable, pass_: str) -> Callable:
  if pass_ == "fwd":
    return lambda q, k, v, seg, ct: fn(q, k, v, seg)

  def fwd_bwd(q, k, v, seg, ct):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
    return out, vjp(ct)

  return fwd_bwd


# ----------------------------------------------------------------------------- checking

CHECK_TOL = {"float32": 1e-4, "bfloat16": 3e-2}


def check_impls(impls: dict[str, tuple[Callable, str]], heads: int, kv_heads: int, d: int,
                dtype, t: int = 1536, seed: int = 0) -> dict[str, str]:
  """Each impl against `reference_attention`, causal and packed, values and vjp; name -> error.

  T=1536 is several tiles of jaxsys's xla (and a remainder chunk of tokamax's 512 x 1024).
  """
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (1, t, heads, d), dtype)
  k = jax.random.normal(keys[1], (1, t, kv_heads, d), dtype)
  v = jax.random.normal(keys[2], (1, t, kv_heads, d), dtype)
  ct = jax.random.normal(keys[3], (1, t, heads, d), dtype)
  seg = jnp.asarray(packing.random_packed_batch(1, t, doc_lengths=np.arange(1, t // 4 + 1),
                                                seed=seed)["segment_ids"])
  tol = CHECK_TOL[jnp.dtype(dtype).name]

  def value_and_vjp(fn, seg_arg, dt):
    def run(q, k, v, ct):
      out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg_arg), q, k, v)
      return out, vjp(ct)
    return jax.jit(run)(*(x.astype(dt) for x in (q, k, v, ct)))

  def reference(q, k, v, seg_arg):
    return attention_lib.reference_attention(q, k, v, segment_ids=seg_arg, causal=True)

  failures = {}
  for mode, seg_arg in (("causal", None), ("packed", seg)):
    # The truth in f32 from the same (maybe bf16) inputs.
    want_out, want_grads = value_and_vjp(reference, seg_arg, jnp.float32)
    for name, (fn, _) in impls.items():
      if name in failures:
        continue
      try:
        out, grads = value_and_vjp(fn, seg_arg, dtype)
      except Exception:  # pylint: disable=broad-except  # timing records it as n/a
        continue
      for what, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads),
                                 (want_out, *want_grads)):
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
        # Relative to the largest entry: grads of a long sum are O(10), values O(1).
        if not err <= tol * max(1.0, float(jnp.max(jnp.abs(want)))):
          failures[name] = (f"differs from reference_attention ({mode}, T={t}): max |{what} - "
                            f"ref| = {err:.3g}")
          break
  return failures


# ----------------------------------------------------------------------------- measuring


def run_case(impls: dict[str, tuple[Callable, str]], args: tuple, pass_: str, repeats: int,
             max_seconds: float, skip: set) -> dict[str, dict[str, Any]]:
  """Compiles each impl, then times them in interleaved rounds; returns per-impl results."""
  results, compiled = {}, {}
  for name, (fn, _) in impls.items():
    if name in skip:
      results[name] = {"status": "skipped (slower than --max_seconds_per_case at a shorter T)"}
      continue
    try:
      c = jax.jit(_with_pass(fn, pass_)).lower(*args).compile()
      t0 = time.perf_counter()
      jax.block_until_ready(c(*args))  # warm-up
      first = time.perf_counter() - t0
    except Exception as e:  # pylint: disable=broad-except
      results[name] = {"status": f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}
      continue
    results[name] = {"status": "ok", "temp_bytes": c.memory_analysis().temp_size_in_bytes,
                     "times_s": []}
    if first * (repeats + 1) > max_seconds:
      results[name].update(times_s=[first], status="ok (timed once: slow)")
      skip.add(name)
    else:
      compiled[name] = c
  for _ in range(repeats):
    for name, c in compiled.items():
      t0 = time.perf_counter()
      jax.block_until_ready(c(*args))
      results[name]["times_s"].append(time.perf_counter() - t0)
  for r in results.values():
    if r.get("times_s"):
      r["time_s"] = statistics.median(r["times_s"])
  return results


def run(seq_lens, batch, heads, kv_heads, d, dtype, impl_names, packed, passes, repeats,
        max_seconds, seed, doc_lens=()) -> dict[str, Any]:
  """Every (T, mode, pass, impl): rows with time, TFLOP/s of unmasked work and temp bytes."""
  if heads % kv_heads:
    raise ValueError(f"--heads={heads} must be a multiple of --kv_heads={kv_heads}")
  for p in passes:
    if p not in ("fwd", "fwd_bwd"):
      raise ValueError(f"--passes: unknown pass {p!r}; choose from fwd, fwd_bwd")
  impls = {}
  rows = []
  for name in impl_names:
    try:
      impls[name] = make_impl(name)
    except (ImportError, NotImplementedError, ValueError) as e:
      if isinstance(e, ValueError) and name not in ALL_IMPLS:
        raise
      rows.append({"impl": name, "status": f"n/a: {e}"})
  # Same computation before same clock: a peer that differs (scale, causal alignment) is out.
  for name, error in check_impls(impls, heads, kv_heads, d, dtype, seed=seed).items():
    print(f"{name}: {error}; not timed", flush=True)
    rows.append({"impl": name, "status": f"n/a: {error}"})
    del impls[name]
  cpu_start = _cpu_times()
  rng = np.random.default_rng(seed)
  modes = {"causal": None, **({"packed": None} if packed else {}),
           **{f"docs={n}": n for n in doc_lens}}
  skip = {(m, p): set() for m in modes for p in passes}
  for t in seq_lens:
    keys = jax.random.split(jax.random.key(seed + t), 4)
    q = jax.random.normal(keys[0], (batch, t, heads, d), dtype)
    k = jax.random.normal(keys[1], (batch, t, kv_heads, d), dtype)
    v = jax.random.normal(keys[2], (batch, t, kv_heads, d), dtype)
    ct = jax.random.normal(keys[3], (batch, t, heads, d), dtype)
    for mode, doc_len in modes.items():
      seg = None
      if mode != "causal":  # "packed": lengths uniform in [1, T/4], mean ~T/8
        lengths = doc_len or np.arange(1, max(2, t // 4) + 1)
        seg = packing.random_packed_batch(batch, t, doc_lengths=lengths, seed=rng)["segment_ids"]
      pairs = flops_lib.attention_pairs(t, batch, segment_ids=seg)
      seg_arg = None if seg is None else jnp.asarray(seg)
      for pass_ in passes:
        res = run_case(impls, (q, k, v, seg_arg, ct), pass_, repeats, max_seconds,
                       skip[(mode, pass_)])
        for name, r in res.items():
          row = {"impl": name, "via": impls[name][1], "T": t, "mode": mode, "pass": pass_,
                 "unmasked_pairs": pairs, **{k: v for k, v in r.items() if k != "times_s"},
                 "times_s": r.get("times_s")}
          if "time_s" in r:
            row["tflops"] = flops_lib.attention_flops(pairs, heads, d, pass_) / r["time_s"] / 1e12
          rows.append(row)
          print(_row_line(row), flush=True)
  return {"machine": metrics_lib.machine_info(), "rows": rows, "load_avg_end": os.getloadavg(),
          "others_cpu_share": _others_cpu_share(cpu_start, _cpu_times()),
          "versions": _versions(impl_names),
          "config": {"batch": batch, "heads": heads, "kv_heads": kv_heads, "head_dim": d,
                     "dtype": jnp.dtype(dtype).name, "seq_lens": list(seq_lens),
                     "repeats": repeats, "packed": packed, "doc_lens": list(doc_lens),
                     "seed": seed}}


def _cpu_times() -> tuple[float, float, float] | None:
  """(machine busy CPU s, this process's CPU s, wall s); None where /proc/stat is absent."""
  try:
    with open("/proc/stat") as f:
      fields = [int(x) for x in f.readline().split()[1:]]
  except OSError:
    return None
  busy = sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait
  own = os.times()
  return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system, time.time()


def _others_cpu_share(start, end) -> float | None:
  """Other processes' share of all cores during the run: the load the timings shared."""
  if start is None or end is None or end[2] <= start[2]:
    return None
  others = (end[0] - start[0]) - (end[1] - start[1])
  return max(0.0, others / ((end[2] - start[2]) * os.cpu_count()))


def _versions(impl_names) -> dict[str, str]:
  out = {"jax": jax.__version__}
  if any(n in TOKAMAX_IMPLS for n in impl_names) and tokamax_installed():
    out["tokamax"] = importlib.metadata.version("tokamax")
  return out


def _row_line(row) -> str:
  if "time_s" not in row:
    return f"T={row.get('T')} {row.get('mode')} {row.get('pass')} {row['impl']}: {row['status']}"
  lo, hi = min(row["times_s"]), max(row["times_s"])
  return (f"T={row['T']} {row['mode']} {row['pass']} {row['impl']}: "
          f"{row['time_s'] * 1e3:.1f} ms ({lo * 1e3:.1f}-{hi * 1e3:.1f}), "
          f"{row['tflops']:.4f} TFLOP/s, "
          f"temp {row['temp_bytes'] / 2**20:.1f} MiB")


BASELINE = "cudnn_or_xla_dpa"


def _best_tokamax(impls: dict[str, dict]) -> dict | None:
  timed = [impls[n] for n in TOKAMAX_IMPLS if "time_s" in impls.get(n, {})]
  return min(timed, key=lambda r: r["time_s"]) if timed else None


def markdown(result: dict[str, Any]) -> str:
  """The table: one line per (T, mode, pass, impl), with time and memory vs the baselines."""
  m, c = result["machine"], result["config"]
  versions = ", ".join(f"{k} {v}" for k, v in result.get("versions", {"jax": m["jax"]}).items())
  share = result.get("others_cpu_share")
  load = (f"; other processes used {share:.0%} of the cores during the run" if share is not None
          else "")
  lines = [f"machine: {m['device']} ({m['cpu']}, {m['cores']} cores), backend {m['backend']}, "
           f"{versions}; B={c['batch']} Hq={c['heads']} Hkv={c['kv_heads']} "
           f"D={c['head_dim']} {c['dtype']}, median of {c['repeats']} (min-max){load}",
           "",
           "| T | mode | pass | impl | time ms | min-max ms | ms per M pairs | TFLOP/s (unmasked) "
           "| temp MiB | time / dpa | temp / dpa | time / best tokamax |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  by_case: dict[tuple, dict[str, dict]] = {}
  for row in result["rows"]:
    if "T" in row:
      by_case.setdefault((row["T"], row["mode"], row["pass"]), {})[row["impl"]] = row
  for (t, mode, pass_), impls in by_case.items():
    base, best = impls.get(BASELINE, {}), _best_tokamax(impls)
    for name, row in impls.items():
      shown = f"{name} (dense mask)" if mode != "causal" and name in DENSE_MASK_IMPLS else name
      if "time_s" not in row:
        lines.append(f"| {t} | {mode} | {pass_} | {shown} | {row['status']} | | | | | | | |")
        continue
      ratio_t = ratio_m = ratio_tk = ""
      if "time_s" in base and name != BASELINE:
        ratio_t = f"{row['time_s'] / base['time_s']:.2f}"
        ratio_m = f"1/{base['temp_bytes'] / max(row['temp_bytes'], 1):.1f}"
      if best is not None and name not in TOKAMAX_IMPLS:
        ratio_tk = f"{row['time_s'] / best['time_s']:.2f}"
      per_pairs = row["time_s"] * 1e3 / (row["unmasked_pairs"] / 1e6)
      spread = f"{min(row['times_s']) * 1e3:.1f}-{max(row['times_s']) * 1e3:.1f}"
      lines.append(f"| {t} | {mode} | {pass_} | {shown} | {row['time_s'] * 1e3:.1f} | {spread} "
                   f"| {per_pairs:.2f} | {row['tflops']:.4f} | {row['temp_bytes'] / 2**20:.1f} "
                   f"| {ratio_t} | {ratio_m} | {ratio_tk} |")
  for row in result["rows"]:
    if "T" not in row:
      lines.append(f"\n{row['impl']}: {row['status']}")
  return "\n".join(lines)


def tokamax_target(result: dict[str, Any], min_t: int = 1024) -> list[str]:
  """The issue's CPU target: impl="xla" fwd+bwd at T >= min_t no slower than tokamax's best."""
  out = []
  by_case: dict[tuple, dict[str, dict]] = {}
  for row in result["rows"]:
    if "T" in row and row["T"] >= min_t and row["pass"] == "fwd_bwd":
      by_case.setdefault((row["T"], row["mode"]), {})[row["impl"]] = row
  for (t, mode), impls in by_case.items():
    best, xla = _best_tokamax(impls), impls.get("xla", {})
    if best is None or "time_s" not in xla:
      continue
    ratio = xla["time_s"] / best["time_s"]
    out.append(f"T={t} {mode} fwd_bwd: xla {ratio:.2f}x the best tokamax ({best['impl']}) "
               f"(need <= 1.0): {'MET' if ratio <= 1.0 else 'NOT MET'}")
  return out


def cpu_target(result: dict[str, Any], t: int = 8192) -> list[str]:
  """The issue's CPU target: impl="xla" at T has <= 1/8 of dpa's temp and <= 1.5x its time."""
  out = []
  for row in result["rows"]:
    if row.get("impl") != "xla" or row.get("T") != t or row.get("mode") != "causal":
      continue
    base = next((r for r in result["rows"] if r.get("impl") == BASELINE and r.get("T") == t
                 and r.get("mode") == "causal" and r.get("pass") == row["pass"]), None)
    if not base or "time_s" not in base or "time_s" not in row:
      out.append(f"T={t} {row['pass']}: not measured")
      continue
    mem = base["temp_bytes"] / max(row["temp_bytes"], 1)
    speed = row["time_s"] / base["time_s"]
    met = mem >= 8 and speed <= 1.5
    out.append(f"T={t} {row['pass']}: temp 1/{mem:.1f} of dpa (need <= 1/8), time "
               f"{speed:.2f}x dpa (need <= 1.5x): {'MET' if met else 'NOT MET'}")
  return out
