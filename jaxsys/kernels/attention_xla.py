"""Blockwise (flash-style) attention in pure JAX: memory linear in T, forward and backward.

`xla_attention` has the semantics of `attention.reference_attention` (causal queries
aligned to the end of the keys, an optional sliding window, segment ids, GQA, zeros for
rows with nothing to attend to) but never builds the [T, S] score matrix. q is cut into `block_q` rows and k/v into
`block_k` keys; for every q block a loop runs over only the kv blocks that can hold an
unmasked pair (causal structure, the sliding window's band and, for packed segment ids,
the overlap of per-block min/max ids), carrying an online softmax (running max, denominator, f32 accumulator).
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

Callers that merge partial results (ring attention, jaxsys.parallel.context) use the
two lower-level entries: `forward_with_lse` returns the f32 output and per-row
logsumexp (-inf for rows with nothing to attend to), `backward_from_lse` takes dO and
a logsumexp and delta computed elsewhere (the whole row's, not this call's) and returns
f32 dq, dk, dv. Both also take per-token causal keys (q_positions, kv_positions: query
i sees key j iff q_positions[i] >= kv_positions[j]), which need not be monotone; tiles
are then skipped by their min/max keys, as for segment ids.
`plan_tiles`, `to_q_input`, `blocked_forward` and `blocked_backward` are the same
kernel for callers that call it many times on same-shape inputs: they keep inputs and
accumulators in the block layout across calls, and the kernel re-lays q and dO and
transposes k one tile at a time (`tile_transpose`) instead of copying whole arrays per
call. `visited_tiles` counts the tiles a call visits.

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
from jax.ad_checkpoint import checkpoint_name

from jaxsys.kernels.attention_inputs import check_inputs, static_scale
from jaxsys.kernels.attention_blocks import check_window, spans, visitable_blocks

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
  has_positions: bool = False  # causal by per-token keys, not by index
  # Re-lay q and dO (`to_q_input`) and transpose k, q, dO one tile at a time instead of
  # whole arrays up front: no full copies, for callers that run many calls (ring steps).
  tile_transpose: bool = False
  window: int = 0  # > 0: a query sees only the keys within `window` of it (causal only)


class _Keys(NamedTuple):
  """One side's per-token keys cut into blocks, [n, B, block] int32 (edge-padded), or None."""
  seg: jax.Array | None
  pos: jax.Array | None


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                  q_segment_ids: jax.Array | None = None,
                  kv_segment_ids: jax.Array | None = None,
                  causal: bool = True, sm_scale: float | None = None,
                  block_q: int | None = None, block_k: int | None = None,
                  q_positions: jax.Array | None = None,
                  kv_positions: jax.Array | None = None, window: int = 0) -> jax.Array:
  """Blockwise attention, q [B,T,Hq,D], k/v [B,S,Hkv,D] -> [B,T,Hq,D] in q.dtype.

  q_segment_ids [B,T], kv_segment_ids [B,S] (ints): attend only where equal. Passing
  only q_segment_ids means self-attention with the same ids (needs T == S).
  block_q, block_k: rows / keys per tile; None picks them from `default_blocks`.
  q_positions [B,T], kv_positions [B,S] (both or neither, used when causal): per-token
  causal keys replacing the end-aligned index, tokens in any order.
  window > 0 (causal only): query i sees key j only if j > i - window (by index, or by
  positions: q_positions[i] - window < kv_positions[j]), transformers' sliding_window.
  """
  if q_segment_ids is None and kv_segment_ids is not None:
    raise ValueError("xla_attention: kv_segment_ids given without q_segment_ids; pass both")
  cfg, q_IBKMD, k_JBKSD, v_JBKSD, q_keys, kv_keys = _prepare(
      "xla_attention", q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
      causal, sm_scale, block_q, block_k, window)
  return from_q_blocks(cfg, _flash(cfg, q_IBKMD, k_JBKSD, v_JBKSD, q_keys, kv_keys))


