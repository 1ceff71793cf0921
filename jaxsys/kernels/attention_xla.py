"""Blockwise (flash-style) attention in pure JAX: memory linear in T, forward and backward.

`xla_attention` has the semantics of `attention.reference_attention` (causal queries
aligned to the end of the keys, segment ids, GQA, zeros for rows with nothing to attend
to) but never builds the [T, S] score matrix. q is cut into `block_q` rows and k/v into
`block_k` keys; for every q block a loop runs over only the kv blocks that can hold an
unmasked pair (causal structure and, for packed segment ids, the overlap of per-block
min/max ids), carrying an online softmax (running max, denominator, f32 accumulator).
So compute follows the unmasked area: about half the tiles for causal T == S, about
sum_i T_i^2 for packed documents whose ids increase along the sequence. The loops are
`lax.scan` over q blocks around a `lax.fori_loop` with data-dependent bounds; that is
allowed because nothing differentiates through them: the vjp is hand-written.

The backward is a `jax.custom_vjp` that keeps only q, k, v, the output and the per-row
logsumexp; it loops over kv blocks, and within each over the q blocks that can see it,
recomputing one tile of probabilities at a time (FlashAttention-2: delta = rowsum(dO*O),
dS = P * (dP - delta)), so forward + backward temporaries are linear in T as well.

Layout is chosen for XLA:CPU, whose dot emitter wants [M, K] x [K, N] row-major
operands and otherwise copies a transposed tile before every matmul: batch and kv heads
stay two leading batch dims (so a mesh may shard either), and the G query heads sharing
a kv head are stacked with the block's rows, M = G*block_q, so GQA never repeats k/v.
k and q are also kept transposed (once, outside the loops) and the backward works on
transposed tiles [block_k, M], so all five backward matmuls and both forward ones are
canonical.

Blocks default to `default_blocks(B * Hq)`, sized by measurement so one score tile is
about 2 MiB; sequences are split into near-equal blocks, so padding stays under one
block (padded keys are masked, padded rows dropped). When T <= block_q and S <= block_k
the problem is one tile: no loop is emitted and the backward reuses the saved
probabilities instead of recomputing them (a dense custom vjp: the short-sequence path).

Example:
  out = xla_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, causal=True)
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxsys.kernels.attention_inputs import check_inputs, static_scale
from jaxsys.kernels.attention_blocks import spans, visitable_blocks

# Default block sizes: one [B*Hq, block_q, block_k] f32 score tile is the unit of work,
# and on CPU it runs fastest at about 2 MiB (in cache, yet big enough to amortise the
# per-iteration loop cost). Measured on a 2-core AMD EPYC, f32, fwd and fwd+bwd:
# B=1, Hq=4, T=8192 -> 256 x 512; B=32, Hq=8, T=512 -> 32 x 64 (2x faster than 128 x 128).
TILE_ELEMENTS = 1 << 19


class _Config(NamedTuple):
  """Static (hashable) description of one call: the custom_vjp's non-diff argument."""
  b: int
  hkv: int
  g: int
  t: int  # real query length
  s: int  # real key length
  bq: int
  bk: int
  nq: int
  nk: int
  causal: bool
  scale: float
  has_segments: bool


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                  q_segment_ids: jax.Array | None = None,
                  kv_segment_ids: jax.Array | None = None,
                  causal: bool = True, sm_scale: float | None = None,
                  block_q: int | None = None, block_k: int | None = None) -> jax.Array:
  """Blockwise attention, q [B,T,Hq,D], k/v [B,S,Hkv,D] -> [B,T,Hq,D] in q.dtype.

  q_segment_ids [B,T], kv_segment_ids [B,S] (ints): attend only where equal. Passing
  only q_segment_ids means self-attention with the same ids (needs T == S).
  block_q, block_k: rows / keys per tile; None picks them from `default_blocks`.
  """
  if q_segment_ids is None and kv_segment_ids is not None:
    raise ValueError("xla_attention: kv_segment_ids given without q_segment_ids; pass both")
  if q_segment_ids is None:
    segment_ids = None
  elif kv_segment_ids is None:
    segment_ids = q_segment_ids
  else:
    segment_ids = (q_segment_ids, kv_segment_ids)
  q_seg, kv_seg = check_inputs(q, k, v, segment_ids)
  b, t, hq, d = q.shape
  auto_q, auto_k = default_blocks(b * hq)
  block_q = auto_q if block_q is None else block_q
  block_k = auto_k if block_k is None else block_k
  for name, block in (("block_q", block_q), ("block_k", block_k)):
    if not isinstance(block, int) or block < 1:
      raise ValueError(f"xla_attention: {name} must be a positive int or None; got {block!r}")
  s, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  scale = static_scale(sm_scale, d, "xla_attention")
  bq, nq = _balanced_block(t, block_q)
  bk, nk = _balanced_block(s, block_k)
  cfg = _Config(b, hkv, g, t, s, bq, bk, nq, nk, bool(causal), scale, q_seg is not None)

  q_IBKMD = (_pad(q, 1, nq * bq).reshape(b, nq, bq, hkv, g, d).transpose(1, 0, 3, 4, 2, 5)
             .reshape(nq, b, hkv, g * bq, d))
  k_JBKSD, v_JBKSD = ((_pad(x, 1, nk * bk).reshape(b, nk, bk, hkv, d).transpose(1, 0, 3, 2, 4)
                       .reshape(nk, b, hkv, bk, d)) for x in (k, v))
  if q_seg is None:
    qseg_IBQ = kvseg_JBS = None
  else:
    # Edge padding keeps the per-block id ranges tight; padded keys are masked by position.
    qseg_IBQ = _pad(q_seg.astype(jnp.int32), 1, nq * bq, "edge").reshape(b, nq, bq).swapaxes(0, 1)
    kvseg_JBS = _pad(kv_seg.astype(jnp.int32), 1, nk * bk, "edge").reshape(b, nk, bk).swapaxes(0, 1)
  out_IBKMD = _flash(cfg, q_IBKMD, k_JBKSD, v_JBKSD, qseg_IBQ, kvseg_JBS)
  out = (out_IBKMD.reshape(nq, b, hkv, g, bq, d).transpose(1, 0, 4, 2, 3, 5)
         .reshape(b, nq * bq, hq, d))
  return out[:, :t]


