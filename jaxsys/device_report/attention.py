"""Attention fwd+bwd speed: jaxsys's Pallas kernel and XLA path beside jax's cuDNN and XLA
`dot_product_attention`, causal, bf16, T from 1k to 32k at a fixed number of tokens."""
from __future__ import annotations

import time

import jax

from jaxsys import flops
from jaxsys.device_report import checks, timing
from jaxsys.device_report.budget import Budget
from jaxsys.device_report.section import Context, Section
from jaxsys.device_report.sizes import AttentionCase
from jaxsys.kernels import attention as attention_lib

OURS = ("jaxsys pallas", "jaxsys xla")
PEERS = ("cudnn", "jax xla")


def _jaxsys(impl: str):
  return lambda q, k, v, ct: _vjp(lambda q, k, v: attention_lib.attention(
      q, k, v, causal=True, impl=impl), q, k, v, ct)


def _dot_product_attention(implementation: str):
  return lambda q, k, v, ct: _vjp(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation=implementation), q, k, v, ct)


def _vjp(fn, q, k, v, ct):
  out, vjp = jax.vjp(fn, q, k, v)
  return out, vjp(ct)


IMPLS = {"jaxsys pallas": _jaxsys("pallas"), "jaxsys xla": _jaxsys("xla"),
         "cudnn": _dot_product_attention("cudnn"), "jax xla": _dot_product_attention("xla")}


def run(ctx: Context, section: Section, budget: Budget) -> None:
  s = ctx.sizes
  section.columns = ("T", "B", "impl", "ms", "TFLOP/s", "x best peer", "status")
  section.note(f"fwd+bwd of causal attention, bf16, H={s.attention_heads} D="
               f"{s.attention_head_dim}, B x T = {s.attention_tokens:,} tokens; TFLOP/s "
               "counts the causal pairs only, the backward 2.5x the forward (FlashAttention-2); "
               f"median of {s.repeats} calls; 'x best peer' is TFLOP/s over the faster of "
               "cuDNN and jax's XLA attention at that T")
  active = dict(IMPLS)
  if ctx.backend != "gpu":
    del active["cudnn"]
    section.note("cudnn: needs an NVIDIA GPU (not timed here)")
  last_t_s = 0.0
  for t in s.attention_seq_lens:
    if not budget.allows(2.5 * last_t_s):  # the next T costs about twice the last
      section.stop_early(f"stopped before T={t}: {budget.left():.0f} s of the budget left, "
                         f"T={t // 2} took {last_t_s:.0f} s")
      return
    t0 = time.perf_counter()
    case = AttentionCase(max(1, s.attention_tokens // t), t, s.attention_heads,
                         s.attention_heads, s.attention_head_dim)
    q, k, v, _, ct = checks.attention_inputs(case)
    calls, first, failed = timing.prepare({n: (fn, (q, k, v, ct)) for n, fn in active.items()})
    timed = timing.time_calls(calls, s.repeats, warm_up=False)
    work = flops.attention_flops(flops.attention_pairs(t, case.batch), case.heads,
                                 case.head_dim, "fwd_bwd")
    tflops = {n: work / timed[n].median / 1e12 for n in timed}
    best_peer = max((tflops[n] for n in PEERS if n in tflops), default=None)
    for name in active:
      if name in failed:
        section.add(T=t, B=case.batch, impl=name, status=f"n/a: {failed[name]}")
        continue
      section.add(T=t, B=case.batch, impl=name, ms=timed[name].median * 1e3,
                  **{"TFLOP/s": tflops[name],
                     "x best peer": tflops[name] / best_peer if best_peer and name in OURS
                     else None},
                  spread=timed[name].spread, status="ok")
    for name in list(active):  # a failure or a slow call ends an impl's climb
      if name in failed or first[name] > s.max_call_s:
        section.note(f"{name}: not run beyond T={t} ("
                     + (failed[name] if name in failed else
                        f"one call took {first[name]:.1f} s > {s.max_call_s:g} s") + ")")
        del active[name]
    last_t_s = time.perf_counter() - t0
