"""Context parallelism: sequence layouts and ring attention over a mesh axis.

A sequence of T tokens is split over the n devices of `axis_name`, each holding T/n
contiguous tokens of the *reordered* sequence `to_layout(x, n, layout)`:

  "contiguous": device i holds tokens [i*T/n, (i+1)*T/n).
  "zigzag":     the sequence is cut into 2n chunks; device i holds chunks i and 2n-1-i,
                so under a causal mask every device has the same amount of work.

`ring_attention` runs inside `jax.shard_map`: the local K/V block travels around the ring
with its segment ids and causal keys (`lax.ppermute`, n-1 hops). Every step attends the
local queries to the visiting block with the blockwise flash kernel of
`jaxsys.kernels.attention_xla` (on every backend: it is the kernel that takes per-token
causal keys and returns the row logsumexp; the Pallas kernels take neither), so its tile
skipping applies inside a step: a tile is visited only if its segment-id ranges overlap
and its largest query key reaches its smallest kv key. A step whose whole block fails
that test (`may_attend`) is skipped by `lax.cond`. Under zigzag and a causal mask every
device visits the same number of tiles (`ring_tiles`); under contiguous, device i visits
i whole blocks and one causal diagonal block.

Causal keys are `positions` when given, any ints per token (per-document positions of
packed rows, which restart at each document; tokens in any order), else the global token
index of the layout. The mask is: same segment and (not causal or q_key >= kv_key).

Forward: the step outputs and row logsumexps are merged by log-sum-exp; a row with no
key anywhere gives 0. The backward is a `jax.custom_vjp` and also a ring: the K/V blocks
go round again with their dk/dv accumulators, which arrive home after n hops; each step
recomputes its tiles' probabilities from the saved output's logsumexp (FlashAttention-2),
so residuals are O(T/n) per device. q, dO, the accumulators and the rotating blocks stay
in the kernel's block layout for the whole ring, and the kernel re-lays q/dO and
transposes k one tile at a time, so a step allocates only its tiles: T=8192 over 4
devices, fwd+bwd temporaries are about a third of single-device flash attention's
(experiments/bench_context.py).

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

from jaxsys.kernels import attention_xla
from jaxsys.kernels.attention_inputs import check_inputs, static_scale

LAYOUTS = ("contiguous", "zigzag")
# Each step needs per-token causal keys and the row logsumexp in and out, which only
# the blockwise XLA kernel exposes; "auto" therefore means it on every backend.
IMPLS = ("auto", "xla")


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


def ring_attention(q, k, v, *, axis_name, segment_ids=None, causal: bool = True,
                   layout: str = "zigzag", sm_scale: float | None = None, impl: str = "auto",
                   positions=None) -> jax.Array:
  """Attention over a sequence sharded on `axis_name` (call inside jax.shard_map).

  q [B, T/n, Hq, D], k/v [B, T/n, Hkv, D] local shards in `layout` order; segment_ids
  [B, T/n] or a (q_ids, kv_ids) pair. positions: per-token causal keys of the local
  shard ([T/n] or [B, T/n] ints; query i sees key j iff positions[i] >= positions[j],
  any order, e.g. restarting at each packed document); None derives global token
  indices from the device's axis index and `layout`. impl: "auto" or "xla" (see the
  module docstring). Returns the local [B, T/n, Hq, D] in q.dtype.
  """
  if impl not in IMPLS:
    raise ValueError(f"ring_attention: unknown impl {impl!r}; valid: {', '.join(IMPLS)}")
  q_keys, kv_keys, n, scale = _local_keys("ring_attention", q, k, v, axis_name, segment_ids,
                                          causal, layout, sm_scale, positions)
  return _ring(_Config(axis_name, n, bool(causal), scale), q, k, v, q_keys, kv_keys)


def all_gather_attention(q, k, v, *, axis_name, segment_ids=None, causal: bool = True,
                         layout: str = "zigzag", sm_scale: float | None = None,
                         positions=None) -> jax.Array:
  """`ring_attention`'s contract, by gathering K/V (the Llama 3 paper's context
  parallelism): every device all-gathers the keys, values and their keys' segment ids and
  causal keys over `axis_name`, then attends its own queries to all of them with the
  blockwise kernel, whose tile skipping follows the causal keys in any order (so zigzag
  shares stay balanced). The backward reduce-scatters dk and dv (the gather's transpose).
  Per device: K/V of the whole sequence live at once (the ring holds two blocks), one
  collective each way instead of n - 1 hops; with GQA's few K/V heads both are small.
  """
  (q_seg, q_pos), (kv_seg, kv_pos), _, scale = _local_keys(
      "all_gather_attention", q, k, v, axis_name, segment_ids, causal, layout, sm_scale,
      positions)
  gather = functools.partial(_gather_sequence, axis_name=axis_name)
  return attention_xla.xla_attention(
      q, gather(k), gather(v), q_segment_ids=q_seg, kv_segment_ids=gather(kv_seg),
      q_positions=q_pos, kv_positions=gather(kv_pos), causal=causal, sm_scale=scale)


def ulysses_attention(q, k, v, *, axis_name, segment_ids=None, causal: bool = True,
                      layout: str = "zigzag", sm_scale: float | None = None,
                      positions=None) -> jax.Array:
  """`ring_attention`'s contract by DeepSpeed-Ulysses: an all-to-all trades the sequence
  split for a split of the heads (each device then holds the whole sequence of Hq/n query
  and Hkv/n K/V heads, a GQA group kept together), the blockwise kernel runs on them with
  the whole sequence's segment ids and causal keys (gathered), and an all-to-all trades
  the output back. Both head counts must divide by n. Per device it sends q, k, v and
  the output (n-1)/n each way, independent of n in total; memory as all-gather's for K/V
  but only its own heads.
  """
  (q_seg, q_pos), (kv_seg, kv_pos), n, scale = _local_keys(
      "ulysses_attention", q, k, v, axis_name, segment_ids, causal, layout, sm_scale,
      positions)
  if q.shape[2] % n or k.shape[2] % n:
    raise ValueError(f"ulysses_attention: query heads {q.shape[2]} and K/V heads "
                     f"{k.shape[2]} must both divide by the {axis_name} size {n}")
  to_heads = lambda x: jax.lax.all_to_all(x, axis_name, 2, 1, tiled=True)
  gather = functools.partial(_gather_sequence, axis_name=axis_name)
  out = attention_xla.xla_attention(
      to_heads(q), to_heads(k), to_heads(v), q_segment_ids=gather(q_seg),
      kv_segment_ids=gather(kv_seg), q_positions=gather(q_pos), kv_positions=gather(kv_pos),
      causal=causal, sm_scale=scale)
  return jax.lax.all_to_all(out, axis_name, 1, 2, tiled=True)


def _gather_sequence(x, axis_name):
  """The whole sequence of a local shard [B, T/n, ...] (None stays None)."""
  return None if x is None else jax.lax.all_gather(x, axis_name, axis=1, tiled=True)


# The context-parallel attention algorithms, by name (`parallel.context_algorithm`).
ALGORITHMS = {"ring": ring_attention, "all_gather": all_gather_attention,
              "ulysses": ulysses_attention}


def _local_keys(who: str, q, k, v, axis_name, segment_ids, causal, layout, sm_scale,
                positions):
  """((q segment ids, causal keys), (kv ...), n, scale) of a local shard, checked: the
  causal keys are `positions`, or the layout's global token indices when None."""
  _check_layout(layout, who)
  q_seg, kv_seg = check_inputs(q, k, v, segment_ids)
  b, t, _, d = q.shape
  if k.shape[1] != t:
    raise ValueError(f"{who}: q and k/v shards must have equal length; got q{q.shape} "
                     f"k{k.shape}")
  n = jax.lax.axis_size(axis_name)
  pos = None
  if causal:
    if positions is None:
      if layout == "zigzag" and t % 2:
        raise ValueError(f"{who}: zigzag needs an even shard length; got T/n={t}")
      positions = shard_positions(jax.lax.axis_index(axis_name), n, t, layout)
    positions = jnp.asarray(positions)
    if positions.shape not in ((t,), (b, t)) or not jnp.issubdtype(positions.dtype, jnp.integer):
      raise ValueError(f"{who}: positions must be integers of shape {(t,)} or {(b, t)}; got "
                       f"{positions.dtype}{positions.shape}")
    pos = jnp.broadcast_to(positions.astype(jnp.int32), (b, t))
  as_ids = lambda x: None if x is None else x.astype(jnp.int32)
  return ((as_ids(q_seg), pos), (as_ids(kv_seg), pos), int(n),
          static_scale(sm_scale, d, who))


def _kernel_keys(q_keys, kv_keys) -> dict:
  """The blockwise kernel's keyword arguments for these (segment ids, positions) pairs."""
  return dict(q_segment_ids=q_keys[0], kv_segment_ids=kv_keys[0], q_positions=q_keys[1],
              kv_positions=kv_keys[1])


def may_attend(q_keys, kv_keys) -> jax.Array:
  """Scalar bool: may some query attend to some key of the visiting block?

  From per-row min/max of the keys (the kernel's tile test applied to the whole block),
  so a False step is skipped whole; a True one still skips the kernel's empty tiles.
  """
  ok = True
  (q_seg, q_pos), (kv_seg, kv_pos) = q_keys, kv_keys
  if q_pos is not None:
    ok = ok & (q_pos.max(-1) >= kv_pos.min(-1))
  if q_seg is not None:
    ok = ok & (q_seg.min(-1) <= kv_seg.max(-1)) & (q_seg.max(-1) >= kv_seg.min(-1))
  return jnp.any(jnp.asarray(ok))


def ring_tiles(n: int, local: int, layout: str, *, batch: int = 1, heads: int = 1,
               causal: bool = True) -> tuple[np.ndarray, tuple[int, int]]:
  """(tiles [n, n], (block_q, block_k)): score tiles the kernel visits on device i for the
  block of device j in a ring over one sequence of n * local tokens (positions=None, no
  segment ids); a step `may_attend` skips counts 0. The backward's loops visit the same
  tiles here, since every row and column of visitable tiles is one contiguous span.
  """
  q = jax.ShapeDtypeStruct((batch, local, heads, 1), jnp.float32)
  pos = [jnp.broadcast_to(shard_positions(i, n, local, layout), (batch, local)) if causal
         else None for i in range(n)]
  tiles = np.zeros((n, n), np.int64)
  for i in range(n):
    for j in range(n):
      keys = (None, pos[i]), (None, pos[j])
      if bool(may_attend(*keys)):
        tiles[i, j] = int(attention_xla.visited_tiles(q, q, causal=causal,
                                                      **_kernel_keys(*keys))[0])
  return tiles, attention_xla.visited_tiles(q, q, causal=False)[1]


def _merge(out_a, lse_a, out_b, lse_b):
  """Log-sum-exp merge of two partial results (out [..., D], lse [...]); empty rows stay
  (0, -inf)."""
  lse = jnp.logaddexp(lse_a, lse_b)
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  w_a = jnp.where(jnp.isfinite(lse_a), jnp.exp(lse_a - safe), 0.0)
  w_b = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - safe), 0.0)
  return out_a * w_a[..., None] + out_b * w_b[..., None], lse


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


