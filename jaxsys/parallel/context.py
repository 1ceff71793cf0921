"""Context parallelism: sequence layouts and ring attention over a mesh axis.

A sequence of T tokens is split over the n devices of `axis_name`, each holding T/n
contiguous tokens of the *reordered* sequence `to_layout(x, n, layout)`:

  "contiguous": device i holds tokens [i*T/n, (i+1)*T/n).
  "zigzag":     the sequence is cut into 2n chunks; device i holds chunks i and 2n-1-i,
                so under a causal mask every device has the same amount of work.

`ring_attention` runs inside `jax.shard_map`: the local K/V block, its segment ids and
its global token positions travel around the ring with `lax.ppermute` (n-1 hops); each
step attends the local queries to the visiting block (causal masking by global
position, so any layout works) and partial outputs are merged by log-sum-exp. A
`lax.switch` on the block's mask (`visit_kind`) skips blocks with no unmasked pair
(causal future, disjoint segments) and computes only half a block where all unmasked
pairs lie in it: zigzag's off-diagonal causal steps, so each device does (n+1)/2 blocks
of work where contiguous does 1 to n.

The backward is a `jax.custom_vjp` and also a ring: the K/V blocks go round again with
their dk/dv accumulators, which arrive home after n hops; each step recomputes the
block's probabilities from q, k, the saved output and log-sum-exp (FlashAttention-2),
so residuals are O(T/n) per device, never O(T).

Per-step compute is plain f32 einsum over chunks of query rows (one ~2 MiB score tile
at a time, TILE_ELEMENTS), not yet the flash kernels of jaxsys.kernels.

Example:
  fn = jax.shard_map(functools.partial(ring_attention, axis_name="context"), mesh=mesh,
                     in_specs=P(None, "context"), out_specs=P(None, "context"),
                     check_vma=False)
  out = from_layout(fn(*(to_layout(x, n, "zigzag") for x in (q, k, v))), n, "zigzag")
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.kernels.attention_inputs import check_inputs, segment_pair, static_scale

LAYOUTS = ("contiguous", "zigzag")
IMPLS = ("auto", "einsum")


def _check_layout(layout: str, who: str) -> None:
  if layout not in LAYOUTS:
    raise ValueError(f"{who}: unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")


def _chunk_order(n: int, layout: str) -> np.ndarray:
  """Original chunk index at each position of the laid-out sequence."""
  if layout == "contiguous":
    return np.arange(n)
  return np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1).reshape(-1)


def _chunks(length: int, n: int, layout: str, who: str) -> int:
  """Number of equal chunks the layout cuts a sequence of `length` into (checked)."""
  _check_layout(layout, who)
  if not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f"{who}: n must be a positive int; got {n!r}")
  parts = n if layout == "contiguous" else 2 * n
  if length % parts:
    raise ValueError(f"{who}: sequence length {length} is not divisible by {parts} "
                     f"({layout} layout over n={n} needs a multiple of {parts})")
  return parts


def _permute(x, order: np.ndarray, axis: int):
  parts = len(order)
  axis = axis % x.ndim
  shape = x.shape
  xs = x.reshape(*shape[:axis], parts, shape[axis] // parts, *shape[axis + 1:])
  return jnp.take(xs, jnp.asarray(order), axis=axis).reshape(shape)


def to_layout(x, n: int, layout: str, axis: int = 1):
  """Reorders `axis` so its n equal contiguous shards are the devices' parts in `layout`."""
  _chunks(x.shape[axis], n, layout, "to_layout")
  if layout == "contiguous":
    return x
  return _permute(x, _chunk_order(n, layout), axis)


def from_layout(x, n: int, layout: str, axis: int = 1):
  """Inverse of `to_layout`: the laid-out sequence back in its original order."""
  _chunks(x.shape[axis], n, layout, "from_layout")
  if layout == "contiguous":
    return x
  return _permute(x, np.argsort(_chunk_order(n, layout)), axis)


def shard_positions(index, n: int, local: int, layout: str) -> jax.Array:
  """Global positions [local] of the tokens device `index` holds (index may be traced)."""
  _check_layout(layout, "shard_positions")
  if layout == "contiguous":
    return index * local + jnp.arange(local)
  if local % 2:
    raise ValueError(f"shard_positions: zigzag needs an even shard length; got {local}")
  c = local // 2
  return jnp.concatenate([index * c + jnp.arange(c), (2 * n - 1 - index) * c + jnp.arange(c)])


