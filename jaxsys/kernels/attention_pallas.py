"""Flash attention in Pallas for GPU (Triton lowering), run in interpret mode on CPU.

`pallas_attention(q, k, v, ...)` has exactly the semantics of
`jaxsys.kernels.attention.reference_attention`: q [B, T, Hq, D], k/v [B, S, Hkv, D],
GQA (q head h reads kv head h // (Hq // Hkv)), optional segment ids (attend only within
equal ids), causal masking with queries aligned to the END of the keys, an optional
sliding window (query i sees only keys j > i - window), and a query row with nothing to
attend to gives exactly zeros (values and gradients).

Structure (FlashAttention-2):
- forward: grid (q blocks, batch, q heads); each program keeps its q tile resident and
  runs an online softmax over kv blocks [kv_lo, kv_hi) with `lax.fori_loop`. It saves
  the per-row logsumexp (base 2) for the backward.
- backward: delta = rowsum(dO * O) in XLA, then one Pallas kernel for dq (same grid
  and kv ranges as the forward) and one for dk/dv (grid (kv blocks, batch, kv heads),
  looping over the G q heads sharing the kv head and over q blocks [q_lo, q_hi)).
- block skipping: the ranges are computed in XLA from per-block min/max segment ids and
  the causal diagonal and window (`attention_blocks.block_ranges`), so compute follows the
  unmasked area: with a window each q block visits only the kv blocks its band touches.

Example:
  out = pallas_attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids, causal=True)
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxsys.kernels import backends
from jaxsys.kernels.attention_blocks import (FlashConfig, check_block, check_pallas_inputs,
                                           check_window, flash_vjp, padded_ids_and_ranges)

_LOG2E = math.log2(math.e)
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def default_blocks(t: int, s: int, d: int) -> tuple[int, int]:
  """(block_q, block_k) for the GPU kernels: 128x64 up to D=128, 64x32 for larger D.

  Blocks shrink to the (power-of-two rounded) sequence lengths, never below 16, the
  smallest tile a Triton `dot` accepts.
  """
  bq, bk = (128, 64) if d <= 128 else (64, 32)
  bq = max(16, min(bq, _next_pow2(t)))
  bk = max(16, min(bk, _next_pow2(s)))
  return bq, bk


def _check_block(name: str, value) -> int:
  return check_block("pallas_attention", name, value, lambda n: n >= 16 and not n & (n - 1),
                     "a power of two >= 16 (Triton tiles)")


@dataclasses.dataclass(frozen=True)
class _Config(FlashConfig):
  """The GPU kernels' static parameters; block_q_dkv <= block_q, so it divides the padding."""
  kv_padded: bool      # whether any key is padding (needs the element mask)
  num_warps: int
  num_stages: int

  @property
  def masked(self) -> bool:
    return self.causal or self.has_segments or self.kv_padded


# ----------------------------------------------------------------------------- kernels


def _dot(a, b, contract_a: int, contract_b: int):
  """2-D matmul with f32 accumulation; contraction dims select the transposes."""
  return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _element_mask(cfg: _Config, q_start, k_start, bq: int, bk: int, q_ids, k_ids):
  """Boolean [bq, bk] (True = attend) for one tile; only called when cfg.masked."""
  q_pos = q_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  k_pos = k_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  mask = None

  def both(a, b):
    return b if a is None else jnp.logical_and(a, b)

  if cfg.causal:
    mask = both(mask, q_pos + cfg.offset >= k_pos)
  if cfg.window:
    mask = both(mask, q_pos + (cfg.offset - cfg.window) < k_pos)
  if cfg.kv_padded:
    mask = both(mask, k_pos < cfg.kv_len)
  if cfg.has_segments:
    mask = both(mask, q_ids[:, None] == k_ids[None, :])
  return mask


