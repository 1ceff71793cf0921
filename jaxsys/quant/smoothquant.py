"""SmoothQuant (Xiao et al., arXiv 2211.10438): move activation outliers into the weights.

For a matmul x @ W with per-input-channel factors s_j = max|x_j|^alpha / max|W_j|^(1-alpha),
x @ W == (x / s) @ (s W): the activations lose their outlier channels and the weight
rows absorb them, so per-token activation and per-channel weight quantization both
lose less. The 1/s is folded into whatever produces x, so the float model is unchanged
(up to rounding) and nothing is added at run time:

  attn_in   (wq, wk, wv)   1/s into attn_norm's scale
  mlp_in    (w_gate, w_up) 1/s into mlp_norm's scale
  attn_out  (wo)           1/s into wv's output columns: attention output is linear in v
                           (softmax weights do not depend on v). With GQA one v head
                           serves G query heads, so s is tied over those G heads
                           (the max over the group is taken on both sides).
  mlp_hidden (w_down)      1/s into w_up's output columns: silu(gate) * up is linear in up.

Folding into wv / w_up costs those weights nothing: they are quantized per output
channel, and scaling an output column scales its scale with it (identical codes).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxsys.models import transformer
from jaxsys.quant.calibrate import InputStats

GROUPS = ("attn_in", "attn_out", "mlp_in", "mlp_hidden")


def smoothing_factors(act_absmax: jax.Array, w_absmax: jax.Array, alpha: float) -> jax.Array:
  """s = act^alpha / w^(1 - alpha) per input channel; 1 where either side is all zero."""
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f"smoothquant: alpha={alpha} must be in [0, 1]")
  a, w = act_absmax.astype(jnp.float32), w_absmax.astype(jnp.float32)
  ok = (a > 0) & (w > 0)
  s = jnp.where(ok, a ** alpha / jnp.where(ok, w, 1.0) ** (1.0 - alpha), 1.0)
  return jnp.clip(s, 1e-5, 1e5)


def _row_absmax(*ws) -> jax.Array:
  """max |w| over everything but the leading (input) dim, across several weights [K, ...]."""
  return jnp.max(jnp.stack([jnp.max(jnp.abs(w.reshape(w.shape[0], -1)), axis=1) for w in ws]), 0)


def smooth_layer(cfg: transformer.TransformerConfig, p: dict[str, Any], stats: dict[str, InputStats],
                 alpha: float = 0.5, groups=GROUPS) -> dict[str, Any]:
  """One float layer's parameters with the `groups` smoothed (same float function)."""
  unknown = set(groups) - set(GROUPS)
  if unknown:
    raise ValueError(f"smooth_layer: groups={sorted(unknown)} unknown; valid: {GROUPS}")
  p = dict(p)
  H, Kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.hd
  G = H // Kv
  # Output-column folds first: they change wv / w_up, whose rows the input folds then see.
  if "attn_out" in groups:
    act = jnp.max(stats["attn_out"].absmax.reshape(Kv, G, hd), axis=1)
    wmax = jnp.max(jnp.max(jnp.abs(p["wo"]), axis=-1).reshape(Kv, G, hd), axis=1)
    s = smoothing_factors(act, wmax, alpha)  # [Kv, hd]
    p["wv"] = p["wv"] / s[None].astype(p["wv"].dtype)
    p["wo"] = p["wo"] * jnp.repeat(s, G, axis=0)[..., None].astype(p["wo"].dtype)
  if "mlp_hidden" in groups:
    s = smoothing_factors(stats["mlp_hidden"].absmax, _row_absmax(p["w_down"]), alpha)
    p["w_up"] = p["w_up"] / s[None, :].astype(p["w_up"].dtype)
    p["w_down"] = p["w_down"] * s[:, None].astype(p["w_down"].dtype)
  for group, norm, names in (("attn_in", "attn_norm", ("wq", "wk", "wv")),
                             ("mlp_in", "mlp_norm", ("w_gate", "w_up"))):
    if group in groups:
      s = smoothing_factors(stats[group].absmax, _row_absmax(*(p[n] for n in names)), alpha)
      p[norm] = p[norm] / s.astype(p[norm].dtype)
      for n in names:
        p[n] = p[n] * s.reshape(-1, *[1] * (p[n].ndim - 1)).astype(p[n].dtype)
  return p