def _ring_loop(cfg, step, carry, kv):
  """Runs step(carry, kv) on the local block and the n - 1 visiting ones; the final carry
  and kv (the block that visited last, one hop short of home)."""
  def body(_, state):
    carry, kv = state
    carry, kv = step(carry, kv)
    return carry, _rotate(cfg, kv)

  carry, kv = jax.lax.fori_loop(0, cfg.n - 1, body, (carry, kv))
  return step(carry, kv)


def _tiles(cfg, q, k, q_keys, kv_keys):
  """The kernel's tiling of a ring step (every step has the same shapes and masks)."""
  return attention_xla.plan_tiles(q, k, causal=cfg.causal, sm_scale=cfg.scale,
                                  **_kernel_keys(q_keys, kv_keys))


def _forward(cfg, q, k, v, q_keys, kv_keys):
  """(out [B,T,Hq,D] q.dtype, lse [nq,B,Hkv,M] f32 in block layout, -inf for rows with
  no key anywhere). Everything stays in the kernel's block layout until the end."""
  tiles = _tiles(cfg, q, k, q_keys, kv_keys)
  q_b, q_kb = attention_xla.to_q_input(tiles, q), attention_xla.key_blocks(tiles, *q_keys, "q")

  def step(carry, kv):
    k_b, v_b, keys = kv

    def visit(out, lse):
      kv_kb = attention_xla.key_blocks(tiles, *keys, "kv")
      o, l = attention_xla.blocked_forward(tiles, q_b, k_b, v_b, q_kb, kv_kb)
      return _merge(out, lse, o, l)

    carry = jax.lax.cond(may_attend(q_keys, keys), visit, lambda *c: c, *carry)
    return carry, kv

  out_shape = (tiles.nq, tiles.b, tiles.hkv, tiles.g * tiles.bq, q.shape[-1])  # block layout
  carry = (_varying(cfg, jnp.zeros(out_shape, jnp.float32)),
           _varying(cfg, jnp.full(out_shape[:-1], -jnp.inf, jnp.float32)))
  kv = (attention_xla.to_kv_blocks(tiles, k), attention_xla.to_kv_blocks(tiles, v), kv_keys)
  (out, lse), _ = _ring_loop(cfg, step, carry, jax.tree.map(lambda x: _varying(cfg, x), kv))
  return attention_xla.from_q_blocks(tiles, out).astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg, q, k, v, q_keys, kv_keys):
  return _forward(cfg, q, k, v, q_keys, kv_keys)[0]