def forward_with_lse(q, k, v, *, q_segment_ids=None, kv_segment_ids=None, q_positions=None,
                     kv_positions=None, causal: bool = True, sm_scale: float | None = None,
                     block_q: int | None = None, block_k: int | None = None, window: int = 0):
  """(out [B,T,Hq,D] f32, lse [B,T,Hq] f32): the blockwise forward, not differentiable.

  lse is -inf for rows with nothing to attend to (their output is 0), so partial
  results over disjoint key sets merge by log-sum-exp. Segment ids as `xla_attention`
  (both or neither); q_positions [B,T], kv_positions [B,S] (both or neither, used when
  causal): per-token causal keys replacing the end-aligned index.
  """
  cfg, q_IBKMD, k_JBKSD, v_JBKSD, q_keys, kv_keys = _prepare(
      "forward_with_lse", q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
      causal, sm_scale, block_q, block_k, window)
  out, lse = _forward(cfg, q_IBKMD, k_JBKSD, v_JBKSD, q_keys, kv_keys)
  return from_q_blocks(cfg, out), from_q_blocks(cfg, lse[..., None])[..., 0]


def backward_from_lse(q, k, v, d_out, lse, delta, *, q_segment_ids=None, kv_segment_ids=None,
                      q_positions=None, kv_positions=None, causal: bool = True,
                      sm_scale: float | None = None, block_q: int | None = None,
                      block_k: int | None = None, window: int = 0):
  """f32 (dq, dk, dv) of the attention of q to these keys, given the row statistics.

  d_out [B,T,Hq,D]; lse, delta [B,T,Hq] f32: the logsumexp of each query row's scores
  and rowsum(dO * O) of its output, both over all the keys the row attends to (which
  may be more than k holds). lse must be finite: pass 0 for rows with no key at all.
  Other arguments as `forward_with_lse`.
  """
  cfg, q_IBKMD, k_JBKSD, v_JBKSD, q_keys, kv_keys = _prepare(
      "backward_from_lse", q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
      causal, sm_scale, block_q, block_k, window)
  if d_out.shape != q.shape or lse.shape != q.shape[:3] or delta.shape != q.shape[:3]:
    raise ValueError(f"backward_from_lse: d_out must be q's shape {q.shape} and lse, delta "
                     f"[B, T, Hq]={q.shape[:3]}; got d_out{d_out.shape} lse{lse.shape} "
                     f"delta{delta.shape}")
  rows = lambda x: to_q_blocks(cfg, x[..., None].astype(jnp.float32))[..., 0]
  dqT, dk, dv = _backward(cfg, q_IBKMD, k_JBKSD, v_JBKSD, q_keys, kv_keys, rows(lse),
                          to_q_blocks(cfg, d_out.astype(q.dtype)), rows(delta))
  return from_q_blocks(cfg, dqT.swapaxes(-1, -2)), from_kv_blocks(cfg, dk), from_kv_blocks(cfg, dv)


# ------------------------------------------------------------------- block-layout entries
# For callers that run the kernel many times on same-shape inputs (ring attention's
# steps): convert to the block layout once, keep accumulators in it, and let the kernel
# transpose per tile, so a step allocates nothing of the inputs' size.


def plan_tiles(q, k, *, q_segment_ids=None, kv_segment_ids=None, q_positions=None,
               kv_positions=None, causal: bool = True, sm_scale: float | None = None,
               block_q: int | None = None, block_k: int | None = None,
               window: int = 0) -> _Config:
  """The static tiling of q [B,T,Hq,D] (or a ShapeDtypeStruct) against k [B,S,Hkv,D] for
  the block-layout entries (tile_transpose on); which keys are given (arrays or
  ShapeDtypeStructs) fixes which masks the tiles build."""
  return _plan("plan_tiles", q, k, k, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
               causal, sm_scale, block_q, block_k, window)[0]._replace(tile_transpose=True)


def key_blocks(cfg: _Config, segment_ids, positions, side: str) -> _Keys:
  """[B, T] (side "q") or [B, S] ("kv") segment ids and positions (or None) in blocks."""
  n, size = (cfg.nq, cfg.bq) if side == "q" else (cfg.nk, cfg.bk)
  # Edge padding keeps the per-block key ranges tight; padded keys are masked by index.
  blocked = lambda x: (None if x is None else _pad(x.astype(jnp.int32), 1, n * size, "edge")
                       .reshape(cfg.b, n, size).swapaxes(0, 1))
  return _Keys(blocked(segment_ids if cfg.has_segments else None),
               blocked(positions if cfg.has_positions else None))


