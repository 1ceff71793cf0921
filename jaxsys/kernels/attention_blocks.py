"""What the flash-attention paths share: which tiles to visit, and the Pallas plumbing.

Block skipping: tile (i, j) of q block i and kv block j is visited iff it may hold an
unmasked pair: both blocks hold a real token, their [min, max] segment ids overlap and
(when causal) the last real query of block i reaches the first key of block j and
(with a sliding window) the last key of block j is still inside the window of block i's
first query; with explicit per-token causal keys (positions), the same by the blocks'
largest and smallest keys. A loop
visits the span from the first to the last such tile: exact for packed (increasing)
ids, a safe superset otherwise, and the visited tiles are masked element-wise.

The two Pallas kernels (`attention_pallas` for GPU, `attention_pallas_tpu` for TPU)
also share their input checks, the padding of segment ids and the custom_vjp that
wires forward, dq and dk/dv kernels together (`flash_vjp`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxsys.kernels import backends
from jaxsys.kernels.attention_inputs import check_inputs, static_scale


@dataclasses.dataclass(frozen=True)
class FlashConfig:
  """Static parameters of a Pallas flash kernel (hashable: the custom_vjp's nondiff arg)."""
  scale: float
  causal: bool
  offset: int          # S - T of the unpadded inputs: query i sees key j iff i + offset >= j
  window: int          # > 0: query i sees key j only if j > i + offset - window; 0: no window
  kv_len: int          # unpadded S; keys at or past it are padding
  has_segments: bool
  groups: int          # G = Hq // Hkv
  block_q: int         # rows of the forward and dq tiles
  block_k: int         # keys of every tile
  block_q_dkv: int     # rows of the dk/dv kernel's q tiles
  interpret: Any       # interpret mode (bool, or the backend's interpret parameters)


def visitable_blocks(q_ids_BIQ, kv_ids_BJK, *, t: int, s: int, num_q_blocks: int,
                     num_kv_blocks: int, block_q: int, block_k: int, causal: bool,
                     q_pos_BIQ=None, kv_pos_BJK=None, window: int = 0) -> jax.Array:
  """Bool [B, nq, nk] ([1, nq, nk] without ids): tiles that may hold an unmasked pair.

  q_ids_BIQ [B, nq, block_q] and kv_ids_BJK [B, nk, block_k] are the edge-padded
  segment ids cut into blocks (or both None); t, s the real lengths. q_pos_BIQ,
  kv_pos_BJK (both or neither): edge-padded per-token causal keys, query i sees key j
  iff q_pos[i] >= kv_pos[j]; None means positions 0..t-1 aligned to the end of 0..s-1.
  window > 0 (causal only): key j must also be within the query's last `window` keys,
  q_pos[i] - window < kv_pos[j]; tiles wholly before every window are not visited.
  """
  real_q = jnp.arange(num_q_blocks) * block_q < t
  real_k = jnp.arange(num_kv_blocks) * block_k < s
  ok = (real_q[:, None] & real_k[None, :])[None]
  if causal and q_pos_BIQ is not None:
    ok = ok & (q_pos_BIQ.max(-1)[:, :, None] >= kv_pos_BJK.min(-1)[:, None, :])
    if window:
      ok &= q_pos_BIQ.min(-1)[:, :, None] - window < kv_pos_BJK.max(-1)[:, None, :]
  elif causal:
    first_q = jnp.arange(num_q_blocks) * block_q
    last_q = jnp.minimum(first_q + block_q - 1, t - 1)
    first_k = jnp.arange(num_kv_blocks) * block_k
    ok &= ((last_q[:, None] + (s - t)) >= first_k[None, :])[None]
    if window:  # the block's first query still sees the kv block's last real key
      last_k = jnp.minimum(first_k + block_k - 1, s - 1)
      ok &= ((first_q[:, None] + (s - t) - window) < last_k[None, :])[None]
  if q_ids_BIQ is not None:
    q_min, q_max = q_ids_BIQ.min(-1), q_ids_BIQ.max(-1)
    kv_min, kv_max = kv_ids_BJK.min(-1), kv_ids_BJK.max(-1)
    ok &= (kv_min[:, None, :] <= q_max[:, :, None]) & (kv_max[:, None, :] >= q_min[:, :, None])
  return ok


def spans(mask) -> tuple[jax.Array, jax.Array]:
  """First and one-past-last True index along the last axis, int32; (0, 0) for none."""
  any_ = mask.any(-1)
  lo = jnp.argmax(mask, axis=-1)
  hi = mask.shape[-1] - jnp.argmax(mask[..., ::-1], axis=-1)
  return jnp.where(any_, lo, 0).astype(jnp.int32), jnp.where(any_, hi, 0).astype(jnp.int32)


def block_ranges(q_segment_ids, kv_segment_ids, *, t: int, s: int, block_q: int,
                 block_k: int, causal: bool, batch: int, padded_t: int | None = None,
                 padded_s: int | None = None, window: int = 0):
  """Per batch row: (kv_lo, kv_hi) [B, Tp/bq] per q block, (q_lo, q_hi) [B, Sp/bk] per kv block.

  t, s are the real lengths; padded_t, padded_s (default: rounded up to the blocks) the
  padded ones, and segment ids (or None) the padded [B, Tp] / [B, Sp] int arrays.

  Example: four packed segments of 16 in T=S=64, blocks 16: each q block's range is
  exactly its own kv block, one visit instead of four.
  """
  nq = (padded_t or -(-t // block_q) * block_q) // block_q
  nk = (padded_s or -(-s // block_k) * block_k) // block_k
  blocked = lambda ids, n, size: None if ids is None else ids.reshape(batch, n, size)
  ok = visitable_blocks(blocked(q_segment_ids, nq, block_q), blocked(kv_segment_ids, nk, block_k),
                        t=t, s=s, num_q_blocks=nq, num_kv_blocks=nk, block_q=block_q,
                        block_k=block_k, causal=causal, window=window)
  ok = jnp.broadcast_to(ok, (batch, nq, nk))
  return (*spans(ok), *spans(jnp.swapaxes(ok, 1, 2)))


def pad_segment_ids(q_seg, kv_seg, padded_t: int, padded_s: int):
  """Edge-padded int32 ids (or (None, None)).

  Edge padding keeps the per-block id ranges tight; the kernels mask padded rows and
  keys by position, which cannot collide with any id.
  """
  if q_seg is None:
    return None, None
  pad = lambda ids, n: jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, n - ids.shape[1])), mode="edge")
  return pad(q_seg, padded_t), pad(kv_seg, padded_s)


class EntryArgs(NamedTuple):
  """A Pallas entry point's checked arguments."""
  q_seg: jax.Array | None
  kv_seg: jax.Array | None
  interpret: Any  # as `backends.resolve_interpret` returns it
  scale: float


def check_pallas_inputs(who: str, flavor: str, q, k, v, q_segment_ids, kv_segment_ids,
                        dtypes: tuple, *, interpret, sm_scale) -> EntryArgs:
  """Shape, dtype and segment-id checks of a Pallas entry point, its interpret mode and scale."""
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError(
        f"{who}: pass both q_segment_ids and kv_segment_ids or neither; got "
        f"q_segment_ids={'None' if q_segment_ids is None else 'array'}, "
        f"kv_segment_ids={'None' if kv_segment_ids is None else 'array'}")
  segment_ids = None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
  q_seg, kv_seg = check_inputs(q, k, v, segment_ids)
  names = "/".join(jnp.dtype(d).name for d in dtypes)
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.dtype != q.dtype or x.dtype not in dtypes:
      raise ValueError(f"{who}: q, k, v must share one dtype of {names}; "
                       f"got {name}.dtype={x.dtype} (q.dtype={q.dtype})")
  return EntryArgs(q_seg, kv_seg, backends.resolve_interpret(who, flavor, interpret),
                   static_scale(sm_scale, q.shape[-1], who))


def check_window(who: str, window, causal: bool) -> int:
  """A sliding window (an int >= 0, 0: none; only with causal masking), or a one-line error."""
  if not isinstance(window, int) or isinstance(window, bool) or window < 0:
    raise ValueError(f"{who}: window must be an int >= 0 (0: no window); got window={window!r}")
  if window and not causal:
    raise ValueError(f"{who}: window={window} needs causal=True (a window of the keys before "
                     "each query, as transformers' sliding_window); got causal=False")
  return window


def check_block(who: str, name: str, value, valid: Callable[[int], bool], rule: str) -> int:
  """A block size (a plain positive int satisfying `valid`), or a one-line error."""
  if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or not valid(value):
    raise ValueError(f"{who}: {name} must be {rule}; got {name}={value!r}")
  return value


def padded_ids_and_ranges(q_seg, kv_seg, *, t: int, s: int, padded_t: int, padded_s: int,
                          block_q: int, block_q_dkv: int, block_k: int, causal: bool,
                          batch: int, window: int = 0):
  """(q_ids, kv_ids, (kv_lo, kv_hi, q_lo, q_hi)): the forward/dq kernels walk kv blocks
  per block_q rows, the dk/dv kernel q blocks of block_q_dkv rows per kv block."""
  q_ids, kv_ids = pad_segment_ids(q_seg, kv_seg, padded_t, padded_s)
  ranges = functools.partial(block_ranges, q_ids, kv_ids, t=t, s=s, block_k=block_k,
                             causal=causal, batch=batch, padded_t=padded_t, padded_s=padded_s,
                             window=window)
  kv_lo, kv_hi, _, _ = ranges(block_q=block_q)
  _, _, q_lo, q_hi = ranges(block_q=block_q_dkv)
  return q_ids, kv_ids, (kv_lo, kv_hi, q_lo, q_hi)


def flash_vjp(fwd_call: Callable, dq_call: Callable, dkv_call: Callable, layout: str) -> Callable:
  """flash(cfg, q, k, v, q_ids, kv_ids, ranges) -> out, differentiable through Pallas.

  fwd_call(cfg, q, k, v, q_ids, kv_ids, kv_lo, kv_hi) -> (out, lse [B, H, T]);
  dq_call(cfg, q, k, v, do, lse, delta, q_ids, kv_ids, kv_lo, kv_hi) -> dq;
  dkv_call(..., q_lo, q_hi) -> (dk, dv). layout: "bthd" or "bhtd", that of q and out.
  """
  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def flash(cfg, q, k, v, q_ids, kv_ids, ranges):
    return fwd_call(cfg, q, k, v, q_ids, kv_ids, ranges[0], ranges[1])[0]

  def flash_fwd(cfg, q, k, v, q_ids, kv_ids, ranges):
    o, lse = fwd_call(cfg, q, k, v, q_ids, kv_ids, ranges[0], ranges[1])
    # Named, so a remat policy can keep them and the backward need not rerun this kernel
    # (jaxsys/models/remat.py).
    o, lse = checkpoint_name(o, "attention"), checkpoint_name(lse, "attention_stats")
    return o, (q, k, v, q_ids, kv_ids, ranges, o, lse)

  def flash_bwd(cfg, res, do):
    q, k, v, q_ids, kv_ids, ranges, o, lse = res
    kv_lo, kv_hi, q_lo, q_hi = ranges
    # delta_i = sum_j p_ij dp_ij = <dO_i, O_i>: one cheap fused XLA reduction.
    delta = jnp.einsum(f"{layout},{layout}->bht", o.astype(jnp.float32), do.astype(jnp.float32))
    dq = dq_call(cfg, q, k, v, do, lse, delta, q_ids, kv_ids, kv_lo, kv_hi)
    dk, dv = dkv_call(cfg, q, k, v, do, lse, delta, q_ids, kv_ids, q_lo, q_hi)
    return dq, dk, dv, None, None, None

  flash.defvjp(flash_fwd, flash_bwd)
  return flash
