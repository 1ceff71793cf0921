"""Quantized matmul speed against a bf16 `jnp.dot` with the same shapes: decode rows
(M = 1, 16: reading the weight is the cost) and a prefill block (M = 4k: the math is)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.device_report import timing
from jaxsys.device_report.budget import Budget
from jaxsys.device_report.section import Context, Section
from jaxsys.kernels import quant_matmul as qm

BASELINE = "bf16 dot"


def _dot(x, w):
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _bytes(*trees) -> int:
  return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(trees))


def run(ctx: Context, section: Section, budget: Budget) -> None:
  s, kn = ctx.sizes, ctx.sizes.qmatmul_kn
  impl = qm.resolve_impl("auto", ctx.backend)
  section.columns = ("M", "matmul", "us", "GB/s", "% HBM peak", "TFLOP/s", "% peak",
                     "x bf16 dot")
  section.note(f"x [M, {kn}] bf16 @ w [{kn}, {kn}]; quantized matmuls run "
               f"`qmatmul(impl={impl!r})` and include quantizing x for W8A8; GB/s is (weight "
               "+ x + output bytes) / time; '% peak' is against the datasheet's dense peak "
               "of the units the matmul runs on (int8 or fp8 tensor cores for W8A8, bf16 "
               f"otherwise); median of {s.repeats} calls"
               + ("" if ctx.sheet else "; no datasheet for this device: no % columns"))
  w = jax.random.normal(jax.random.key(0), (kn, kn), jnp.float32) / np.sqrt(kn)
  weights = {BASELINE: w.astype(jnp.bfloat16),
             **{scheme: qm.quantize_weight(w, scheme) for scheme in qm.SCHEMES}}
  for m in s.qmatmul_ms:
    if budget.expired():
      section.stop_early(f"budget spent before M={m}")
      return
    x = jax.random.normal(jax.random.key(m), (m, kn), jnp.bfloat16)
    cases = {name: ((_dot if name == BASELINE else
                     lambda x, qw: qm.qmatmul(x, qw, impl=impl)), (x, wt))
             for name, wt in weights.items()}
    calls, _, failed = timing.prepare(cases)
    timed = timing.time_calls(calls, s.repeats, warm_up=False)
    base = timed.get(BASELINE)
    for name, wt in weights.items():
      if name in failed:
        section.add(M=m, matmul=name, status=f"n/a: {failed[name]}")
        section.fail(f"{name} at M={m}: {failed[name]}")
        continue
      sec = timed[name].median
      moved = _bytes(wt, x) + m * kn * 2
      row = section.add(M=m, matmul=name, us=sec * 1e6, **{
          "GB/s": moved / sec / 1e9, "TFLOP/s": 2 * m * kn * kn / sec / 1e12,
          "x bf16 dot": base.median / sec if base else None},
          weight_bytes=_bytes(wt), spread=timed[name].spread, status="ok")
      if ctx.sheet:
        row["% HBM peak"] = 100 * moved / sec / ctx.sheet.hbm_bytes_per_s
        row["% peak"] = 100 * row["TFLOP/s"] * 1e12 / ctx.sheet.peak(name)