def to_q_input(cfg: _Config, x):
  """q or dO [B,T,Hq,D] as the kernel reads it: `to_q_blocks`, or with tile_transpose the
  padded rows split into blocks, [B, nq, bq, Hkv, G, D] (a reshape: no copy when the
  blocks divide T), each tile re-laid when it is read."""
  if not cfg.tile_transpose:
    return to_q_blocks(cfg, x)
  return _pad(x, 1, cfg.nq * cfg.bq).reshape(cfg.b, cfg.nq, cfg.bq, cfg.hkv, cfg.g, x.shape[-1])


def blocked_forward(cfg: _Config, q_input, k_blocks, v_blocks, q_keys: _Keys, kv_keys: _Keys):
  """(out [nq,B,Hkv,M,D] f32, lse [nq,B,Hkv,M] f32, -inf for empty rows) in block layout;
  q from `to_q_input`, k and v from `to_kv_blocks`."""
  return _forward(cfg, q_input, k_blocks, v_blocks, q_keys, kv_keys)


def blocked_backward(cfg: _Config, q_input, k_blocks, v_blocks, q_keys: _Keys, kv_keys: _Keys,
                     lse, do_input, delta, acc):
  """acc + this call's gradients: acc = (dq^T [nq,B,Hkv,D,M], dk, dv [nk,B,Hkv,bk,D]) f32.

  lse, delta [nq,B,Hkv,M] f32 over all the keys each row attends to (lse finite); q and
  dO from `to_q_input`."""
  return _backward(cfg, q_input, k_blocks, v_blocks, q_keys, kv_keys, lse, do_input, delta, acc)


def visited_tiles(q, k, *, q_segment_ids=None, kv_segment_ids=None, q_positions=None,
                  kv_positions=None, causal: bool = True, block_q: int | None = None,
                  block_k: int | None = None, window: int = 0) -> tuple[jax.Array, tuple[int, int]]:
  """(tiles the forward's loops visit, (block_q, block_k) used): the work a call does.

  q, k may be jax.ShapeDtypeStruct; other arguments as `forward_with_lse`. One tile is
  [B, Hq, block_q, block_k] scores; the backward visits the same tiles.
  """
  cfg, q_keys, kv_keys = _plan("visited_tiles", q, k, k, q_segment_ids, kv_segment_ids,
                               q_positions, kv_positions, causal, None, block_q, block_k, window)
  (lo, hi), _ = _block_ranges(cfg, q_keys, kv_keys)
  return jnp.sum(hi - lo), (cfg.bq, cfg.bk)


def _prepare(who, q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal, sm_scale, block_q, block_k,
             window=0):
  """Checks the arguments; (cfg, q, k, v in block layout, q keys, kv keys)."""
  cfg, q_keys, kv_keys = _plan(who, q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal, sm_scale,
                               block_q, block_k, window)
  return cfg, to_q_blocks(cfg, q), to_kv_blocks(cfg, k), to_kv_blocks(cfg, v), q_keys, kv_keys