def default_blocks(rows: int) -> tuple[int, int]:
  """(block_q, block_k) for `rows` = B * Hq: powers of two, block_k = 2 * block_q, and
  rows * block_q * block_k <= TILE_ELEMENTS where possible (block_q in [16, 512])."""
  bq = 16
  while bq < 512 and rows * 2 * (2 * bq) ** 2 <= TILE_ELEMENTS:
    bq *= 2
  return bq, 2 * bq


def _balanced_block(n: int, block: int) -> tuple[int, int]:
  """(size, count) of blocks covering n: never more than `block` (rounded up to a multiple
  of 8), as even as possible, so padding is under one block; n <= block is one exact block."""
  count = -(-n // block)
  if count == 1:
    return n, 1
  size = -(-n // count)
  size = -(-size // 8) * 8 if block >= 8 else size
  return size, -(-n // size)


def _pad(x: jax.Array, axis: int, size: int, mode: str = "constant") -> jax.Array:
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, mode=mode)


def _index(x, i):
  return None if x is None else jax.lax.dynamic_index_in_dim(x, i, axis=0, keepdims=False)


# ----------------------------------------------------------------------------- masks, ranges


def _tile_mask(cfg: _Config, i, j, qseg_BQ, kvseg_BS) -> jax.Array | None:
  """Bool [B|1, bq, bk] (True = attend) for q block i and kv block j; None if all True."""
  mask = None
  kv_pos = j * cfg.bk + jnp.arange(cfg.bk)
  if cfg.nk * cfg.bk != cfg.s:  # padded keys exist (only in the last block, but cheap)
    mask = jnp.broadcast_to((kv_pos < cfg.s)[None, :], (cfg.bq, cfg.bk))
  if cfg.causal:
    q_pos = i * cfg.bq + jnp.arange(cfg.bq)
    c = (q_pos[:, None] + (cfg.s - cfg.t)) >= kv_pos[None, :]
    mask = c if mask is None else mask & c
  if mask is not None:
    mask = mask[None]
  if cfg.has_segments:
    same = qseg_BQ[:, :, None] == kvseg_BS[:, None, :]
    mask = same if mask is None else mask & same
  return mask


def _masked(cfg: _Config, s_BKMS, mask_BQS):
  """-inf where masked, for a [B, Hkv, M, bk] tile (M = G*bq)."""
  if mask_BQS is None:
    return s_BKMS
  s = s_BKMS.reshape(cfg.b, cfg.hkv, cfg.g, cfg.bq, cfg.bk)
  s = jnp.where(mask_BQS[:, None, None], s, -jnp.inf)
  return s.reshape(s_BKMS.shape)


def _masked_t(cfg: _Config, s_BKSM, mask_BQS):
  """-inf where masked, for a transposed [B, Hkv, bk, M] tile."""
  if mask_BQS is None:
    return s_BKSM
  s = s_BKSM.reshape(cfg.b, cfg.hkv, cfg.bk, cfg.g, cfg.bq)
  s = jnp.where(mask_BQS.swapaxes(1, 2)[:, None, :, None, :], s, -jnp.inf)
  return s.reshape(s_BKSM.shape)


def _block_ranges(cfg: _Config, qseg_IBQ, kvseg_JBS):
  """Loop bounds: per q block [lo, hi) over kv blocks; per kv block [lo, hi) over q blocks.

  The batch rows share one loop, so a tile is visited if it is visitable
  (`attention_blocks.visitable_blocks`) for some batch row.
  """
  swap = lambda x: None if x is None else x.swapaxes(0, 1)
  allowed = visitable_blocks(
      swap(qseg_IBQ), swap(kvseg_JBS), t=cfg.t, s=cfg.s, num_q_blocks=cfg.nq,
      num_kv_blocks=cfg.nk, block_q=cfg.bq, block_k=cfg.bk, causal=cfg.causal).any(0)
  return spans(allowed), spans(allowed.T)


def _loop(lo, hi, n: int, body, init):
  """fori_loop over [lo, hi); with one block, straight-line code (masks keep it exact)."""
  if n == 1:
    return body(0, init)
  return jax.lax.fori_loop(lo, hi, body, init)


# ----------------------------------------------------------------------------- forward


def _finite_or_zero(x):
  # A row whose keys so far are all masked has max -inf; using 0 there keeps exp() exact
  # zeros instead of NaN from (-inf) - (-inf).
  return jnp.where(x == -jnp.inf, 0.0, x)


def _forward(cfg: _Config, q_IBKMD, k_JBKSD, v_JBKSD, qseg_IBQ, kvseg_JBS):
  """(out [nq, B, Hkv, M, D] f32, lse [nq, B, Hkv, M] f32)."""
  (lo_I, hi_I), _ = _block_ranges(cfg, qseg_IBQ, kvseg_JBS)
  kT_JBKDS = k_JBKSD.swapaxes(-1, -2)
  b, kh, m_rows, d = q_IBKMD.shape[1:]

  def q_block(_, xs):
    i, q_BKMD, qseg_BQ, lo, hi = xs

    def kv_block(j, carry):
      m, l, acc = carry
      s = jnp.einsum("bkmd,bkds->bkms", q_BKMD, _index(kT_JBKDS, j),
                     preferred_element_type=jnp.float32) * cfg.scale
      s = _masked(cfg, s, _tile_mask(cfg, i, j, qseg_BQ, _index(kvseg_JBS, j)))
      m_new = jnp.maximum(m, s.max(-1))
      m_safe = _finite_or_zero(m_new)
      p = jnp.exp(s - m_safe[..., None])
      alpha = jnp.exp(m - m_safe)  # 0 while m is -inf
      v_j = _index(v_JBKSD, j)
      pv = jnp.einsum("bkms,bksd->bkmd", p.astype(v_j.dtype), v_j,
                      preferred_element_type=jnp.float32)
      return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

    init = (jnp.full((b, kh, m_rows), -jnp.inf, jnp.float32),
            jnp.zeros((b, kh, m_rows), jnp.float32), jnp.zeros((b, kh, m_rows, d), jnp.float32))
    m, l, acc = _loop(lo, hi, cfg.nk, kv_block, init)
    empty = l == 0  # nothing to attend to: output 0, lse 0 (its scores are all -inf)
    safe_l = jnp.where(empty, 1.0, l)
    out = acc * (1.0 / safe_l)[..., None]
    lse = jnp.where(empty, 0.0, _finite_or_zero(m) + jnp.log(safe_l))
    return None, (out, lse)

  xs = (jnp.arange(cfg.nq, dtype=jnp.int32), q_IBKMD, qseg_IBQ, lo_I, hi_I)
  if cfg.nq == 1:
    out, lse = q_block(None, jax.tree.map(lambda x: x[0], xs))[1]
    return out[None], lse[None]
  return jax.lax.scan(q_block, None, xs)[1]


# ----------------------------------------------------------------------------- backward


def _backward(cfg: _Config, q_IBKMD, k_JBKSD, v_JBKSD, qseg_IBQ, kvseg_JBS, lse_IBKM, do_IBKMD,
              delta_IBKM):
  """kv blocks outer (dk, dv accumulate locally), the q blocks that see them inner.

  Works on transposed tiles [B, Hkv, bk, M] so every matmul is canonical; dq is carried
  transposed, [nq, B, Hkv, D, M], and updated in place one q block at a time.
  """
  _, (lo_J, hi_J) = _block_ranges(cfg, qseg_IBQ, kvseg_JBS)
  qT_IBKDM = q_IBKMD.swapaxes(-1, -2)
  doT_IBKDM = do_IBKMD.swapaxes(-1, -2)
  kT_JBKDS = k_JBKSD.swapaxes(-1, -2)

  def kv_block(dqT, xs):
    j, k_BKSD, kT_BKDS, v_BKSD, kvseg_BS, lo, hi = xs

    def q_block(i, carry):
      dqT, dk, dv = carry
      q_BKMD, do_BKMD = _index(q_IBKMD, i), _index(do_IBKMD, i)
      sT = jnp.einsum("bksd,bkdm->bksm", k_BKSD, _index(qT_IBKDM, i),
                      preferred_element_type=jnp.float32) * cfg.scale
      sT = _masked_t(cfg, sT, _tile_mask(cfg, i, j, _index(qseg_IBQ, i), kvseg_BS))
      # Masked scores are -inf and lse is finite, so masked p are exact zeros.
      pT = jnp.exp(sT - _index(lse_IBKM, i)[..., None, :])
      dv = dv + jnp.einsum("bksm,bkmd->bksd", pT.astype(do_BKMD.dtype), do_BKMD,
                           preferred_element_type=jnp.float32)
      dpT = jnp.einsum("bksd,bkdm->bksm", v_BKSD, _index(doT_IBKDM, i),
                       preferred_element_type=jnp.float32)
      dsT = pT * (dpT - _index(delta_IBKM, i)[..., None, :]) * cfg.scale
      dk = dk + jnp.einsum("bksm,bkmd->bksd", dsT.astype(q_BKMD.dtype), q_BKMD,
                           preferred_element_type=jnp.float32)
      dqT_i = jnp.einsum("bkds,bksm->bkdm", kT_BKDS, dsT.astype(kT_BKDS.dtype),
                         preferred_element_type=jnp.float32)
      dqT = jax.lax.dynamic_update_index_in_dim(dqT, _index(dqT, i) + dqT_i, i, axis=0)
      return dqT, dk, dv

    init = (dqT, jnp.zeros(k_BKSD.shape, jnp.float32), jnp.zeros(v_BKSD.shape, jnp.float32))
    dqT, dk, dv = _loop(lo, hi, cfg.nq, q_block, init)
    return dqT, (dk, dv)

  dqT0 = jnp.zeros(qT_IBKDM.shape, jnp.float32)
  xs = (jnp.arange(cfg.nk, dtype=jnp.int32), k_JBKSD, kT_JBKDS, v_JBKSD, kvseg_JBS, lo_J, hi_J)
  if cfg.nk == 1:
    dqT, (dk, dv) = kv_block(dqT0, jax.tree.map(lambda x: x[0], xs))
    dk, dv = dk[None], dv[None]
  else:
    dqT, (dk, dv) = jax.lax.scan(kv_block, dqT0, xs)
  return dqT.swapaxes(-1, -2), dk, dv


# ----------------------------------------------------------------------------- custom vjp


def _single_tile(cfg: _Config, q_BKMD, k_BKSD, v_BKSD, qseg_BQ, kvseg_BS):
  """The whole problem as one tile, no loop: out f32 [B,Hkv,M,D], normalised p f32 [B,Hkv,M,S]."""
  s = jnp.einsum("bkmd,bksd->bkms", q_BKMD, k_BKSD, preferred_element_type=jnp.float32) * cfg.scale
  s = _masked(cfg, s, _tile_mask(cfg, 0, 0, qseg_BQ, kvseg_BS))
  p = jnp.exp(s - _finite_or_zero(s.max(-1))[..., None])
  l = p.sum(-1)
  p = p * jnp.where(l == 0, 0.0, 1.0 / jnp.where(l == 0, 1.0, l))[..., None]
  out = jnp.einsum("bkms,bksd->bkmd", p.astype(v_BKSD.dtype), v_BKSD, preferred_element_type=jnp.float32)
  return out, p


def _single_tile_bwd(cfg: _Config, q_BKMD, k_BKSD, v_BKSD, p, do_BKMD, delta_BKM):
  """One tile from the saved probabilities: the dense backward, nothing recomputed."""
  dv = jnp.einsum("bkms,bkmd->bksd", p.astype(do_BKMD.dtype), do_BKMD, preferred_element_type=jnp.float32)
  dp = jnp.einsum("bkmd,bksd->bkms", do_BKMD, v_BKSD, preferred_element_type=jnp.float32)
  ds = p * (dp - delta_BKM[..., None]) * cfg.scale
  dq = jnp.einsum("bkms,bksd->bkmd", ds.astype(k_BKSD.dtype), k_BKSD, preferred_element_type=jnp.float32)
  dk = jnp.einsum("bkms,bkmd->bksd", ds.astype(q_BKMD.dtype), q_BKMD, preferred_element_type=jnp.float32)
  return dq, dk, dv


def _one_tile(cfg: _Config) -> bool:
  return cfg.nq == 1 and cfg.nk == 1


def _first(x):
  return None if x is None else x[0]


# ----------------------------------------------------------------------------- custom vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, qseg, kvseg):
  if _one_tile(cfg):
    out = _single_tile(cfg, q[0], k[0], v[0], _first(qseg), _first(kvseg))[0][None]
  else:
    out = _forward(cfg, q, k, v, qseg, kvseg)[0]
  return out.astype(q.dtype)


def _flash_fwd(cfg, q, k, v, qseg, kvseg):
  if _one_tile(cfg):
    # Keeping p (one [T, S] tile, bounded by block_q * block_k) saves recomputing it.
    out, p_or_lse = _single_tile(cfg, q[0], k[0], v[0], _first(qseg), _first(kvseg))
    out = out[None]
  else:
    out, p_or_lse = _forward(cfg, q, k, v, qseg, kvseg)
  out = out.astype(q.dtype)
  return out, (q, k, v, qseg, kvseg, out, p_or_lse)


def _flash_bwd(cfg, res, d_out):
  q, k, v, qseg, kvseg, out, p_or_lse = res
  # delta = rowsum(dO * O) = sum_s p * dp per query row.
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  if _one_tile(cfg):
    dq, dk, dv = (x[None] for x in _single_tile_bwd(cfg, q[0], k[0], v[0], p_or_lse, d_out[0],
                                                    delta[0]))
  else:
    dq, dk, dv = _backward(cfg, q, k, v, qseg, kvseg, p_or_lse, d_out, delta)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