def _kv_tile_scores(cfg: _Config, j, q, q_start, q_ids, k_ref, v_ref, kv_ids_ref):
  """(k, v, scores) of kv block j for a resident q tile: base-2 logits, -inf masked."""
  bk = cfg.block_k
  k_start = pl.multiple_of(j * bk, bk)
  k = k_ref[pl.ds(k_start, bk), :]
  v = v_ref[pl.ds(k_start, bk), :]
  # exp2 is the cheaper instruction on GPU; fold log2(e) into the logit scale.
  s = _dot(q, k, 1, 1) * (cfg.scale * _LOG2E)
  if cfg.masked:
    k_ids = kv_ids_ref[pl.ds(k_start, bk)] if cfg.has_segments else None
    mask = _element_mask(cfg, q_start, k_start, cfg.block_q, bk, q_ids, k_ids)
    s = jnp.where(mask, s, -jnp.inf)
  return k, v, s


def _fwd_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, *rest, cfg: _Config):
  if cfg.has_segments:
    q_ids_ref, kv_ids_ref, o_ref, lse_ref = rest
  else:
    (o_ref, lse_ref), q_ids_ref, kv_ids_ref = rest, None, None
  bq = cfg.block_q
  q_start = pl.program_id(0) * bq
  q = q_ref[...]
  q_ids = q_ids_ref[...] if cfg.has_segments else None

  def body(j, carry):
    acc, m_prev, l_prev = carry
    _, v, s = _kv_tile_scores(cfg, j, q, q_start, q_ids, k_ref, v_ref, kv_ids_ref)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    # A row masked so far has max -inf; use 0 there so exp2 gives exact zeros, not NaN.
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    alpha = jnp.exp2(m_prev - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    l_next = alpha * l_prev + jnp.sum(p, axis=1)
    acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v, 1, 0)
    return acc, m_next, l_next

  acc = jnp.zeros((bq, q.shape[-1]), jnp.float32)
  m = jnp.full((bq,), -jnp.inf, jnp.float32)
  l = jnp.zeros((bq,), jnp.float32)
  acc, m, l = lax.fori_loop(lo_ref[()], hi_ref[()], body, (acc, m, l))
  empty = l == 0.0  # nothing to attend to: output zeros
  o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
  # +inf for empty rows makes every backward probability exp2(s - lse) exactly 0.
  lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))


def _dq_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest,
               cfg: _Config):
  if cfg.has_segments:
    q_ids_ref, kv_ids_ref, dq_ref = rest
  else:
    (dq_ref,), q_ids_ref, kv_ids_ref = rest, None, None
  bq = cfg.block_q
  q_start = pl.program_id(0) * bq
  q = q_ref[...]
  do = do_ref[...]
  lse = lse_ref[...]
  delta = delta_ref[...]
  q_ids = q_ids_ref[...] if cfg.has_segments else None

  def body(j, dq):
    k, v, s = _kv_tile_scores(cfg, j, q, q_start, q_ids, k_ref, v_ref, kv_ids_ref)
    p = jnp.exp2(s - lse[:, None])
    ds = p * (_dot(do, v, 1, 1) - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k, 1, 0)

  dq = jnp.zeros((bq, q.shape[-1]), jnp.float32)
  dq = lax.fori_loop(lo_ref[()], hi_ref[()], body, dq)
  # The softmax scale multiplies every logit; apply it once to the sum.
  dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest,
                cfg: _Config):
  if cfg.has_segments:
    q_ids_ref, kv_ids_ref, dk_ref, dv_ref = rest
  else:
    (dk_ref, dv_ref), q_ids_ref, kv_ids_ref = rest, None, None
  bq, bk = cfg.block_q_dkv, cfg.block_k
  k_start = pl.program_id(0) * bk
  k = k_ref[...]
  v = v_ref[...]
  k_ids = kv_ids_ref[...] if cfg.has_segments else None
  qk_scale = cfg.scale * _LOG2E
  lo, hi = lo_ref[()], hi_ref[()]

  def q_body(i, carry, g):
    dk, dv = carry
    q_start = pl.multiple_of(i * bq, bq)
    rows = pl.ds(q_start, bq)
    q = q_ref[rows, g, :]
    do = do_ref[rows, g, :]
    lse = lse_ref[g, rows]
    delta = delta_ref[g, rows]
    s = _dot(q, k, 1, 1) * qk_scale
    if cfg.masked:
      q_ids = q_ids_ref[rows] if cfg.has_segments else None
      s = jnp.where(_element_mask(cfg, q_start, k_start, bq, bk, q_ids, k_ids), s, -jnp.inf)
    p = jnp.exp2(s - lse[:, None])  # [bq, bk]
    dv = dv + _dot(p.astype(do.dtype), do, 0, 0)
    ds = p * (_dot(do, v, 1, 1) - delta[:, None])
    dk = dk + _dot(ds.astype(q.dtype), q, 0, 0)
    return dk, dv

  def group_body(g, carry):
    # The G q heads sharing this kv head all contribute to its dk/dv.
    return lax.fori_loop(lo, hi, functools.partial(q_body, g=g), carry)

  zeros = jnp.zeros((bk, k.shape[-1]), jnp.float32)
  if cfg.groups == 1:
    dk, dv = group_body(0, (zeros, zeros))
  else:
    dk, dv = lax.fori_loop(0, cfg.groups, group_body, (zeros, zeros))
  dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- calls