def _plan(who, q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal, sm_scale, block_q, block_k,
          window=0):
  """Checks the arguments (shapes only); (cfg, q keys, kv keys)."""
  window = check_window(who, window, causal)
  if q_seg is None:
    segment_ids = None
  elif kv_seg is None:
    segment_ids = q_seg
  else:
    segment_ids = (q_seg, kv_seg)
  q_seg, kv_seg = check_inputs(q, k, v, segment_ids)
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  if (q_pos is None) != (kv_pos is None):
    raise ValueError(f"{who}: pass both q_positions and kv_positions or neither")
  for name, pos, n in (("q_positions", q_pos, t), ("kv_positions", kv_pos, s)):
    if pos is not None and (pos.shape != (b, n) or not jnp.issubdtype(pos.dtype, jnp.integer)):
      raise ValueError(f"{who}: {name} must be an integer array of shape {(b, n)}; "
                       f"got {pos.dtype}{pos.shape}")
  auto_q, auto_k = default_blocks(b * hq)
  block_q = auto_q if block_q is None else block_q
  block_k = auto_k if block_k is None else block_k
  for name, block in (("block_q", block_q), ("block_k", block_k)):
    if not isinstance(block, int) or block < 1:
      raise ValueError(f"{who}: {name} must be a positive int or None; got {block!r}")
  bq, nq = _balanced_block(t, block_q)
  bk, nk = _balanced_block(s, block_k)
  has_positions = bool(causal) and q_pos is not None
  cfg = _Config(b, hkv, hq // hkv, t, s, bq, bk, nq, nk, bool(causal),
                static_scale(sm_scale, d, who), q_seg is not None, has_positions, window=window)
  return cfg, key_blocks(cfg, q_seg, q_pos, "q"), key_blocks(cfg, kv_seg, kv_pos, "kv")


def to_q_blocks(cfg: _Config, x):
  """[B, T, Hq, D] -> [nq, B, Hkv, M, D] (M = G * bq, the G heads' rows stacked)."""
  b, nq, bq, hkv, g = cfg.b, cfg.nq, cfg.bq, cfg.hkv, cfg.g
  d = x.shape[-1]
  return (_pad(x, 1, nq * bq).reshape(b, nq, bq, hkv, g, d).transpose(1, 0, 3, 4, 2, 5)
          .reshape(nq, b, hkv, g * bq, d))


def from_q_blocks(cfg: _Config, x):
  """Inverse of to_q_blocks, padded rows dropped."""
  d = x.shape[-1]
  x = x.reshape(cfg.nq, cfg.b, cfg.hkv, cfg.g, cfg.bq, d).transpose(1, 0, 4, 2, 3, 5)
  return x.reshape(cfg.b, cfg.nq * cfg.bq, cfg.hkv * cfg.g, d)[:, :cfg.t]


def to_kv_blocks(cfg: _Config, x):
  """[B, S, Hkv, D] -> [nk, B, Hkv, bk, D]."""
  d = x.shape[-1]
  return (_pad(x, 1, cfg.nk * cfg.bk).reshape(cfg.b, cfg.nk, cfg.bk, cfg.hkv, d)
          .transpose(1, 0, 3, 2, 4))


def from_kv_blocks(cfg: _Config, x):
  """Inverse of to_kv_blocks, padded keys dropped."""
  x = x.transpose(1, 0, 3, 2, 4)
  return x.reshape(cfg.b, cfg.nk * cfg.bk, cfg.hkv, x.shape[-1])[:, :cfg.s]


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
  """Block i of x (a tree whose leaves may be None)."""
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False), x)


# ----------------------------------------------------------------------------- masks, ranges


def _tile_mask(cfg: _Config, i, j, q_keys: _Keys, kv_keys: _Keys) -> jax.Array | None:
  """Bool [B|1, bq|1, bk] (True = attend) for q block i and kv block j; None if all True.

  q_keys, kv_keys: block i's / block j's keys, [B, bq] / [B, bk] (or None)."""
  parts = []
  kv_idx = j * cfg.bk + jnp.arange(cfg.bk)
  if cfg.nk * cfg.bk != cfg.s:  # padded keys exist (only in the last block, but cheap)
    parts.append((kv_idx < cfg.s)[None, None, :])
  if cfg.has_positions:
    parts.append(q_keys.pos[:, :, None] >= kv_keys.pos[:, None, :])
    if cfg.window:
      parts.append(q_keys.pos[:, :, None] - cfg.window < kv_keys.pos[:, None, :])
  elif cfg.causal:
    q_idx = i * cfg.bq + jnp.arange(cfg.bq) + (cfg.s - cfg.t)
    parts.append((q_idx[:, None] >= kv_idx[None, :])[None])
    if cfg.window:
      parts.append((q_idx[:, None] - cfg.window < kv_idx[None, :])[None])
  if cfg.has_segments:
    parts.append(q_keys.seg[:, :, None] == kv_keys.seg[:, None, :])
  return functools.reduce(jnp.logical_and, parts) if parts else None


