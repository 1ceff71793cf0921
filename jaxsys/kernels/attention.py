"""Attention with segment ids (packed documents), causal masking and GQA.

One entry point, `attention(q, k, v, ...)`, dispatching on `impl`: "pallas"
(attention_pallas.py for GPU and CPU interpret mode, attention_pallas_tpu.py for TPU),
"xla" (attention_xla.py, blockwise with linear memory), and here:
`impl="reference"` is the obviously-correct autodiff of a masked softmax;
`impl="dense"` computes the same values with a hand-written backward that keeps one
[B, H, T, S] residual (the probabilities) instead of autodiff's several, lays the
scores out so no [T, S]-sized transpose is materialised, and skips the causal
square's upper blocks: on a CPU those memory passes, not the matmuls, dominated
(measured by experiments/bench_train.py). It still materialises [T, S] scores per
query block, so it is for short sequences; the Pallas and blockwise (flash) paths
plug in here.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

IMPLS = ("auto", "pallas", "xla", "dense", "reference")


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


def _mask(q_seg, kv_seg, t: int, s: int, causal: bool, b: int) -> jax.Array | None:
  """Boolean [B, T, S] (True = attend), or None when nothing is masked."""
  mask = None
  if causal:
    # Queries are aligned to the end of the keys, so T < S is decoding with a cache.
    mask = (jnp.arange(t)[:, None] + (s - t)) >= jnp.arange(s)[None, :]
    mask = jnp.broadcast_to(mask, (b, t, s))
  if q_seg is not None:
    same = q_seg[:, :, None] == kv_seg[:, None, :]
    mask = same if mask is None else mask & same
  return mask


def _query_blocks(t: int, s: int, causal: bool) -> list[tuple[int, int, int]]:
  """(t0, t1, keys) per query block: queries [t0, t1) see at most keys [0, keys).

  Causal attention skips the key blocks above the diagonal, exactly: 4 blocks of 64
  queries at T = 256 do 10/16 of the square's work. At most 8 blocks, so the
  unrolled loop stays small for long sequences.
  """
  if not causal:
    return [(0, t, s)]
  size = max(64, -(-t // 8))
  return [(t0, min(t0 + size, t), min(t0 + size, t) + (s - t)) for t0 in range(0, t, size)]


def _blockwise_fwd(q, k, v, mask, scale, causal):
  """Per query block, probabilities [B, Hkv, Tb, G, Sb] (f32); and the output [B, T, Hq, D] (f32).

  Scores are laid out [b, k, t, g, s], the natural output order of the q-k dot,
  so no [T, S]-sized transpose is ever materialised.
  """
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  q_BTKGD = q.reshape(b, t, hkv, hq // hkv, d)
  probs, outs = [], []
  for t0, t1, e in _query_blocks(t, s, causal):
    scores = jnp.einsum("btkgd,bskd->bktgs", q_BTKGD[:, t0:t1], k[:, :e],
                        preferred_element_type=jnp.float32) * scale
    if mask is not None:
      scores = jnp.where(mask[:, None, t0:t1, None, :e], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    # A fully masked row (e.g. padding with no partner) must give zeros, not NaN:
    # with a finite max, exp(-inf - max) is exactly 0 for every masked key.
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(scores - row_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    outs.append(jnp.einsum("bktgs,bskd->btkgd", p.astype(v.dtype), v[:, :e],
                           preferred_element_type=jnp.float32))
    probs.append(p)
  return probs, jnp.concatenate(outs, axis=1).reshape(b, t, hq, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _dense_attention(q, k, v, mask, scale, causal):
  return _blockwise_fwd(q, k, v, mask, scale, causal)[1].astype(q.dtype)


def _dense_attention_fwd(q, k, v, mask, scale, causal):
  probs, out = _blockwise_fwd(q, k, v, mask, scale, causal)
  return out.astype(q.dtype), (q, k, v, mask, probs, out)


def _dense_attention_bwd(scale, causal, res, d_out):
  q, k, v, mask, probs, out = res
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  do_BTKGD = d_out.reshape(b, t, hkv, g, d)
  q_BTKGD = q.reshape(b, t, hkv, g, d)
  # Softmax backward: ds = p * (dp - sum_s p dp), and sum_s p dp = <do, out> per query.
  delta_BKTG1 = jnp.sum(d_out.astype(jnp.float32) * out, axis=-1).reshape(
      b, t, hkv, g).transpose(0, 2, 1, 3)[..., None]
  dq, dk, dv = [], jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
  for (t0, t1, e), p in zip(_query_blocks(t, s, causal), probs):
    do_blk = do_BTKGD[:, t0:t1]
    dv_blk = jnp.einsum("bktgs,btkgd->bskd", p.astype(d_out.dtype), do_blk,
                        preferred_element_type=jnp.float32)
    dp = jnp.einsum("btkgd,bskd->bktgs", do_blk, v[:, :e], preferred_element_type=jnp.float32)
    ds = p * (dp - delta_BKTG1[:, :, t0:t1]) * scale
    dq.append(jnp.einsum("bktgs,bskd->btkgd", ds.astype(k.dtype), k[:, :e],
                         preferred_element_type=jnp.float32))
    dk_blk = jnp.einsum("bktgs,btkgd->bskd", ds.astype(q.dtype), q_BTKGD[:, t0:t1],
                        preferred_element_type=jnp.float32)
    pad = ((0, 0), (0, s - e), (0, 0), (0, 0))
    dk, dv = dk + jnp.pad(dk_blk, pad), dv + jnp.pad(dv_blk, pad)
  dq = jnp.concatenate(dq, axis=1).reshape(q.shape)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_dense_attention.defvjp(_dense_attention_fwd, _dense_attention_bwd)


def dense_attention(q, k, v, *, segment_ids=None, causal=True, sm_scale=None):
  """Same values as `reference_attention`; the backward keeps only the probabilities."""
  q_seg, kv_seg = _check_inputs(q, k, v, segment_ids)
  b, t, _, d = q.shape
  if not (sm_scale is None or isinstance(sm_scale, (int, float))):
    # A traced or array scale may itself be differentiated: autodiff handles that.
    return reference_attention(q, k, v, segment_ids=segment_ids, causal=causal, sm_scale=sm_scale)
  scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
  mask = _mask(q_seg, kv_seg, t, k.shape[1], causal, b)
  return _dense_attention(q, k, v, mask, scale, bool(causal))


def _pair(segment_ids):
  """segment_ids argument -> (q_segment_ids, kv_segment_ids) or (None, None)."""
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    return tuple(segment_ids)
  return segment_ids, segment_ids


def resolve_impl(impl: str, backend: str | None = None) -> str:
  """"auto" -> the fastest path for the backend: Pallas on GPU and TPU, blockwise XLA on CPU."""
  if impl not in IMPLS:
    raise ValueError(f"attention: impl={impl!r} is not available; choose one of {IMPLS}")
  if impl != "auto":
    return impl
  return "xla" if (backend or jax.default_backend()) == "cpu" else "pallas"


def attention(q, k, v, *, segment_ids=None, causal: bool = True, sm_scale: float | None = None,
              impl: str = "auto") -> jax.Array:
  """Multi-head attention; q [B,T,Hq,D], k/v [B,S,Hkv,D] -> [B,T,Hq,D] in q.dtype.

  segment_ids: None, [B, T] int (self-attention) or a pair ([B, T], [B, S]);
  tokens attend only to keys with an equal id. impl: "auto", "pallas" (Triton on
  GPU, Mosaic on TPU, interpret mode on CPU), "xla" (blockwise, linear memory),
  "dense" (short sequences: materialises [T, S] scores), "reference".
  """
  impl = resolve_impl(impl)
  _check_inputs(q, k, v, segment_ids)
  if impl == "reference":
    return reference_attention(q, k, v, segment_ids=segment_ids, causal=causal, sm_scale=sm_scale)
  if impl == "dense":
    return dense_attention(q, k, v, segment_ids=segment_ids, causal=causal, sm_scale=sm_scale)
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