def _ring_fwd(cfg, q, k, v, q_keys, kv_keys):
  out, lse = _forward(cfg, q, k, v, q_keys, kv_keys)
  return out, (q, k, v, q_keys, kv_keys, out, lse)


def _ring_bwd(cfg, res, d_out):
  q, k, v, q_keys, kv_keys, out, lse = res
  tiles = _tiles(cfg, q, k, q_keys, kv_keys)
  blocks = functools.partial(attention_xla.to_q_blocks, tiles)
  f32 = lambda x: x.astype(jnp.float32)
  delta = blocks(jnp.sum(f32(d_out) * f32(out), axis=-1, keepdims=True))[..., 0]
  # Rows with no key anywhere: every score is masked, so lse 0 makes their p exact zeros.
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
  q_b = attention_xla.to_q_input(tiles, q)
  do_b = attention_xla.to_q_input(tiles, d_out.astype(q.dtype))
  q_kb = attention_xla.key_blocks(tiles, *q_keys, "q")

  def step(dqT, kv):
    k_b, v_b, keys, dk, dv = kv

    def visit(dqT, dk, dv):
      kv_kb = attention_xla.key_blocks(tiles, *keys, "kv")
      return attention_xla.blocked_backward(tiles, q_b, k_b, v_b, q_kb, kv_kb, lse, do_b, delta,
                                            (dqT, dk, dv))

    dqT, dk, dv = jax.lax.cond(may_attend(q_keys, keys), visit, lambda *g: g, dqT, dk, dv)
    # The accumulators travel with their block, so each ends where its block started.
    return dqT, (k_b, v_b, keys, dk, dv)

  k_b, v_b = attention_xla.to_kv_blocks(tiles, k), attention_xla.to_kv_blocks(tiles, v)
  zeros = lambda shape: _varying(cfg, jnp.zeros(shape, jnp.float32))
  kv = jax.tree.map(lambda x: _varying(cfg, x), (k_b, v_b, kv_keys))
  dqT = zeros(lse.shape[:-1] + (q.shape[-1], lse.shape[-1]))  # [nq, B, Hkv, D, M]
  dqT, (*_, dk, dv) = _ring_loop(cfg, step, dqT, (*kv, zeros(k_b.shape), zeros(v_b.shape)))
  dk, dv = _rotate(cfg, (dk, dv))  # the last hop home
  dq = attention_xla.from_q_blocks(tiles, dqT.swapaxes(-1, -2))
  dk, dv = attention_xla.from_kv_blocks(tiles, dk), attention_xla.from_kv_blocks(tiles, dv)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)