def _pallas(kernel, cfg: _Config, name: str, grid, in_specs, args, out_specs, out_shape):
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg), grid=grid, in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, compiler_params=backends.triton_params(
          cfg.interpret, num_warps=cfg.num_warps, num_stages=cfg.num_stages), interpret=cfg.interpret,
      name=name)(*args)


def _q_major_specs(cfg: _Config, q, k, extra: int = 0):
  """(in_specs, q_spec, row_spec) of the forward and dq kernels: grid (q blocks, batch, q heads).

  Inputs: kv_lo, kv_hi, q, k, v, then `extra` of (dO, lse, delta), then segment ids
  when the config has them.
  """
  dp, sp = q.shape[3], k.shape[1]
  bq, g = cfg.block_q, cfg.groups
  q_spec = pl.BlockSpec((None, bq, None, dp), lambda i, b_, h: (b_, i, h, 0))
  kv_spec = pl.BlockSpec((None, sp, None, dp), lambda i, b_, h: (b_, 0, lax.div(h, g), 0))
  row_spec = pl.BlockSpec((None, None, bq), lambda i, b_, h: (b_, h, i))
  range_spec = pl.BlockSpec((None, None), lambda i, b_, h: (b_, i))
  extras = [q_spec, row_spec, row_spec][:extra]
  in_specs = [range_spec, range_spec, q_spec, kv_spec, kv_spec, *extras]
  if cfg.has_segments:
    in_specs += [pl.BlockSpec((None, bq), lambda i, b_, h: (b_, i)),
                 pl.BlockSpec((None, sp), lambda i, b_, h: (b_, 0))]
  return in_specs, q_spec, row_spec


