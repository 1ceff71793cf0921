"""Attention's argument checks and static parameters, shared by every implementation."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def check_inputs(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids) -> tuple:
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


def segment_pair(segment_ids):
  """segment_ids argument -> (q_segment_ids, kv_segment_ids) or (None, None)."""
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    return tuple(segment_ids)
  return segment_ids, segment_ids
