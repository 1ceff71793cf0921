"""Attention with segment ids (packed documents), causal masking and GQA.

One entry point, `attention(q, k, v, ...)`, dispatching on `impl`: "pallas"
(attention_pallas.py for GPU and CPU interpret mode, attention_pallas_tpu.py for TPU),
"xla" (attention_xla.py, blockwise with linear memory), and here:
`impl="reference"` is the obviously-correct autodiff of a masked softmax, for tests.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxsys.kernels.backends import IMPLS  # re-exported: the valid `impl` values
from jaxsys.kernels import backends


def _check_inputs(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids) -> tuple:
  """Validates shapes; returns (q_segment_ids, kv_segment_ids) or (None, None)."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(
        f"attention: q, k, v must be rank 4 [B, T, H, D]; got q{q.shape} k{k.shape} v{v.shape}")
  (b, t, hq, d), (bk, s, hkv, dk) = q.shape, k.shape
  if k.shape != v.shape or b != bk or d != dk:
    raise ValueError(
        f"attention: k and v must be [B={b}, S, Hkv, D={d}] matching q{q.shape}; "
        f"got k{k.shape} v{v.shape}")
  if hq % hkv:
    raise ValueError(
        f"attention: q heads ({hq}) must be a multiple of k/v heads ({hkv}); got q{q.shape} k{k.shape}")
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    q_seg, kv_seg = segment_ids
  else:
    if t != s:
      raise ValueError(
          f"attention: a single segment_ids array needs T == S; got T={t}, S={s}; "
          "pass a pair (q_segment_ids, kv_segment_ids)")
    q_seg = kv_seg = segment_ids
  for name, seg, n in (("q_segment_ids", q_seg, t), ("kv_segment_ids", kv_seg, s)):
    if seg.shape != (b, n) or not jnp.issubdtype(seg.dtype, jnp.integer):
      raise ValueError(
          f"attention: {name} must be an integer array of shape {(b, n)}; got {seg.dtype}{seg.shape}")
  return q_seg, kv_seg


def static_scale(sm_scale, head_dim: int, who: str) -> float:
  """The softmax scale as a Python float (kernels compile it in); default 1/sqrt(D)."""
  if sm_scale is None:
    return 1.0 / math.sqrt(head_dim)
  try:
    return float(sm_scale)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(f"{who}: sm_scale must be a Python number (it is static); "
                    f"got {type(sm_scale).__name__}") from e


def reference_attention(q, k, v, *, segment_ids=None, causal=True, sm_scale=None):
  """softmax(q k^T * scale + mask) v, materialising the [B, H, T, S] scores."""
  q_seg, kv_seg = _check_inputs(q, k, v, segment_ids)
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
  q_BTKGD = q.reshape(b, t, hkv, hq // hkv, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k, preferred_element_type=jnp.float32)
  scores = scores * scale
  mask = jnp.ones((b, t, s), dtype=bool)
  if causal:
    # Queries are aligned to the end of the keys, so T < S is decoding with a cache.
    mask &= (jnp.arange(t)[:, None] + (s - t)) >= jnp.arange(s)[None, :]
  if q_seg is not None:
    mask &= q_seg[:, :, None] == kv_seg[:, None, :]
  mask = mask[:, None, None]  # broadcast over kv heads and the group
  scores = jnp.where(mask, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  # A fully masked row (e.g. padding with no partner) must give zeros, not NaN.
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  p = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom == 0, 1.0, denom)
  out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return out.reshape(b, t, hq, d).astype(q.dtype)


def _pair(segment_ids):
  """segment_ids argument -> (q_segment_ids, kv_segment_ids) or (None, None)."""
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    return tuple(segment_ids)
  return segment_ids, segment_ids


def resolve_impl(impl: str, backend: str | None = None) -> str:
  """"auto" -> Pallas on GPU and TPU, blockwise XLA on CPU; others pass through (checked)."""
  return backends.resolve_impl("attention", impl, backend)


def attention(q, k, v, *, segment_ids=None, causal: bool = True, sm_scale: float | None = None,
              impl: str = "auto") -> jax.Array:
  """Multi-head attention; q [B,T,Hq,D], k/v [B,S,Hkv,D] -> [B,T,Hq,D] in q.dtype.

  segment_ids: None, [B, T] int (self-attention) or a pair ([B, T], [B, S]);
  tokens attend only to keys with an equal id. impl: "auto", "pallas" (Triton on
  GPU, Mosaic on TPU, interpret mode on CPU), "xla" (blockwise, linear memory), "reference".
  """
  impl = resolve_impl(impl)
  _check_inputs(q, k, v, segment_ids)
  if impl == "reference":
    return reference_attention(q, k, v, segment_ids=segment_ids, causal=causal, sm_scale=sm_scale)
  q_seg, kv_seg = _pair(segment_ids)
  kw = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, causal=causal, sm_scale=sm_scale)
  # Imported here: the kernel modules import this one for its checks and reference.
  if impl == "xla":
    from jaxsys.kernels.attention_xla import xla_attention
    return xla_attention(q, k, v, **kw)
  if jax.default_backend() == "tpu":
    from jaxsys.kernels.attention_pallas_tpu import pallas_tpu_attention
    return pallas_tpu_attention(q, k, v, **kw)
  from jaxsys.kernels.attention_pallas import pallas_attention
  return pallas_attention(q, k, v, **kw)