class _Config(NamedTuple):
  """Static description of one call (the custom_vjp's non-diff argument)."""
  axis_name: str
  n: int
  causal: bool
  scale: float
  has_segments: bool


def ring_attention(q, k, v, *, axis_name, segment_ids=None, causal: bool = True,
                   layout: str = "zigzag", sm_scale: float | None = None, impl: str = "auto",
                   positions=None) -> jax.Array:
  """Attention over a sequence sharded on `axis_name` (call inside jax.shard_map).

  q [B, T/n, Hq, D], k/v [B, T/n, Hkv, D] local shards in `layout` order; segment_ids
  [B, T/n] or a (q_ids, kv_ids) pair. positions: global token indices of the local
  shard ([T/n] or [B, T/n]), used for causal masking; None derives them from the
  device's axis index and `layout`. Returns the local [B, T/n, Hq, D] in q.dtype.
  """
  _check_layout(layout, "ring_attention")
  if impl not in IMPLS:
    raise ValueError(f"ring_attention: unknown impl {impl!r}; valid: {', '.join(IMPLS)}")
  q_seg, kv_seg = check_inputs(q, k, v, segment_ids)
  b, t, _, d = q.shape
  if k.shape[1] != t:
    raise ValueError(f"ring_attention: q and k/v shards must have equal length; "
                     f"got q{q.shape} k{k.shape}")
  n = jax.lax.axis_size(axis_name)
  if positions is None:
    if layout == "zigzag" and t % 2:
      raise ValueError(f"ring_attention: zigzag needs an even shard length; got T/n={t}")
    positions = shard_positions(jax.lax.axis_index(axis_name), n, t, layout)
  positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (b, t))
  has_segments = q_seg is not None
  if not has_segments:
    # Placeholders keep one custom_vjp signature; the mask ignores them.
    q_seg = kv_seg = jnp.zeros((b, t), jnp.int32)
  cfg = _Config(axis_name, int(n), bool(causal), static_scale(sm_scale, d, "ring_attention"),
                has_segments)
  return _ring(cfg, q, k, v, q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32), positions)


def _mask(cfg: _Config, q_seg, q_pos, kv_seg, kv_pos):
  """[B, T, S] bool: which (query, key) pairs may attend."""
  mask = jnp.ones((q_seg.shape[0], q_seg.shape[1], kv_seg.shape[1]), bool)
  if cfg.causal:
    mask &= q_pos[:, :, None] >= kv_pos[:, None, :]
  if cfg.has_segments:
    mask &= q_seg[:, :, None] == kv_seg[:, None, :]
  return mask


