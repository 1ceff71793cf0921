"""Correctness first: jaxsys's fast kernels against the reference, on the device itself.

Attention: the Pallas kernel (Triton on a GPU, interpret mode on CPU) and the blockwise XLA
path, fed bf16 inputs, against `impl="reference"` (a materialised masked softmax) in f32 of
the same inputs: output and the three input gradients of a random cotangent. Quantized
matmuls: `qmatmul(impl="pallas")` against `reference_qmatmul` on the same codes.
Each error is max |fast - reference| / max |reference|.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.data import packing
from jaxsys.device_report.budget import Budget
from jaxsys.device_report.section import Context, Section, error_line
from jaxsys.device_report.sizes import AttentionCase
from jaxsys.kernels import attention as attention_lib
from jaxsys.kernels import quant_matmul as qm

# bf16 carries 8 bits of mantissa (relative rounding 2^-9): the output and gradients of a
# bf16 kernel sit within a few roundings of the f32 reference; the backward's sums over T
# keys add a few more.
ATTENTION_TOL = {"out": 1e-2, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2}
# W8A8 kernels read the reference's own codes (exact up to summation order and the bf16
# cast); W4A16 dequantizes into bf16 first (tests/kernels/test_quant_matmul.py's bounds).
QMATMUL_TOL = {"w8a8_int8": 1e-2, "w8a8_fp8": 1e-2, "w4a16": 2e-2}
ATTENTION_IMPLS = ("pallas", "xla")


def relative_error(got, want) -> float:
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-6))


def attention_inputs(case: AttentionCase, seed: int = 0, dtype=jnp.bfloat16):
  """(q, k, v, segment_ids or None, cotangent) of `case`."""
  ks = jax.random.split(jax.random.key(seed), 4)
  b, t = case.batch, case.seq_len
  q = jax.random.normal(ks[0], (b, t, case.heads, case.head_dim), dtype)
  k = jax.random.normal(ks[1], (b, t, case.kv_heads, case.head_dim), dtype)
  v = jax.random.normal(ks[2], (b, t, case.kv_heads, case.head_dim), dtype)
  ct = jax.random.normal(ks[3], q.shape, dtype)
  seg = None
  if case.docs > 1:
    seg = jnp.asarray(packing.random_packed_batch(b, t, docs_per_row=case.docs,
                                                  seed=seed)["segment_ids"])
  return q, k, v, seg, ct


def attention_vjp(impl: str):
  """jit(q, k, v, seg, ct) -> (out, (dq, dk, dv)) of causal attention with `impl`."""

  def fn(q, k, v, seg, ct):
    out, vjp = jax.vjp(lambda q, k, v: attention_lib.attention(
        q, k, v, segment_ids=seg, causal=True, impl=impl), q, k, v)
    return out, vjp(ct)

  return jax.jit(fn)


def attention_errors(impl: str, case: AttentionCase) -> dict[str, float]:
  q, k, v, seg, ct = attention_inputs(case)
  out, grads = attention_vjp(impl)(q, k, v, seg, ct)
  f32 = [x.astype(jnp.float32) for x in (q, k, v, ct)]
  want_out, want_grads = attention_vjp("reference")(*f32[:3], seg, f32[3])
  got = dict(zip(("out", "dq", "dk", "dv"), (out, *grads)))
  want = dict(zip(("out", "dq", "dk", "dv"), (want_out, *want_grads)))
  return {name: relative_error(got[name], want[name]) for name in got}


def qmatmul_error(scheme: str, m: int, kn: int) -> float:
  kw, kx = jax.random.split(jax.random.key(m))
  w = jax.random.normal(kw, (kn, kn), jnp.float32) / np.sqrt(kn)
  x = jax.random.normal(kx, (m, kn), jnp.bfloat16)
  qw = qm.quantize_weight(w, scheme)
  got = jax.jit(lambda x, qw: qm.qmatmul(x, qw, impl="pallas"))(x, qw)
  return relative_error(got, jax.jit(qm.reference_qmatmul)(x, qw))


def run(ctx: Context, section: Section, budget: Budget) -> None:
  section.columns = ("kernel", "case", "error", "tolerance", "passed")
  section.note("error: max |kernel - reference| / max |reference|; attention lists the worst "
               "of output, dq, dk, dv (all four are in the JSON); the reference is f32 of "
               "the same bf16 inputs")
  cases = [(f"attention impl={impl}", case) for case in ctx.sizes.check_attention
           for impl in ATTENTION_IMPLS]
  cases += [(f"qmatmul {scheme}", m) for scheme in qm.SCHEMES for m in ctx.sizes.check_qmatmul_ms]
  for kernel, case in cases:
    if budget.expired():
      section.stop_early(f"budget spent before {kernel}, {case}: the remaining checks did not run")
      return
    try:
      if kernel.startswith("attention"):
        errors = attention_errors(kernel.split("=")[1], case)
        worst = max(errors, key=lambda n: errors[n] / ATTENTION_TOL[n])
        row = section.add(kernel=kernel, case=case.name, error=errors[worst],
                          tolerance=ATTENTION_TOL[worst], worst=worst, errors=errors,
                          passed=all(errors[n] <= ATTENTION_TOL[n] for n in errors))
      else:
        scheme = kernel.split()[1]
        err = qmatmul_error(scheme, case, ctx.sizes.check_qmatmul_kn)
        kn = ctx.sizes.check_qmatmul_kn
        row = section.add(kernel=kernel, case=f"M={case} K=N={kn}", error=err,
                          tolerance=QMATMUL_TOL[scheme], passed=err <= QMATMUL_TOL[scheme])
    except Exception as e:  # pylint: disable=broad-except
      row = section.add(kernel=kernel, case=getattr(case, "name", f"M={case}"), error=None,
                        tolerance=None, passed=False, failure=error_line(e))
    if not row["passed"]:
      section.fail(f"{kernel}, {row['case']}: " + (row.get("failure") or
                   f"error {row['error']:.3g} above the tolerance {row['tolerance']:g}"))
