r"""Benchmarks quantized matmuls (W8A8 int8/fp8, W4A16 int4) against bf16 and f32 dots.

  python -m experiments.bench_quant_matmul --ms=1,16,128,1024 --kns=4096 --repeats=5 \
      --out=/tmp/bench_quant_matmul.json

For every M (rows of x: 1 and 16 are decode, the rest prefill/training-sized) and
K = N, the cases are timed in interleaved rounds (load from other processes falls on all
of them alike) after one warm-up call each; the median is reported. Cases:
  dot_bf16              x (bf16) @ w (bf16), f32 accumulation: the baseline (cuBLAS on GPU)
  dot_f32               x (f32) @ w (f32)
  <scheme>:<impl>       `qmatmul(x, quantize_weight(w, scheme), impl=impl)` with bf16 x;
                        the w8a8 schemes include quantizing x per token on the fly.
Impls (`--impls`): default "pallas" on GPU/TPU, "xla" on CPU (Pallas on CPU is interpret
mode, a test path). TFLOP/s counts 2*M*K*N for every case. "weight MiB" is what the
weight occupies (codes + scales for the quantized ones).

`--max_seconds_per_case` bounds a slow case: once one call takes longer than that over
(repeats + 1), it is timed once at that M and skipped at larger M (same K, N).
"""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxsys import metrics as metrics_lib
from jaxsys.kernels import quant_matmul as qm

_MS = flags.DEFINE_list("ms", ["1", "16", "128", "1024", "8192"], "Rows M of x.")
_KNS = flags.DEFINE_list("kns", ["4096", "8192"], "K = N sizes of the weight.")
_SCHEMES = flags.DEFINE_list("schemes", list(qm.SCHEMES), "Quantization schemes to time.")
_IMPLS = flags.DEFINE_list("impls", None, "qmatmul impls (pallas, xla, reference); default: "
                           "pallas on GPU/TPU, xla on CPU.")
_BASELINES = flags.DEFINE_list("baselines", ["dot_bf16", "dot_f32"], "Float dots to time.")
_GROUP = flags.DEFINE_integer("group_size", 128, "w4a16 group size.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per case (after one warm-up).")
_MAX_SECONDS = flags.DEFINE_float("max_seconds_per_case", 120.0,
                                  "Time budget of one case; see the docstring.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of x and w.")
_OUT = flags.DEFINE_string("out", None, "Optional JSON path with every number.")

BASELINES = ("dot_bf16", "dot_f32")
BASELINE = "dot_bf16"


def _dot(x, w):
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def make_cases(k: int, n: int, schemes, impls, baselines, group_size: int, seed: int):
  """name -> (fn(x) jitted with the weight closed over as an argument, weight arg, bytes)."""
  w = jax.random.normal(jax.random.key(seed), (k, n), jnp.float32) / np.sqrt(k)
  cases = {}
  if "dot_bf16" in baselines:
    cases["dot_bf16"] = (_dot, w.astype(jnp.bfloat16), jnp.bfloat16, k * n * 2)
  if "dot_f32" in baselines:
    cases["dot_f32"] = (_dot, w, jnp.float32, k * n * 4)
  for scheme in schemes:
    qw = jax.jit(lambda w, s=scheme: qm.quantize_weight(w, s, group_size=group_size))(w)
    for impl in impls:
      fn = lambda x, qw, impl=impl: qm.qmatmul(x, qw, impl=impl)
      cases[f"{scheme}:{impl}"] = (fn, qw, jnp.bfloat16, qw.nbytes)
  return cases


def run_case(cases: dict, x_by_dtype: dict, repeats: int, max_seconds: float,
             skip: set) -> dict[str, dict[str, Any]]:
  """Compiles each case, then times them in interleaved rounds; returns per-case results."""
  results, compiled = {}, {}
  for name, (fn, warg, dtype, _) in cases.items():
    if name in skip:
      results[name] = {"status": "skipped (slower than --max_seconds_per_case at a smaller M)"}
      continue
    x = x_by_dtype[jnp.dtype(dtype)]
    try:
      c = jax.jit(fn).lower(x, warg).compile()
      t0 = time.perf_counter()
      jax.block_until_ready(c(x, warg))  # warm-up
      first = time.perf_counter() - t0
    except Exception as e:  # pylint: disable=broad-except
      results[name] = {"status": f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}
      continue
    results[name] = {"status": "ok", "times_s": []}
    if first * (repeats + 1) > max_seconds:
      results[name].update(times_s=[first], status="ok (timed once: slow)")
      skip.add(name)
    else:
      compiled[name] = (c, x, warg)
  for _ in range(repeats):
    for name, (c, x, warg) in compiled.items():
      t0 = time.perf_counter()
      jax.block_until_ready(c(x, warg))
      results[name]["times_s"].append(time.perf_counter() - t0)
  for r in results.values():
    if r.get("times_s"):
      r["time_s"] = statistics.median(r["times_s"])
  return results