def _masked(cfg: _Config, s_BKMS, mask_BQS):
  """-inf where masked, for a [B, Hkv, M, bk] tile (M = G*bq)."""
  if mask_BQS is None:
    return s_BKMS
  s = s_BKMS.reshape(cfg.b, cfg.hkv, cfg.g, cfg.bq, cfg.bk)
  mask = jnp.broadcast_to(mask_BQS, (mask_BQS.shape[0], cfg.bq, cfg.bk))
  s = jnp.where(mask[:, None, None], s, -jnp.inf)
  return s.reshape(s_BKMS.shape)


def _masked_t(cfg: _Config, s_BKSM, mask_BQS):
  """-inf where masked, for a transposed [B, Hkv, bk, M] tile."""
  if mask_BQS is None:
    return s_BKSM
  s = s_BKSM.reshape(cfg.b, cfg.hkv, cfg.bk, cfg.g, cfg.bq)
  mask = jnp.broadcast_to(mask_BQS, (mask_BQS.shape[0], cfg.bq, cfg.bk))
  s = jnp.where(mask.swapaxes(1, 2)[:, None, :, None, :], s, -jnp.inf)
  return s.reshape(s_BKSM.shape)


def _block_ranges(cfg: _Config, q_keys: _Keys, kv_keys: _Keys):
  """Loop bounds: per q block [lo, hi) over kv blocks; per kv block [lo, hi) over q blocks.

  The batch rows share one loop, so a tile is visited if it is visitable
  (`attention_blocks.visitable_blocks`) for some batch row.
  """
  swap = lambda x: None if x is None else x.swapaxes(0, 1)
  allowed = visitable_blocks(
      swap(q_keys.seg), swap(kv_keys.seg), t=cfg.t, s=cfg.s, num_q_blocks=cfg.nq,
      num_kv_blocks=cfg.nk, block_q=cfg.bq, block_k=cfg.bk, causal=cfg.causal,
      q_pos_BIQ=swap(q_keys.pos), kv_pos_BJK=swap(kv_keys.pos), window=cfg.window).any(0)
  return spans(allowed), spans(allowed.T)


def _transposed(cfg: _Config, x, xT, i):
  """Block i of x with its last two axes swapped: from xT, or per tile (tile_transpose)."""
  return _index(x, i).swapaxes(-1, -2) if cfg.tile_transpose else _index(xT, i)


def _q_tile(cfg: _Config, x, i):
  """Rows block i of q or dO as [B, Hkv, M, D], from `to_q_input`'s layout."""
  if not cfg.tile_transpose:
    return _index(x, i)
  rows = jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False)  # [B, bq, Hkv, G, D]
  return rows.transpose(0, 2, 3, 1, 4).reshape(cfg.b, cfg.hkv, cfg.g * cfg.bq, x.shape[-1])