def _slices(t: int) -> list[tuple[slice, slice]]:
  """(query, key) slices a step computes for `visit_kind` 1, 2, 3 (0 computes nothing)."""
  full = slice(None)
  if t < 2 or t % 2:
    return [(full, full)]
  return [(full, full), (full, slice(0, t // 2)), (slice(t // 2, t), full)]


def visit_kind(mask) -> jax.Array:
  """What a ring step must compute for a [B, T, S] block mask: 0 nothing (fully masked),
  1 the whole block, 2 all queries against the first half of the keys, 3 the second half
  of the queries against all keys.

  Under a causal mask, zigzag's off-diagonal steps need only half a block: a kv block
  from an earlier device is seen only through its first chunk, one from a later device
  only by the second query chunk. Derived from the mask, so it is right for any layout.
  """
  t, s = mask.shape[1], mask.shape[2]
  any_ = jnp.any(mask)
  if t < 2 or s < 2 or t % 2 or s % 2:
    return any_.astype(jnp.int32)
  kv_first = ~jnp.any(mask[:, :, s // 2:])
  q_second = ~jnp.any(mask[:, :t // 2, :])
  return jnp.where(~any_, 0, jnp.where(kv_first, 2, jnp.where(q_second, 3, 1))).astype(jnp.int32)


# f32 score elements per row chunk of a ring step (~2 MiB): bounds a step's temporaries
# independently of T/n, as attention_xla's tiles do.
TILE_ELEMENTS = 1 << 19


def _rows_per_chunk(rows: int, cols: int, heads: int) -> int:
  """The largest divisor of `rows` whose [heads, chunk, cols] tile fits TILE_ELEMENTS."""
  target = max(1, TILE_ELEMENTS // max(1, heads * cols))
  return max(c for c in range(1, min(rows, target) + 1) if rows % c == 0)


def _split(x, axis: int, c: int):
  """x with `axis` of length r -> [r / c, ...x with that axis c long...]."""
  shape = x.shape
  x = x.reshape(*shape[:axis], shape[axis] // c, c, *shape[axis + 1:])
  return jnp.moveaxis(x, axis, 0)


def _join(y, axis: int):
  """Inverse of _split: [nc, ...c at axis...] -> [...nc * c at axis...]."""
  y = jnp.moveaxis(y, 0, axis)
  return y.reshape(*y.shape[:axis], y.shape[axis] * y.shape[axis + 1], *y.shape[axis + 2:])


def _scores(cfg, q5, k):
  """q5 [B, T, Hkv, G, D] f32, k [B, S, Hkv, D] -> scaled scores [B, Hkv, G, T, S]."""
  return jnp.einsum("btkgd,bskd->bkgts", q5, k.astype(jnp.float32)) * cfg.scale


def _block_forward(cfg, q5, k, v, mask):
  """One visiting block: (normalised partial output [B,T,Hkv,G,D], lse [B,Hkv,G,T])."""
  m3 = mask[:, None, None]
  s = jnp.where(m3, _scores(cfg, q5, k), -jnp.inf)
  row_max = jnp.max(s, axis=-1)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  p = jnp.where(m3, jnp.exp(s - row_max[..., None]), 0.0)
  denom = jnp.sum(p, axis=-1)
  out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
  out = out / jnp.where(denom == 0, 1.0, denom).transpose(0, 3, 1, 2)[..., None]
  lse = jnp.where(denom > 0, row_max + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
  return out, lse


def _merge(out_a, lse_a, out_b, lse_b):
  """Log-sum-exp merge of two partial results; rows masked in both stay (0, -inf)."""
  lse = jnp.logaddexp(lse_a, lse_b)
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  w_a = jnp.where(jnp.isfinite(lse_a), jnp.exp(lse_a - safe), 0.0)
  w_b = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - safe), 0.0)
  tr = lambda w: w.transpose(0, 3, 1, 2)[..., None]  # [B,Hkv,G,T] -> [B,T,Hkv,G,1]
  return out_a * tr(w_a) + out_b * tr(w_b), lse


def _varying(cfg, x):
  """Marks a fresh (device-invariant) init as varying over the ring, so loop carries and
  cond branches type-check under shard_map's check_vma; a no-op where it is off."""
  if cfg.axis_name in getattr(jax.typeof(x), "vma", frozenset()):
    return x
  try:
    return jax.lax.pcast(x, (cfg.axis_name,), to="varying")
  except ValueError:  # already varying (some tracers, e.g. in custom_vjp's fwd, hide vma)
    return x


def _rotate(cfg, tree):
  """Sends every leaf to the next device on the ring (i -> i+1)."""
  perm = [(i, (i + 1) % cfg.n) for i in range(cfg.n)]
  return jax.tree.map(lambda x: jax.lax.ppermute(x, cfg.axis_name, perm), tree)


def _forward(cfg, q, k, v, q_seg, kv_seg, pos):
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  q5 = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d)

  def step(carry, kv):
    out, lse = carry
    k_blk, v_blk, seg_blk, pos_blk = kv
    mask = _mask(cfg, q_seg, pos, seg_blk, pos_blk)  # only reduced, in visit_kind

    def visit(qs, ks):
      kb, vb, kseg, kpos = k_blk[:, ks], v_blk[:, ks], seg_blk[:, ks], pos_blk[:, ks]
      qb = q5[:, qs]
      c = _rows_per_chunk(qb.shape[1], kb.shape[1], b * hq)

      def rows(xs):
        # The mask is rebuilt per chunk: a [T/n, T/n] one would outweigh the score tile.
        q_c, qseg_c, qpos_c = xs
        return _block_forward(cfg, q_c, kb, vb, _mask(cfg, qseg_c, qpos_c, kseg, kpos))

      # Query rows in chunks, so a step's scores are one ~2 MiB tile, not [T/n, T/n].
      o_b, l_b = jax.lax.map(rows, (_split(qb, 1, c), _split(q_seg[:, qs], 1, c),
                                    _split(pos[:, qs], 1, c)))
      o_b, l_b = _join(o_b, 1), _join(l_b, 3)
      o_m, l_m = _merge(out[:, qs], lse[..., qs], o_b, l_b)
      return out.at[:, qs].set(o_m), lse.at[..., qs].set(l_m)

    branches = [lambda: (out, lse)] + [functools.partial(visit, *sl) for sl in _slices(t)]
    return jax.lax.switch(visit_kind(mask), branches)

  carry = (_varying(cfg, jnp.zeros(q5.shape, jnp.float32)),
           _varying(cfg, jnp.full((b, hkv, hq // hkv, t), -jnp.inf, jnp.float32)))
  kv = tuple(_varying(cfg, x) for x in (k, v, kv_seg, pos))

  def body(_, state):
    carry, kv = state
    return step(carry, kv), _rotate(cfg, kv)

  carry, kv = jax.lax.fori_loop(0, cfg.n - 1, body, (carry, kv))
  out, lse = step(carry, kv)
  return out.reshape(b, t, hq, d).astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg, q, k, v, q_seg, kv_seg, pos):
  return _forward(cfg, q, k, v, q_seg, kv_seg, pos)[0]


def _ring_fwd(cfg, q, k, v, q_seg, kv_seg, pos):
  out, lse = _forward(cfg, q, k, v, q_seg, kv_seg, pos)
  return out, (q, k, v, q_seg, kv_seg, pos, out, lse)


def _ring_bwd(cfg, res, d_out):
  q, k, v, q_seg, kv_seg, pos, out, lse = res
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  g = hq // hkv
  f32 = lambda x: x.astype(jnp.float32)
  q5 = f32(q).reshape(b, t, hkv, g, d)
  do5 = f32(d_out).reshape(b, t, hkv, g, d)
  # delta = rowsum(dO * O), [B, Hkv, G, T] like lse.
  delta = jnp.sum(do5 * f32(out).reshape(b, t, hkv, g, d), axis=-1).transpose(0, 2, 3, 1)

  def step(dq, kv):
    k_blk, v_blk, seg_blk, pos_blk, dk, dv = kv
    mask = _mask(cfg, q_seg, pos, seg_blk, pos_blk)  # only reduced, in visit_kind

    def visit(qs, ks):
      kb, vb = f32(k_blk[:, ks]), f32(v_blk[:, ks])
      kseg, kpos = seg_blk[:, ks], pos_blk[:, ks]
      c = _rows_per_chunk(q5[:, qs].shape[1], kb.shape[1], b * hq)

      def rows(acc, xs):
        # One chunk of query rows: its dq, and its share of the block's dk, dv.
        q_c, do_c, qseg_c, qpos_c, lse_c, delta_c = xs
        m3 = _mask(cfg, qseg_c, qpos_c, kseg, kpos)[:, None, None]
        m3 &= jnp.isfinite(lse_c)[..., None]
        lse_c = jnp.where(jnp.isfinite(lse_c), lse_c, 0.0)
        p = jnp.where(m3, jnp.exp(_scores(cfg, q_c, kb) - lse_c[..., None]), 0.0)
        dp = jnp.einsum("btkgd,bskd->bkgts", do_c, vb)
        ds = p * (dp - delta_c[..., None]) * cfg.scale
        dk_c = jnp.einsum("bkgts,btkgd->bskd", ds, q_c)
        dv_c = jnp.einsum("bkgts,btkgd->bskd", p, do_c)
        return (acc[0] + dk_c, acc[1] + dv_c), jnp.einsum("bkgts,bskd->btkgd", ds, kb)

      xs = (_split(q5[:, qs], 1, c), _split(do5[:, qs], 1, c), _split(q_seg[:, qs], 1, c),
            _split(pos[:, qs], 1, c), _split(lse[..., qs], 3, c), _split(delta[..., qs], 3, c))
      zero = _varying(cfg, jnp.zeros(kb.shape, jnp.float32))
      (dk_b, dv_b), dq_b = jax.lax.scan(rows, (zero, zero), xs)
      return dq.at[:, qs].add(_join(dq_b, 1)), dk.at[:, ks].add(dk_b), dv.at[:, ks].add(dv_b)

    branches = [lambda: (dq, dk, dv)] + [functools.partial(visit, *sl) for sl in _slices(t)]
    return jax.lax.switch(visit_kind(mask), branches)

  zeros_kv = _varying(cfg, jnp.zeros(k.shape, jnp.float32))
  kv = tuple(_varying(cfg, x) for x in (k, v, kv_seg, pos, zeros_kv, zeros_kv))

  def body(_, state):
    dq, kv = state
    dq, dk, dv = step(dq, kv)
    # The accumulators travel with their block, so each ends where its block started.
    return dq, _rotate(cfg, (*kv[:4], dk, dv))

  dq = _varying(cfg, jnp.zeros(q5.shape, jnp.float32))
  dq, kv = jax.lax.fori_loop(0, cfg.n - 1, body, (dq, kv))
  dq, dk, dv = step(dq, kv)
  dk, dv = _rotate(cfg, (dk, dv))  # the last hop home
  return (dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          None, None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)