def _fwd_call(cfg: _Config, q, k, v, q_ids, kv_ids, kv_lo, kv_hi):
  b, tp, hq, _ = q.shape
  args = [kv_lo, kv_hi, q, k, v] + ([q_ids, kv_ids] if cfg.has_segments else [])
  in_specs, q_spec, row_spec = _q_major_specs(cfg, q, k)
  return _pallas(_fwd_kernel, cfg, "jaxsys_flash_fwd", (tp // cfg.block_q, b, hq), in_specs,
                 args, [q_spec, row_spec],
                 [jax.ShapeDtypeStruct(q.shape, q.dtype),
                  jax.ShapeDtypeStruct((b, hq, tp), jnp.float32)])


def _dq_call(cfg: _Config, q, k, v, do, lse, delta, q_ids, kv_ids, kv_lo, kv_hi):
  b, tp, hq, _ = q.shape
  args = [kv_lo, kv_hi, q, k, v, do, lse, delta] + ([q_ids, kv_ids] if cfg.has_segments else [])
  in_specs, q_spec, _ = _q_major_specs(cfg, q, k, extra=3)
  return _pallas(_dq_kernel, cfg, "jaxsys_flash_dq", (tp // cfg.block_q, b, hq), in_specs,
                 args, q_spec, jax.ShapeDtypeStruct(q.shape, q.dtype))


def _dkv_call(cfg: _Config, q, k, v, do, lse, delta, q_ids, kv_ids, q_lo, q_hi):
  b, tp, hq, dp = q.shape
  sp, hkv = k.shape[1], k.shape[2]
  bk, g = cfg.block_k, cfg.groups
  # All G q heads of kv head h are the contiguous slice [h*G, (h+1)*G) of the head axis.
  q_spec = pl.BlockSpec((None, tp, g, dp), lambda j, b_, h: (b_, 0, h, 0))
  kv_spec = pl.BlockSpec((None, bk, None, dp), lambda j, b_, h: (b_, j, h, 0))
  row_spec = pl.BlockSpec((None, g, tp), lambda j, b_, h: (b_, h, 0))
  range_spec = pl.BlockSpec((None, None), lambda j, b_, h: (b_, j))
  in_specs = [range_spec, range_spec, q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
  args = [q_lo, q_hi, q, k, v, do, lse, delta]
  if cfg.has_segments:
    in_specs += [pl.BlockSpec((None, tp), lambda j, b_, h: (b_, 0)),
                 pl.BlockSpec((None, bk), lambda j, b_, h: (b_, j))]
    args += [q_ids, kv_ids]
  return _pallas(_dkv_kernel, cfg, "jaxsys_flash_dkv", (sp // bk, b, hkv), in_specs, args,
                 [kv_spec, kv_spec], [jax.ShapeDtypeStruct(k.shape, k.dtype),
                                      jax.ShapeDtypeStruct(v.shape, v.dtype)])


_flash = flash_vjp(_fwd_call, _dq_call, _dkv_call, layout="bthd")


# ----------------------------------------------------------------------------- entry


def pallas_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     q_segment_ids: jax.Array | None = None,
                     kv_segment_ids: jax.Array | None = None,
                     causal: bool = True, sm_scale: float | None = None,
                     block_q: int | None = None, block_k: int | None = None,
                     interpret: bool | None = None, window: int = 0) -> jax.Array:
  """Flash attention, same values as `reference_attention`; [B,T,Hq,D] in q.dtype.

  Differentiable in q, k, v (Pallas backward). Any T and S (padded inside to the
  blocks), any D (padded to a power of two >= 16 only when needed). `interpret` as in
  `backends.resolve_interpret`: None interprets on CPU and compiles Triton on GPU.
  """
  q_seg, kv_seg, interpret, scale = check_pallas_inputs(
      "pallas_attention", "gpu", q, k, v, q_segment_ids, kv_segment_ids, _DTYPES,
      interpret=interpret, sm_scale=sm_scale)
  window = check_window("pallas_attention", window, causal)
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  default_q, default_k = default_blocks(t, s, d)
  block_q = _check_block("block_q", default_q if block_q is None else block_q)
  block_k = _check_block("block_k", default_k if block_k is None else block_k)

  if t == 0 or s == 0:  # no query or no key: every row is empty
    return jnp.zeros(q.shape, q.dtype)
  tp, sp = -(-t // block_q) * block_q, -(-s // block_k) * block_k
  # Triton tiles need power-of-two sizes and dots need K >= 16; zero columns of q and k
  # add nothing to the logits and zero columns of v are sliced off.
  dp = max(16, _next_pow2(d))
  q_p = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, dp - d)))
  k_p = jnp.pad(k, ((0, 0), (0, sp - s), (0, 0), (0, dp - d)))
  v_p = jnp.pad(v, ((0, 0), (0, sp - s), (0, 0), (0, dp - d)))
  # The dk/dv kernel holds dk, dv accumulators for its kv tile; a q tile no larger than
  # the kv tile keeps register pressure down (as the Triton FA2 tutorial does).
  block_q_dkv = min(block_q, block_k)
  q_ids, kv_ids, ranges = padded_ids_and_ranges(
      q_seg, kv_seg, t=t, s=s, padded_t=tp, padded_s=sp, block_q=block_q,
      block_q_dkv=block_q_dkv, block_k=block_k, causal=causal, batch=b, window=window)
  cfg = _Config(
      scale=scale, causal=bool(causal), offset=s - t, window=window, kv_len=s, kv_padded=sp != s,
      has_segments=q_seg is not None, groups=hq // hkv, block_q=block_q, block_k=block_k,
      block_q_dkv=block_q_dkv, interpret=interpret,
      num_warps=4 if dp <= 64 else 8, num_stages=2)
  out = _flash(cfg, q_p, k_p, v_p, q_ids, kv_ids, ranges)
  return out[:, :t, :, :d]