def run(ms, kns, schemes, impls, baselines, group_size, repeats, max_seconds,
        seed) -> dict[str, Any]:
  """Every (K=N, M, case): rows with time, TFLOP/s, weight bytes and speed-up vs dot_bf16."""
  rows = []
  load_start = os.getloadavg()
  for kn in kns:
    cases = make_cases(kn, kn, schemes, impls, baselines, group_size, seed)
    skip: set = set()
    for m in ms:
      x = jax.random.normal(jax.random.key(seed + m), (m, kn), jnp.float32)
      x_by_dtype = {jnp.dtype(jnp.float32): x, jnp.dtype(jnp.bfloat16): x.astype(jnp.bfloat16)}
      res = run_case(cases, x_by_dtype, repeats, max_seconds, skip)
      base = res.get(BASELINE, {}).get("time_s")
      for name, r in res.items():
        row = {"case": name, "M": m, "K": kn, "N": kn, "weight_bytes": cases[name][3],
               **{k: v for k, v in r.items() if k != "times_s"}, "times_s": r.get("times_s")}
        if "time_s" in r:
          row["tflops"] = 2.0 * m * kn * kn / r["time_s"] / 1e12
          if base:
            row["speedup_vs_bf16"] = base / r["time_s"]
        rows.append(row)
        print(_row_line(row), flush=True)
  return {"machine": metrics_lib.machine_info(), "rows": rows, "load_avg_start": load_start,
          "load_avg_end": os.getloadavg(), "config": {"ms": list(ms), "kns": list(kns), "schemes": list(schemes),
                     "impls": list(impls), "group_size": group_size, "repeats": repeats,
                     "seed": seed}}


def _row_line(row) -> str:
  head = f"M={row['M']} K=N={row['K']} {row['case']}"
  if "time_s" not in row:
    return f"{head}: {row['status']}"
  speed = f", {row['speedup_vs_bf16']:.2f}x bf16" if "speedup_vs_bf16" in row else ""
  return f"{head}: {row['time_s'] * 1e3:.2f} ms, {row['tflops']:.3f} TFLOP/s{speed}"


def markdown(result: dict[str, Any]) -> str:
  """One line per (K=N, M, case): time, TFLOP/s, speed-up vs dot_bf16, weight MiB."""
  m, c = result["machine"], result["config"]
  lines = [f"machine: {m['device']} ({m['cpu']}, {m['cores']} cores), backend {m['backend']}, "
           f"jax {m['jax']}; w4a16 group {c['group_size']}, median of {c['repeats']}; "
           f"load average {result['load_avg_start'][0]:.1f} at start, "
           f"{result['load_avg_end'][0]:.1f} at end",
           "",
           "| K=N | M | case | time ms | TFLOP/s | vs dot_bf16 | weight MiB |",
           "|---|---|---|---|---|---|---|"]
  for row in result["rows"]:
    mib = f"{row['weight_bytes'] / 2**20:.1f}"
    if "time_s" not in row:
      lines.append(f"| {row['K']} | {row['M']} | {row['case']} | {row['status']} | | | {mib} |")
      continue
    speed = f"{row['speedup_vs_bf16']:.2f}x" if "speedup_vs_bf16" in row else ""
    lines.append(f"| {row['K']} | {row['M']} | {row['case']} | {row['time_s'] * 1e3:.2f} "
                 f"| {row['tflops']:.3f} | {speed} | {mib} |")
  return "\n".join(lines)


def main(argv):
  del argv
  impls = _IMPLS.value or (["xla"] if jax.default_backend() == "cpu" else ["pallas"])
  for name in impls:
    if name not in qm.IMPLS or name == "auto":
      raise app.UsageError(f"--impls: unknown impl {name!r}; choose from pallas, xla, reference")
  for name in _SCHEMES.value:
    if name not in qm.SCHEMES:
      raise app.UsageError(f"--schemes: unknown scheme {name!r}; choose from {qm.SCHEMES}")
  for name in _BASELINES.value:
    if name not in BASELINES:
      raise app.UsageError(f"--baselines: unknown baseline {name!r}; choose from {BASELINES}")
  result = run([int(v) for v in _MS.value], [int(v) for v in _KNS.value], _SCHEMES.value,
               impls, _BASELINES.value, _GROUP.value, _REPEATS.value, _MAX_SECONDS.value,
               _SEED.value)
  print(markdown(result))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=1, default=str)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
