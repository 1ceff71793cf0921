"""Attention with segment ids (packed documents), causal masking, sliding windows and GQA.

One entry point, `attention(q, k, v, ...)`, dispatching on `impl`: "pallas"
(attention_pallas.py for GPU and CPU interpret mode, attention_pallas_tpu.py for TPU),
"xla" (attention_xla.py, blockwise with linear memory), and here:
`impl="reference"` is the obviously-correct autodiff of a masked softmax, for tests.
The Pallas kernels run per shard of the mesh (sharded.py); XLA's partitioner splits the others.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxsys.kernels import backends, sharded
from jaxsys.kernels.attention_blocks import check_window
from jaxsys.kernels.attention_inputs import check_inputs, segment_pair
from jaxsys.kernels.attention_inputs import static_scale  # re-exported: kernels' public helper
from jaxsys.kernels.attention_pallas import pallas_attention
from jaxsys.kernels.attention_pallas_tpu import pallas_tpu_attention
from jaxsys.kernels.attention_xla import xla_attention
from jaxsys.kernels.backends import IMPLS  # re-exported: the valid `impl` values


def reference_attention(q, k, v, *, segment_ids=None, causal=True, sm_scale=None, window=0):
  """softmax(q k^T * scale + mask) v, materialising the [B, H, T, S] scores."""
  q_seg, kv_seg = check_inputs(q, k, v, segment_ids)
  window = check_window("reference_attention", window, causal)
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
  q_BTKGD = q.reshape(b, t, hkv, hq // hkv, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k, preferred_element_type=jnp.float32)
  scores = scores * scale
  mask = jnp.ones((b, t, s), dtype=bool)
  if causal:
    # Queries are aligned to the end of the keys, so T < S is decoding with a cache.
    q_idx, kv_idx = jnp.arange(t)[:, None] + (s - t), jnp.arange(s)[None, :]
    mask &= q_idx >= kv_idx
    if window:  # transformers' sliding_window: the query and the window - 1 keys before it
      mask &= q_idx - window < kv_idx
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


def resolve_impl(impl: str, backend: str | None = None) -> str:
  """"auto" -> Pallas on GPU and TPU, blockwise XLA on CPU; others pass through (checked)."""
  return backends.resolve_impl("attention", impl, backend)


def attention(q, k, v, *, segment_ids=None, causal: bool = True, sm_scale: float | None = None,
              impl: str = "auto", window: int = 0) -> jax.Array:
  """Multi-head attention; q [B,T,Hq,D], k/v [B,S,Hkv,D] -> [B,T,Hq,D] in q.dtype.

  segment_ids: None, [B, T] int (self-attention) or a pair ([B, T], [B, S]);
  tokens attend only to keys with an equal id. impl: "auto", "pallas" (Triton on
  GPU, Mosaic on TPU, interpret mode on CPU), "xla" (blockwise, linear memory), "reference".
  window > 0 (causal only): query i attends only keys j with i - window < j <= i (queries
  aligned to the end of the keys), transformers' `sliding_window`; 0: no window.
  """
  impl = resolve_impl(impl)
  check_inputs(q, k, v, segment_ids)
  if impl == "reference":
    return reference_attention(q, k, v, segment_ids=segment_ids, causal=causal, sm_scale=sm_scale,
                               window=window)
  q_seg, kv_seg = segment_pair(segment_ids)
  kw = dict(causal=causal, sm_scale=sm_scale)
  if window:  # only when set: a kernel without windows keeps its signature
    kw["window"] = window
  if impl == "xla":
    return xla_attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, **kw)
  kernel = pallas_tpu_attention if backends.platform() == "tpu" else pallas_attention
  return sharded.sharded_attention(kernel, q, k, v, q_seg, kv_seg, **kw)