def _vma(x) -> frozenset:
  """The manual mesh axes x varies over (empty outside shard_map or without check_vma)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  return mat.varying if mat is not None else getattr(aval, "vma", frozenset())


def _vary_like(tree, *refs):
  """tree's leaves marked varying over every manual mesh axis the refs vary over, so loop
  carries started from constants type-check inside shard_map (check_vma); else a no-op."""
  axes = frozenset().union(*(_vma(r) for r in jax.tree.leaves(refs)))

  def cast(x):
    missing = tuple(sorted(axes - _vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


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


def _forward(cfg: _Config, q_IBKMD, k_JBKSD, v_JBKSD, q_keys: _Keys, kv_keys: _Keys):
  """(out [nq, B, Hkv, M, D] f32, lse [nq, B, Hkv, M] f32, -inf for empty rows)."""
  (lo_I, hi_I), _ = _block_ranges(cfg, q_keys, kv_keys)
  kT_JBKDS = None if cfg.tile_transpose else k_JBKSD.swapaxes(-1, -2)
  b, kh, m_rows, d = cfg.b, cfg.hkv, cfg.g * cfg.bq, q_IBKMD.shape[-1]

  def q_block(_, xs):
    i, qk, lo, hi = xs
    q_BKMD = _q_tile(cfg, q_IBKMD, i)

    def kv_block(j, carry):
      m, l, acc = carry
      s = jnp.einsum("bkmd,bkds->bkms", q_BKMD, _transposed(cfg, k_JBKSD, kT_JBKDS, j),
                     preferred_element_type=jnp.float32) * cfg.scale
      s = _masked(cfg, s, _tile_mask(cfg, i, j, qk, _index(kv_keys, j)))
      m_new = jnp.maximum(m, s.max(-1))
      m_safe = _finite_or_zero(m_new)
      p = jnp.exp(s - m_safe[..., None])
      alpha = jnp.exp(m - m_safe)  # 0 while m is -inf
      v_j = _index(v_JBKSD, j)
      pv = jnp.einsum("bkms,bksd->bkmd", p.astype(v_j.dtype), v_j,
                      preferred_element_type=jnp.float32)
      return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

    init = _vary_like((jnp.full((b, kh, m_rows), -jnp.inf, jnp.float32),
                       jnp.zeros((b, kh, m_rows), jnp.float32),
                       jnp.zeros((b, kh, m_rows, d), jnp.float32)), xs, k_JBKSD, v_JBKSD, kv_keys)
    m, l, acc = _loop(lo, hi, cfg.nk, kv_block, init)
    empty = l == 0  # nothing to attend to: output 0, lse -inf
    safe_l = jnp.where(empty, 1.0, l)
    out = acc * (1.0 / safe_l)[..., None]
    lse = jnp.where(empty, -jnp.inf, _finite_or_zero(m) + jnp.log(safe_l))
    return None, (out, lse)

  xs = (jnp.arange(cfg.nq, dtype=jnp.int32), q_keys, lo_I, hi_I)
  if cfg.nq == 1:
    out, lse = q_block(None, jax.tree.map(lambda x: x[0], xs))[1]
    return out[None], lse[None]
  return jax.lax.scan(q_block, None, xs)[1]


# ----------------------------------------------------------------------------- backward


def _backward(cfg: _Config, q_IBKMD, k_JBKSD, v_JBKSD, q_keys: _Keys, kv_keys: _Keys, lse_IBKM,
              do_IBKMD, delta_IBKM, acc=None):
  """kv blocks outer (dk, dv accumulate locally), the q blocks that see them inner.

  Works on transposed tiles [B, Hkv, bk, M] so every matmul is canonical; dq is carried
  transposed, [nq, B, Hkv, D, M], and updated in place one q block at a time. lse must
  be finite (0 for empty rows). Returns (dq^T, dk, dv), added to acc when given.
  """
  _, (lo_J, hi_J) = _block_ranges(cfg, q_keys, kv_keys)
  whole_T = lambda x: None if cfg.tile_transpose else x.swapaxes(-1, -2)
  qT_IBKDM, doT_IBKDM, kT_JBKDS = whole_T(q_IBKMD), whole_T(do_IBKMD), whole_T(k_JBKSD)
  if acc is None:
    zeros = lambda shape: jnp.zeros(shape, jnp.float32)
    d = q_IBKMD.shape[-1]
    acc = _vary_like((zeros((cfg.nq, cfg.b, cfg.hkv, d, cfg.g * cfg.bq)),
                      zeros(k_JBKSD.shape), zeros(v_JBKSD.shape)),
                     q_IBKMD, k_JBKSD, v_JBKSD, do_IBKMD, q_keys, kv_keys, lse_IBKM, lo_J, hi_J)
  dqT0, dk0, dv0 = acc

  def kv_block(dqT, xs):
    j, k_BKSD, v_BKSD, kvk, lo, hi, dk, dv = xs
    kT_BKDS = _transposed(cfg, k_JBKSD, kT_JBKDS, j)

    def q_block(i, carry):
      dqT, dk, dv = carry
      q_BKMD, do_BKMD = _q_tile(cfg, q_IBKMD, i), _q_tile(cfg, do_IBKMD, i)
      qT_BKDM = q_BKMD.swapaxes(-1, -2) if cfg.tile_transpose else _index(qT_IBKDM, i)
      doT_BKDM = do_BKMD.swapaxes(-1, -2) if cfg.tile_transpose else _index(doT_IBKDM, i)
      sT = jnp.einsum("bksd,bkdm->bksm", k_BKSD, qT_BKDM,
                      preferred_element_type=jnp.float32) * cfg.scale
      sT = _masked_t(cfg, sT, _tile_mask(cfg, i, j, _index(q_keys, i), kvk))
      # Masked scores are -inf and lse is finite, so masked p are exact zeros.
      pT = jnp.exp(sT - _index(lse_IBKM, i)[..., None, :])
      dv = dv + jnp.einsum("bksm,bkmd->bksd", pT.astype(do_BKMD.dtype), do_BKMD,
                           preferred_element_type=jnp.float32)
      dpT = jnp.einsum("bksd,bkdm->bksm", v_BKSD, doT_BKDM,
                       preferred_element_type=jnp.float32)
      dsT = pT * (dpT - _index(delta_IBKM, i)[..., None, :]) * cfg.scale
      dk = dk + jnp.einsum("bksm,bkmd->bksd", dsT.astype(q_BKMD.dtype), q_BKMD,
                           preferred_element_type=jnp.float32)
      dqT_i = jnp.einsum("bkds,bksm->bkdm", kT_BKDS, dsT.astype(kT_BKDS.dtype),
                         preferred_element_type=jnp.float32)
      dqT = jax.lax.dynamic_update_index_in_dim(dqT, _index(dqT, i) + dqT_i, i, axis=0)
      return dqT, dk, dv

    dqT, dk, dv = _loop(lo, hi, cfg.nq, q_block, (dqT, dk, dv))
    return dqT, (dk, dv)

  xs = (jnp.arange(cfg.nk, dtype=jnp.int32), k_JBKSD, v_JBKSD, kv_keys, lo_J, hi_J, dk0, dv0)
  if cfg.nk == 1:
    dqT, (dk, dv) = kv_block(dqT0, jax.tree.map(lambda x: x[0], xs))
    return dqT, dk[None], dv[None]
  dqT, (dk, dv) = jax.lax.scan(kv_block, dqT0, xs)
  return dqT, dk, dv


# ----------------------------------------------------------------------------- custom vjp


def _single_tile(cfg: _Config, q_BKMD, k_BKSD, v_BKSD, q_keys: _Keys, kv_keys: _Keys):
  """The whole problem as one tile, no loop: out f32 [B,Hkv,M,D], normalised p f32 [B,Hkv,M,S]."""
  s = jnp.einsum("bkmd,bksd->bkms", q_BKMD, k_BKSD, preferred_element_type=jnp.float32) * cfg.scale
  s = _masked(cfg, s, _tile_mask(cfg, 0, 0, q_keys, kv_keys))
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


def _first(keys: _Keys) -> _Keys:
  return jax.tree.map(lambda x: x[0], keys)


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
    out, lse = _forward(cfg, q, k, v, qseg, kvseg)
    p_or_lse = _finite_or_zero(lse)  # empty rows: 0, so their masked p are exact zeros
  # Named, so a remat policy can keep them and the backward need not rerun the forward
  # (jaxsys/models/remat.py).
  out = checkpoint_name(out.astype(q.dtype), "attention")
  p_or_lse = checkpoint_name(p_or_lse, "attention_stats")
  return out, (q, k, v, qseg, kvseg, out, p_or_lse)


def _flash_bwd(cfg, res, d_out):
  q, k, v, qseg, kvseg, out, p_or_lse = res
  # delta = rowsum(dO * O) = sum_s p * dp per query row.
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  if _one_tile(cfg):
    dq, dk, dv = (x[None] for x in _single_tile_bwd(cfg, q[0], k[0], v[0], p_or_lse, d_out[0],
                                                    delta[0]))
  else:
    dqT, dk, dv = _backward(cfg, q, k, v, qseg, kvseg, p_or_lse, d_out, delta)
    dq = dqT.swapaxes(-1, -2)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
