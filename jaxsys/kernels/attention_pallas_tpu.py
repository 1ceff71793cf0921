"""Flash attention in Pallas for TPU (Mosaic lowering), run in interpret mode on CPU.

`pallas_tpu_attention(q, k, v, ...)` has the semantics of
`jaxsys.kernels.attention.reference_attention` and the contract of the GPU kernel
`jaxsys.kernels.attention_pallas.pallas_attention`: q [B, T, Hq, D], k/v [B, S, Hkv, D],
GQA (q head h reads kv head h // (Hq // Hkv)), optional segment ids, causal masking with
queries aligned to the END of the keys, an optional sliding window (query i sees only keys
j > i - window), and rows with nothing to attend to give zeros (values and gradients).

Structure (the Mosaic style of jax's `ops/tpu/flash_attention.py` and splash attention):
- Layout [B, H, T, D] with D padded to a multiple of 128 (lanes); blocks of block_q rows
  (a multiple of 8, sublanes) and block_k keys (a multiple of 128: keys lie on the lanes
  of the [block_q, block_k] score tile).
- forward: grid (batch, q heads, q blocks, kv blocks), the kv axis innermost and
  "arbitrary"; the online-softmax state (m, l, acc) lives in VMEM scratch, is reset at
  kv block 0 and written out at the last kv block. m and l are [block_q, 128]
  (lane-replicated) so no per-step relayout is needed.
- backward: delta = rowsum(dO * O) in XLA; a dq kernel with the forward's grid, and a
  dk/dv kernel with grid (batch, kv heads, kv blocks, group, q blocks) that accumulates
  over the G q heads sharing a kv head and over q blocks. It computes the transposed
  scores [block_k, block_q] (as splash attention does), so every matmul is NN or NT and
  no [block_q, block_k] tile is transposed; its q block is therefore a multiple of 128.
- block skipping: the per-block ranges from `attention_blocks.block_ranges` (kv range
  per q block, q range per kv block) arrive by scalar prefetch in SMEM. A grid step
  outside the range does no compute (`pl.when`), and the index maps clamp the block
  index into the range, so the skipped steps ask for the block already resident (the
  pipeline issues no DMA) and the first needed block is fetched ahead of time.

Example:
  out = pallas_tpu_attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids, causal=True)
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxsys.kernels.backends import (ARBITRARY as _ARBITRARY, PARALLEL as _PARALLEL,
                                    SQUEEZED as _SQUEEZED,
                                    TpuParams as _CompilerParams, pltpu)
from jaxsys.kernels.attention_blocks import (FlashConfig, check_block, check_pallas_inputs,
                                           check_window, flash_vjp, padded_ids_and_ranges)

NUM_LANES = 128
NUM_SUBLANES = 8
_DTYPES = (jnp.float32, jnp.bfloat16)
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b

def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def default_blocks(t: int, s: int, d: int) -> tuple[int, int]:
  """(block_q, block_k): 256 x 256 up to D=128 and 128 x 128 beyond, shrunk to short inputs.

  Blocks never exceed the sequence rounded up to 128, so short inputs are not padded to
  a large block.
  """
  size = 256 if d <= 128 else 128
  return min(size, _round_up(t, NUM_LANES)), min(size, _round_up(s, NUM_LANES))


def _check_block(name: str, value, multiple: int, why: str) -> int:
  return check_block("pallas_tpu_attention", name, value, lambda n: n % multiple == 0,
                     f"a positive multiple of {multiple} ({why})")


@dataclasses.dataclass(frozen=True)
class _Config(FlashConfig):
  """The TPU kernels' static parameters. block_q_dkv: queries lie on the lanes of the
  dk/dv kernel, so a multiple of 128. interpret: False (Mosaic), True or InterpretParams."""
  q_len: int           # unpadded T; rows at or past it are padding
  num_q_blocks: int
  num_kv_blocks: int
  num_q_blocks_dkv: int

  @property
  def q_padded(self) -> bool:
    return self.num_q_blocks * self.block_q != self.q_len

  @property
  def kv_padded(self) -> bool:
    return self.num_kv_blocks * self.block_k != self.kv_len

  @property
  def masked(self) -> bool:
    return self.causal or self.has_segments or self.q_padded or self.kv_padded


# ----------------------------------------------------------------------------- helpers


def _clamp_block(idx, lo, hi):
  """idx clamped into the visited range [lo, hi) (to lo when the range is empty).

  Used by the index maps: before the range it prefetches block lo, after it it repeats
  block hi - 1, so a skipped grid step names the block already in VMEM and no DMA starts.
  """
  return jnp.minimum(jnp.maximum(idx, lo), jnp.maximum(hi - 1, lo))


def _kv_head(h, groups: int):
  return h if groups == 1 else lax.div(h, groups)


def _dot(a, b, dims):
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _lanes(x, n: int):
  """[rows, 128] lane-replicated -> [rows, n] (n a multiple of 128), as jnp.tile does."""
  reps = n // NUM_LANES
  return x if reps == 1 else jnp.tile(x, (1, reps))


def _tile_needs_mask(cfg: _Config, q_start, k_start, bq: int, bk: int):
  """Scalar: whether tile (q_start, k_start) may hold a masked pair.

  Segment tiles are always masked; causal and padding tiles only when the tile crosses
  the diagonal or the padding, so interior tiles skip the elementwise mask.
  """
  if cfg.has_segments:
    return True
  full = True
  if cfg.causal:  # the tile's first query sees its last key
    full = jnp.logical_and(full, q_start + cfg.offset >= k_start + bk - 1)
  if cfg.window:  # the tile's last query's window still holds its first key
    full = jnp.logical_and(full, q_start + bq - 1 + cfg.offset - cfg.window < k_start)
  if cfg.q_padded:
    full = jnp.logical_and(full, q_start + bq <= cfg.q_len)
  if cfg.kv_padded:
    full = jnp.logical_and(full, k_start + bk <= cfg.kv_len)
  return jnp.logical_not(full)


def _element_mask(cfg: _Config, q_pos, k_pos, same_segment):
  """Boolean tile (True = attend) from broadcast positions and the segment test."""
  mask = same_segment
  def both(a, b):
    return b if a is None else jnp.logical_and(a, b)
  if cfg.causal:
    mask = both(mask, q_pos + cfg.offset >= k_pos)
    if cfg.window:
      mask = both(mask, q_pos + (cfg.offset - cfg.window) < k_pos)
  elif cfg.kv_padded:  # causal already excludes padded keys for every real query
    mask = both(mask, k_pos < cfg.kv_len)
  if cfg.q_padded:  # padded queries attend nothing: exact zeros, no stray gradients
    mask = both(mask, q_pos < cfg.q_len)
  return mask


def _scores(cfg: _Config, q_ref, k_ref, q_ids_ref, kv_ids_ref, q_start, k_start, masked: bool):
  """Scaled scores [block_q, block_k] f32 of a forward/dq tile, -inf where masked."""
  bq, bk = cfg.block_q, cfg.block_k
  s = _dot(q_ref[...], k_ref[...], _NT) * cfg.scale
  if not masked:
    return s
  same = None
  if cfg.has_segments:
    same = _lanes(q_ids_ref[...], bk) == kv_ids_ref[:1, :]
  q_pos = q_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  k_pos = k_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  return jnp.where(_element_mask(cfg, q_pos, k_pos, same), s, -jnp.inf)


def _when_tile(run, needs_mask, body):
  """Runs body(masked) under pl.when: a masked and an unmasked variant when it can vary."""
  if isinstance(needs_mask, bool):
    pl.when(run)(functools.partial(body, needs_mask))
    return
  pl.when(jnp.logical_and(run, needs_mask))(functools.partial(body, True))
  pl.when(jnp.logical_and(run, jnp.logical_not(needs_mask)))(functools.partial(body, False))


# ----------------------------------------------------------------------------- kernels


def _fwd_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, *rest, cfg: _Config):
  if cfg.has_segments:
    q_ids_ref, kv_ids_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr = rest
  else:
    (o_ref, lse_ref, m_scr, l_scr, acc_scr), q_ids_ref, kv_ids_ref = rest, None, None
  bq, bk = cfg.block_q, cfg.block_k
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  row = b * cfg.num_q_blocks + i
  lo, hi = lo_ref[row], hi_ref[row]
  q_start, k_start = i * bq, j * bk
  dp = acc_scr.shape[-1]

  @pl.when(j == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  def body(masked: bool):
    s = _scores(cfg, q_ref, k_ref, q_ids_ref, kv_ids_ref, q_start, k_start, masked)
    m_prev, l_prev = m_scr[...], l_scr[...]  # [bq, 128]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1)[:, None])
    # A row masked so far has max -inf: subtract 0 there, so exp gives exact zeros.
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - _lanes(m_safe, bk))
    l_scr[...] = alpha * l_prev + lax.broadcast_in_dim(jnp.sum(p, axis=1), l_prev.shape, (0,))
    m_scr[...] = m_next
    v = v_ref[...]
    acc_scr[...] = acc_scr[...] * _lanes(alpha, dp) + _dot(p.astype(v.dtype), v, _NN)

  run = jnp.logical_and(j >= lo, j < hi)
  needs_mask = _tile_needs_mask(cfg, q_start, k_start, bq, bk) if cfg.masked else False
  _when_tile(run, needs_mask, body)

  @pl.when(j == cfg.num_kv_blocks - 1)
  def _finalize():
    l = l_scr[...]
    empty = l == 0.0  # nothing to attend to: acc is 0, output zeros
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc_scr[...] / _lanes(l_safe, dp)).astype(o_ref.dtype)
    # +inf for empty rows makes every backward probability exp(s - lse) exactly 0.
    lse_ref[...] = jnp.where(empty, jnp.inf, m_scr[...] + jnp.log(l_safe))


def _dq_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest,
               cfg: _Config):
  if cfg.has_segments:
    q_ids_ref, kv_ids_ref, dq_ref, dq_scr = rest
  else:
    (dq_ref, dq_scr), q_ids_ref, kv_ids_ref = rest, None, None
  bq, bk = cfg.block_q, cfg.block_k
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  row = b * cfg.num_q_blocks + i
  lo, hi = lo_ref[row], hi_ref[row]
  q_start, k_start = i * bq, j * bk

  @pl.when(j == 0)
  def _init():
    dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

  def body(masked: bool):
    s = _scores(cfg, q_ref, k_ref, q_ids_ref, kv_ids_ref, q_start, k_start, masked)
    p = jnp.exp(s - _lanes(lse_ref[...], bk))  # [bq, bk]
    dp = _dot(do_ref[...], v_ref[...], _NT)
    ds = p * (dp - _lanes(delta_ref[...], bk))
    k = k_ref[...]
    dq_scr[...] += _dot(ds.astype(k.dtype), k, _NN)

  run = jnp.logical_and(j >= lo, j < hi)
  needs_mask = _tile_needs_mask(cfg, q_start, k_start, bq, bk) if cfg.masked else False
  _when_tile(run, needs_mask, body)

  @pl.when(j == cfg.num_kv_blocks - 1)
  def _finalize():
    # The softmax scale multiplies every logit; apply it once to the sum.
    dq_ref[...] = (dq_scr[...] * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest,
                cfg: _Config):
  if cfg.has_segments:
    q_ids_ref, kv_ids_ref, dk_ref, dv_ref, dk_scr, dv_scr = rest
  else:
    dk_ref, dv_ref, dk_scr, dv_scr = rest
  bq, bk = cfg.block_q_dkv, cfg.block_k
  b, j, g, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
  row = b * cfg.num_kv_blocks + j
  lo, hi = lo_ref[row], hi_ref[row]
  q_start, k_start = i * bq, j * bk

  @pl.when(jnp.logical_and(g == 0, i == 0))
  def _init():
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

  def body(masked: bool):
    # Transposed scores [bk, bq]: keys on sublanes, queries on lanes, so dv = p^T dO
    # and dk = ds^T q are plain NN matmuls.
    q = q_ref[...]
    s = _dot(k_ref[...], q, _NT) * cfg.scale
    if masked:
      same = None
      if cfg.has_segments:
        same = _lanes(kv_ids_ref[...], bq) == q_ids_ref[:1, :]
      k_pos = k_start + lax.broadcasted_iota(jnp.int32, (bk, bq), 0)
      q_pos = q_start + lax.broadcasted_iota(jnp.int32, (bk, bq), 1)
      s = jnp.where(_element_mask(cfg, q_pos, k_pos, same), s, -jnp.inf)
    p = jnp.exp(s - lse_ref[:1, :])  # [bk, bq]
    do = do_ref[...]
    dv_scr[...] += _dot(p.astype(do.dtype), do, _NN)
    dp = _dot(v_ref[...], do, _NT)
    ds = p * (dp - delta_ref[:1, :])
    dk_scr[...] += _dot(ds.astype(q.dtype), q, _NN)

  run = jnp.logical_and(i >= lo, i < hi)
  needs_mask = _tile_needs_mask(cfg, q_start, k_start, bq, bk) if cfg.masked else False
  _when_tile(run, needs_mask, body)

  @pl.when(jnp.logical_and(g == cfg.groups - 1, i == cfg.num_q_blocks_dkv - 1))
  def _finalize():
    dk_ref[...] = (dk_scr[...] * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- specs


def _fwd_specs(cfg: _Config, dp: int):
  """BlockSpecs shared by the forward and dq kernels: grid (b, h, i, j), kv ranges in SMEM."""
  bq, bk, nq, g, sq = cfg.block_q, cfg.block_k, cfg.num_q_blocks, cfg.groups, _SQUEEZED

  def kv_block(b, i, j, lo_ref, hi_ref):
    row = b * nq + i
    return _clamp_block(j, lo_ref[row], hi_ref[row])

  q_spec = pl.BlockSpec((sq, sq, bq, dp), lambda b, h, i, j, lo, hi: (b, h, i, 0))
  kv_spec = pl.BlockSpec(
      (sq, sq, bk, dp),
      lambda b, h, i, j, lo, hi: (b, _kv_head(h, g), kv_block(b, i, j, lo, hi), 0))
  row_spec = pl.BlockSpec((sq, sq, bq, NUM_LANES), lambda b, h, i, j, lo, hi: (b, h, i, 0))
  q_ids_spec = pl.BlockSpec((sq, bq, NUM_LANES), lambda b, h, i, j, lo, hi: (b, i, 0))
  kv_ids_spec = pl.BlockSpec(
      (sq, NUM_SUBLANES, bk), lambda b, h, i, j, lo, hi: (b, 0, kv_block(b, i, j, lo, hi)))
  return q_spec, kv_spec, row_spec, q_ids_spec, kv_ids_spec


def _dkv_specs(cfg: _Config, dp: int):
  """BlockSpecs of the dk/dv kernel: grid (b, kv head, j, group, i), q ranges in SMEM."""
  bq, bk, nk, g, sq = cfg.block_q_dkv, cfg.block_k, cfg.num_kv_blocks, cfg.groups, _SQUEEZED

  def q_block(b, j, i, lo_ref, hi_ref):
    row = b * nk + j
    return _clamp_block(i, lo_ref[row], hi_ref[row])

  q_spec = pl.BlockSpec(
      (sq, sq, bq, dp),
      lambda b, h, j, gi, i, lo, hi: (b, h * g + gi, q_block(b, j, i, lo, hi), 0))
  kv_spec = pl.BlockSpec((sq, sq, bk, dp), lambda b, h, j, gi, i, lo, hi: (b, h, j, 0))
  row_spec = pl.BlockSpec(
      (sq, sq, NUM_SUBLANES, bq),
      lambda b, h, j, gi, i, lo, hi: (b, h * g + gi, 0, q_block(b, j, i, lo, hi)))
  q_ids_spec = pl.BlockSpec(
      (sq, NUM_SUBLANES, bq), lambda b, h, j, gi, i, lo, hi: (b, 0, q_block(b, j, i, lo, hi)))
  kv_ids_spec = pl.BlockSpec((sq, bk, NUM_LANES), lambda b, h, j, gi, i, lo, hi: (b, j, 0))
  return q_spec, kv_spec, row_spec, q_ids_spec, kv_ids_spec


def _columns(x, n: int):
  """[B, (H,) T] -> [B, (H,) T, n]: one value per row, replicated on the lanes."""
  return jnp.broadcast_to(x[..., None], (*x.shape, n))


def _rows(x):
  """[B, (H,) T] -> [B, (H,) 8, T]: one value per column, replicated on the sublanes."""
  return jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], NUM_SUBLANES, x.shape[-1]))


def _cost(cfg: _Config, flops_per_pair: int, q, *arrays):
  # The (query, key) pairs the mask leaves without segments: all of them, or under causal
  # masking each query's keys up to its own position. With segments, an upper bound (what
  # they mask is data-dependent).
  b, hq, _, dp = q.shape
  t, s = cfg.q_len, cfg.kv_len
  lo = lambda i: max(i + cfg.offset - cfg.window + 1, 0) if cfg.window else 0
  per_row = (sum(max(min(i + cfg.offset + 1, s) - lo(i), 0) for i in range(t)) if cfg.causal
             else t * s)
  pairs = b * hq * per_row
  return pl.CostEstimate(flops=flops_per_pair * pairs * dp, transcendentals=pairs,
                         bytes_accessed=sum(x.size * x.dtype.itemsize for x in arrays))


def _call(kernel, cfg: _Config, name: str, *, grid, semantics, ranges, in_specs, args,
          out_specs, out_shape, scratch, cost):
  """One Mosaic kernel: the two block-range arrays are scalar-prefetched into SMEM."""
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=grid, in_specs=in_specs, out_specs=out_specs,
          scratch_shapes=[pltpu.VMEM(shape, jnp.float32) for shape in scratch]),
      out_shape=out_shape,
      # Interpret mode reads the semantics too: it visits "parallel" axes in a random order.
      compiler_params=_CompilerParams(dimension_semantics=semantics),
      cost_estimate=cost,
      interpret=cfg.interpret,
      name=name,
  )(*ranges, *args)


_Q_MAJOR = (_PARALLEL, _PARALLEL, _PARALLEL, _ARBITRARY)  # grid (b, h, i, j): j accumulates


def _fwd_call(cfg: _Config, q, k, v, q_ids, kv_ids, kv_lo, kv_hi):
  b, hq, tp, dp = q.shape
  q_spec, kv_spec, row_spec, q_ids_spec, kv_ids_spec = _fwd_specs(cfg, dp)
  in_specs, args = [q_spec, kv_spec, kv_spec], [q, k, v]
  if cfg.has_segments:
    in_specs += [q_ids_spec, kv_ids_spec]
    args += [_columns(q_ids, NUM_LANES), _rows(kv_ids)]
  o, lse = _call(
      _fwd_kernel, cfg, "jaxsys_tpu_flash_fwd",
      grid=(b, hq, cfg.num_q_blocks, cfg.num_kv_blocks), semantics=_Q_MAJOR,
      ranges=(kv_lo, kv_hi), in_specs=in_specs, args=args, out_specs=[q_spec, row_spec],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, hq, tp, NUM_LANES), jnp.float32)],
      scratch=[(cfg.block_q, NUM_LANES), (cfg.block_q, NUM_LANES), (cfg.block_q, dp)],
      cost=_cost(cfg, 4, q, q, k, v, q))
  return o, lse[..., 0]


def _dq_call(cfg: _Config, q, k, v, do, lse, delta, q_ids, kv_ids, kv_lo, kv_hi):
  b, hq, tp, dp = q.shape
  q_spec, kv_spec, row_spec, q_ids_spec, kv_ids_spec = _fwd_specs(cfg, dp)
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
  args = [q, k, v, do, _columns(lse, NUM_LANES), _columns(delta, NUM_LANES)]
  if cfg.has_segments:
    in_specs += [q_ids_spec, kv_ids_spec]
    args += [_columns(q_ids, NUM_LANES), _rows(kv_ids)]
  return _call(
      _dq_kernel, cfg, "jaxsys_tpu_flash_dq",
      grid=(b, hq, cfg.num_q_blocks, cfg.num_kv_blocks), semantics=_Q_MAJOR,
      ranges=(kv_lo, kv_hi), in_specs=in_specs, args=args, out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), scratch=[(cfg.block_q, dp)],
      cost=_cost(cfg, 6, q, q, k, v, do, q))


def _dkv_call(cfg: _Config, q, k, v, do, lse, delta, q_ids, kv_ids, q_lo, q_hi):
  b, hkv, sp, dp = k.shape
  q_spec, kv_spec, row_spec, q_ids_spec, kv_ids_spec = _dkv_specs(cfg, dp)
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
  args = [q, k, v, do, _rows(lse), _rows(delta)]
  if cfg.has_segments:
    in_specs += [q_ids_spec, kv_ids_spec]
    args += [_rows(q_ids), _columns(kv_ids, NUM_LANES)]
  return _call(
      _dkv_kernel, cfg, "jaxsys_tpu_flash_dkv",
      grid=(b, hkv, cfg.num_kv_blocks, cfg.groups, cfg.num_q_blocks_dkv),
      # The group and q-block axes both accumulate into the same dk/dv block.
      semantics=(_PARALLEL, _PARALLEL, _PARALLEL, _ARBITRARY, _ARBITRARY),
      ranges=(q_lo, q_hi), in_specs=in_specs, args=args, out_specs=[kv_spec, kv_spec],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      scratch=[(cfg.block_k, dp), (cfg.block_k, dp)], cost=_cost(cfg, 8, q, q, k, v, do, k, v))


_flash = flash_vjp(_fwd_call, _dq_call, _dkv_call, layout="bhtd")


# ----------------------------------------------------------------------------- entry


def pallas_tpu_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                         q_segment_ids: jax.Array | None = None,
                         kv_segment_ids: jax.Array | None = None,
                         causal: bool = True, sm_scale: float | None = None,
                         block_q: int | None = None, block_k: int | None = None,
                         interpret: bool | Any | None = None, window: int = 0) -> jax.Array:
  """Flash attention, same values as `reference_attention`; [B,T,Hq,D] in q.dtype.

  Differentiable in q, k, v (Pallas backward). Any T and S (padded inside to the
  blocks), any D (padded to a multiple of 128). block_q: a multiple of 8, block_k: a
  multiple of 128 (default `default_blocks`). `interpret` as in `backends.resolve_interpret`:
  None compiles with Mosaic on TPU and interprets on CPU; False always emits the Mosaic
  kernels (e.g. to `jax.export` for TPU from a CPU host); a `pltpu.InterpretParams`
  simulates the TPU pipeline (VMEM, block copies, grid order).
  """
  q_seg, kv_seg, interpret, scale = check_pallas_inputs(
      "pallas_tpu_attention", "tpu", q, k, v, q_segment_ids, kv_segment_ids, _DTYPES,
      interpret=interpret, sm_scale=sm_scale)
  window = check_window("pallas_tpu_attention", window, causal)
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  default_q, default_k = default_blocks(t, s, d)
  block_q = _check_block("block_q", default_q if block_q is None else block_q,
                         NUM_SUBLANES, "TPU sublanes")
  block_k = _check_block("block_k", default_k if block_k is None else block_k,
                         NUM_LANES, "TPU lanes: keys lie on the lanes of the score tile")

  if t == 0 or s == 0:  # no query or no key: every row is empty
    return jnp.zeros(q.shape, q.dtype)
  cfg = _plan(t, s, d, groups=hq // hkv, block_q=block_q, block_k=block_k, causal=causal,
              scale=scale, has_segments=q_seg is not None, interpret=interpret, window=window)
  tp, sp = cfg.num_q_blocks * block_q, cfg.num_kv_blocks * block_k
  dp = _round_up(d, NUM_LANES)
  # [B, T, H, D] -> [B, H, Tp, Dp]: the sequence on sublanes and D on lanes. Zero columns
  # of q and k add nothing to the logits; zero columns of v are sliced off.
  def layout(x, n, n_pad):
    return jnp.pad(x, ((0, 0), (0, n_pad - n), (0, 0), (0, dp - d))).transpose(0, 2, 1, 3)
  q_p, k_p, v_p = layout(q, t, tp), layout(k, s, sp), layout(v, s, sp)
  q_ids, kv_ids, ranges = padded_ids_and_ranges(
      q_seg, kv_seg, t=t, s=s, padded_t=tp, padded_s=sp, block_q=block_q,
      block_q_dkv=cfg.block_q_dkv, block_k=block_k, causal=cfg.causal, batch=b, window=window)
  # 1-D int32 in SMEM (2-D SMEM arrays pad their minor dimension).
  flat = lambda x: x.reshape(-1).astype(jnp.int32)
  out = _flash(cfg, q_p, k_p, v_p, q_ids, kv_ids, tuple(map(flat, ranges)))
  return out.transpose(0, 2, 1, 3)[:, :t, :, :d]


def _plan(t: int, s: int, d: int, *, groups: int, block_q: int, block_k: int, causal: bool,
          scale: float, has_segments: bool, interpret, window: int = 0) -> _Config:
  """The static configuration: padded lengths (as block counts) and block sizes."""
  # The dk/dv kernel puts queries on the lanes: its q block is a multiple of 128, and
  # the padded T is a multiple of both q blocks.
  block_q_dkv = block_q if block_q % NUM_LANES == 0 else NUM_LANES
  tp = _round_up(t, math.lcm(block_q, block_q_dkv))
  sp = _round_up(s, block_k)
  return _Config(
      scale=scale, causal=bool(causal), offset=s - t, window=window, q_len=t, kv_len=s,
      has_segments=has_segments, groups=groups, block_q=block_q, block_k=block_k,
      block_q_dkv=block_q_dkv, num_q_blocks=tp // block_q, num_kv_blocks=sp // block_k,
      num_q_blocks_dkv=tp // block_q_dkv, interpret=interpret)
