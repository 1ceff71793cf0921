"""Pallas kernels for qmatmul: Triton (GPU), Mosaic (TPU), and either in interpret mode.

`pallas_qmatmul(x, qw)` has the semantics of `quant_matmul.xla_qmatmul`: x [..., K] times
a QWeight [K, N] -> [..., N] in x.dtype. The two flavors share the per-tile math below
(`_w8a8_step`, `_w4a16_step`, `_finish`) and differ only in how K is walked:
- GPU (Triton): grid (output tiles in grouped order, K splits); each program keeps its f32/int32
  accumulator in registers and loops over its K range with `lax.fori_loop`, reading
  [block_m, block_k] x and [block_k, block_n] weight tiles by `pl.ds`. Small M (decode)
  splits K so that enough programs stream the weight; the splits are summed in XLA.
- TPU (Mosaic): grid (M blocks, N blocks, K blocks), K innermost and "arbitrary", the
  accumulator in VMEM scratch; blocks are multiples of (8 or 32, 128).
Schemes:
- w8a8 (int8 / fp8): activations are quantized per token by the shared XLA prologue
  (`qweight.quantize_activations`, one fused pass over x), then the kernel does
  int8 x int8 -> int32 (fp8 x fp8 -> f32) dots and rescales by x_scale[m] * w_scale[n]
  once, at the end.
- w4a16: the packed bytes are read as they are stored (no dequantized [K, N] copy in
  HBM); a K step reads one byte tile [block_k, block_n] and the two x tiles it pairs with
  (columns r0.. and K/2 + r0.., the "halves" layout of `pack_int4`), unpacks the nibbles
  in registers/VMEM, dots each half in x.dtype with f32 accumulation and multiplies the
  [block_m, block_n] result by its group's scale (block_k divides the group, so a tile
  has one scale row per half): exact int4 values in bf16, one scale multiply per output.
Ragged M (decode: M = 1, 16) is padded to the M block inside; N and (w8a8) K are padded
only when no block size divides them.

Example:
  y = pallas_qmatmul(x, quantize_weight(w, "w4a16"))   # interpret mode on CPU
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

from jaxsys.kernels import backends
from jaxsys.kernels.backends import ARBITRARY as _ARBITRARY, PARALLEL as _PARALLEL
from jaxsys.kernels.backends import TpuParams as _TpuParams, pltpu as _pltpu
from jaxsys.kernels.qweight import QWeight, check_matmul, quantize_activations, unpack_nibbles

_NN = (((1,), (0,)), ((), ()))  # a @ b
# Enough programs to fill an H100 (132 SMs) twice; decode shapes split K to get there.
_GPU_TARGET_PROGRAMS = 264


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _pow2_divisor(n: int, cap: int) -> int:
  """Largest power of two <= cap (a power of two) dividing n."""
  return math.gcd(n, cap)


@dataclasses.dataclass(frozen=True)
class Config:
  """Static kernel parameters. K sizes count weight rows per step (w4a16: byte rows)."""
  scheme: str
  flavor: str        # "gpu" (Triton) or "tpu" (Mosaic)
  block_m: int
  block_n: int
  block_k: int       # w8a8: K rows per step; w4a16: byte rows per step (2x as many K rows)
  split_k: int       # GPU: K ranges per output tile, summed in XLA (1: none)
  m_pad: int
  n_pad: int
  k_pad: int         # w8a8: K padded to block_k; w4a16: the (unpadded) K
  group_size: int
  interpret: Any
  num_warps: int = 4
  num_stages: int = 3
  group_m: int = 8   # GPU: M blocks per group of the grouped tile order

  @property
  def k_steps(self) -> int:
    rows = self.k_pad // 2 if self.scheme == "w4a16" else self.k_pad
    return rows // self.block_k


# ----------------------------------------------------------------------------- tile math


def _w8a8_step(cfg: Config, xq, wq):
  """One K step of w8a8: int8 x int8 -> int32, or fp8 x fp8 -> f32."""
  acc_type = jnp.int32 if cfg.scheme == "w8a8_int8" else jnp.float32
  return lax.dot_general(xq, wq, _NN, preferred_element_type=acc_type)


def _w4a16_step(x_lo, x_hi, packed, s_lo, s_hi):
  """One K step of w4a16: unpack a byte tile, two dots in x.dtype, scale each by its group."""
  lo, hi = unpack_nibbles(packed)
  # int4 codes are exact in bf16; converting through f32 lowers on every backend.
  dt = x_lo.dtype
  lo, hi = lo.astype(jnp.float32).astype(dt), hi.astype(jnp.float32).astype(dt)
  p_lo = lax.dot_general(x_lo, lo, _NN, preferred_element_type=jnp.float32)
  p_hi = lax.dot_general(x_hi, hi, _NN, preferred_element_type=jnp.float32)
  return p_lo * s_lo.astype(jnp.float32) + p_hi * s_hi.astype(jnp.float32)


def _finish(cfg: Config, acc, sx=None, sw=None):
  """Accumulator -> f32 result; w8a8 rescales by x_scale [bm, 1] * w_scale [1, bn]."""
  acc = acc.astype(jnp.float32)
  if cfg.scheme == "w4a16":
    return acc
  return acc * sx * sw


def _group_rows(cfg: Config, step, half: int):
  """Scale row of the group holding byte-row block `step` of the low (0) or high (1) half."""
  return lax.div(half * (cfg.k_pad // 2) + step * cfg.block_k, cfg.group_size)


# ----------------------------------------------------------------------------- GPU (Triton)


def _gpu_kernel(*refs, cfg: Config):
  o_ref = refs[-1]
  steps = cfg.k_steps // cfg.split_k
  k0 = pl.program_id(1) * steps
  bk, bm, bn = cfg.block_k, cfg.block_m, cfg.block_n
  if cfg.scheme == "w4a16":
    x_ref, w_ref, s_ref = refs[:3]
    half = cfg.k_pad // 2

    def body(k, acc):
      step = k0 + k
      r0 = step * bk
      x_lo = x_ref[:, pl.ds(r0, bk)]
      x_hi = x_ref[:, pl.ds(half + r0, bk)]
      s_lo = s_ref[pl.ds(_group_rows(cfg, step, 0), 1), :]
      s_hi = s_ref[pl.ds(_group_rows(cfg, step, 1), 1), :]
      return acc + _w4a16_step(x_lo, x_hi, w_ref[pl.ds(r0, bk), :], s_lo, s_hi)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
    out = _finish(cfg, acc)
  else:
    x_ref, w_ref, sx_ref, sw_ref = refs[:4]
    acc_type = jnp.int32 if cfg.scheme == "w8a8_int8" else jnp.float32

    def body(k, acc):
      r0 = (k0 + k) * bk
      return acc + _w8a8_step(cfg, x_ref[:, pl.ds(r0, bk)], w_ref[pl.ds(r0, bk), :])

    acc = lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), acc_type))
    out = _finish(cfg, acc, sx_ref[...], sw_ref[...])
  o_ref[...] = out.astype(o_ref.dtype)


def grouped_tile(p, mb: int, nb: int, group_m: int):
  """Program p of a 1-D grid -> output tile (i, j), walking group_m M blocks per N sweep.

  Consecutive programs share an x row panel (group_m blocks) and sweep N, so the tiles
  in flight at once reuse both operands from L2 (Triton's grouped ordering); the last
  group may be shorter.
  """
  width = group_m * nb
  first = lax.div(p, width) * group_m
  size = lax.min(mb - first, group_m)
  q = lax.rem(p, width)
  return first + lax.rem(q, size), lax.div(q, size)


def _gpu_call(cfg: Config, out_dtype, x, w, *scales):
  mp, kx = x.shape
  bm, bn = cfg.block_m, cfg.block_n
  mb, nb = mp // bm, cfg.n_pad // bn
  grid = (mb * nb, cfg.split_k)
  tile = lambda p: grouped_tile(p, mb, nb, cfg.group_m)
  row = lambda p, s: (tile(p)[0], 0)
  col = lambda p, s: (0, tile(p)[1])
  x_spec = pl.BlockSpec((bm, kx), row)
  w_spec = pl.BlockSpec((w.shape[0], bn), col)
  if cfg.scheme == "w4a16":
    (scale,) = scales
    in_specs = [x_spec, w_spec, pl.BlockSpec((scale.shape[0], bn), col)]
  else:
    in_specs = [x_spec, w_spec, pl.BlockSpec((bm, 1), row), pl.BlockSpec((1, bn), col)]
  if cfg.split_k == 1:
    out_shape = jax.ShapeDtypeStruct((mp, cfg.n_pad), out_dtype)
    out_spec = pl.BlockSpec((bm, bn), lambda p, s: tile(p))
  else:  # f32 partial sums, one per K split
    out_shape = jax.ShapeDtypeStruct((cfg.split_k, mp, cfg.n_pad), jnp.float32)
    out_spec = pl.BlockSpec((None, bm, bn), lambda p, s: (s, *tile(p)))
  params = backends.triton_params(cfg.interpret, num_warps=cfg.num_warps,
                                  num_stages=cfg.num_stages)
  out = pl.pallas_call(
      functools.partial(_gpu_kernel, cfg=cfg),
      grid=grid, in_specs=in_specs, out_specs=out_spec, out_shape=out_shape,
      compiler_params=params, interpret=cfg.interpret,
      name=f"jaxsys_qmatmul_{cfg.scheme}",
  )(x, w, *scales)
  return out if cfg.split_k == 1 else out.sum(0).astype(out_dtype)


def gpu_config(scheme: str, m: int, k: int, n: int, group_size: int, *, interpret,
               block_m=None, block_n=None, block_k=None, split_k=None,
               group_m: int = 8) -> Config:
  """Triton blocks: powers of two >= 16 (tl.dot's minimum); K split for small grids.

  Large M: 128 x 256 tiles (x 128 K) for the 8-bit dots, Hopper-sized MMA tiles with a
  3-stage pipeline; decode M: block_m 16 and block_n 64, so more programs stream the
  weight, and K split until about two programs per SM.
  """
  bm = block_m or max(16, min(128, 1 << max(0, m - 1).bit_length()))
  if block_n:
    bn = block_n
  elif n % 16:
    bn = 64
  else:
    bn = _pow2_divisor(n, 256 if (m >= 1024 and scheme != "w4a16") else 64 if m <= 16 else 128)
  n_pad = _round_up(n, bn)
  if scheme == "w4a16":
    # A step's byte rows must sit in one group in both halves: divide gcd(G, K/2).
    common = math.gcd(group_size, k // 2)
    bk = block_k or _pow2_divisor(common, 64)
    if bk < 16 or common % bk:
      raise ValueError(
          f"pallas_qmatmul: w4a16 needs a block_k (power of two >= 16) dividing both "
          f"group_size={group_size} and K/2={k // 2}; got block_k={bk}")
    k_pad = k
    rows = k // 2
  else:
    bk = block_k or (_pow2_divisor(k, 128) if _pow2_divisor(k, 128) >= 32 else 64)
    k_pad = _round_up(k, bk)
    rows = k_pad
  for name, v in (("block_m", bm), ("block_n", bn), ("block_k", bk)):
    if v < 16 or v & (v - 1):
      raise ValueError(f"pallas_qmatmul: {name} must be a power of two >= 16 (Triton tiles); "
                       f"got {name}={v}")
  if not isinstance(group_m, int) or group_m < 1:
    raise ValueError(f"pallas_qmatmul: group_m must be a positive int; got group_m={group_m!r}")
  steps = rows // bk
  if split_k is None:
    tiles = _round_up(m, bm) // bm * (n_pad // bn)
    split_k = 1
    while tiles * split_k < _GPU_TARGET_PROGRAMS and steps % (2 * split_k) == 0 \
        and steps // (2 * split_k) >= 4:
      split_k *= 2
  if split_k < 1 or steps % split_k:
    raise ValueError(f"pallas_qmatmul: split_k={split_k} must divide the {steps} K steps")
  big = bm * bn >= 128 * 128
  return Config(scheme=scheme, flavor="gpu", block_m=bm, block_n=bn, block_k=bk,
                split_k=split_k, m_pad=_round_up(m, bm), n_pad=n_pad, k_pad=k_pad,
                group_size=group_size, interpret=interpret, num_warps=8 if big else 4,
                num_stages=3 if big else 4, group_m=group_m)


# ----------------------------------------------------------------------------- TPU (Mosaic)


def _tpu_kernel(*refs, cfg: Config):
  o_ref, acc_ref = refs[-2:]
  step = pl.program_id(2)

  @pl.when(step == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  if cfg.scheme == "w4a16":
    x_lo_ref, x_hi_ref, w_ref, s_lo_ref, s_hi_ref = refs[:5]
    acc_ref[...] += _w4a16_step(x_lo_ref[...], x_hi_ref[...], w_ref[...], s_lo_ref[...],
                                s_hi_ref[...])
  else:
    x_ref, w_ref = refs[:2]
    acc_ref[...] += _w8a8_step(cfg, x_ref[...], w_ref[...])

  @pl.when(step == cfg.k_steps - 1)
  def _():
    if cfg.scheme == "w4a16":
      out = _finish(cfg, acc_ref[...])
    else:
      out = _finish(cfg, acc_ref[...], refs[2][...], refs[3][...])
    o_ref[...] = out.astype(o_ref.dtype)


def _tpu_call(cfg: Config, out_dtype, x, w, *scales):
  mp = x.shape[0]
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  grid = (mp // bm, cfg.n_pad // bn, cfg.k_steps)
  w_spec = pl.BlockSpec((bk, bn), lambda i, j, k: (k, j))
  if cfg.scheme == "w4a16":
    (scale,) = scales
    hi_off = cfg.k_steps  # x column block of the high half: (K/2) / bk blocks further
    # Scales as [K/G, 1, N]: a (1, block_n) block per group row is Mosaic-legal.
    scale = scale.reshape(scale.shape[0], 1, scale.shape[1])
    s_spec = lambda half: pl.BlockSpec(
        (None, 1, bn), lambda i, j, k: (_group_rows(cfg, k, half), 0, j))
    in_specs = [pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)),
                pl.BlockSpec((bm, bk), lambda i, j, k: (i, k + hi_off)),
                w_spec, s_spec(0), s_spec(1)]
    args = (x, x, w, scale, scale)
    acc_type = jnp.float32
  else:
    in_specs = [pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)), w_spec,
                pl.BlockSpec((bm, 1), lambda i, j, k: (i, 0)),
                pl.BlockSpec((1, bn), lambda i, j, k: (0, j))]
    args = (x, w, *scales)
    acc_type = jnp.int32 if cfg.scheme == "w8a8_int8" else jnp.float32
  params = _TpuParams(dimension_semantics=(_PARALLEL, _PARALLEL, _ARBITRARY))
  return pl.pallas_call(
      functools.partial(_tpu_kernel, cfg=cfg),
      grid=grid, in_specs=in_specs, out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
      out_shape=jax.ShapeDtypeStruct((mp, cfg.n_pad), out_dtype),
      scratch_shapes=[_pltpu.VMEM((bm, bn), acc_type)],
      compiler_params=params, interpret=cfg.interpret,
      name=f"jaxsys_qmatmul_{cfg.scheme}",
  )(*args)


def tpu_config(scheme: str, m: int, k: int, n: int, group_size: int, *, interpret,
               block_m=None, block_n=None, block_k=None) -> Config:
  """Mosaic blocks: M a multiple of 32 (int8/fp8 sublane packing), N and K of 128."""
  bm = block_m or min(256, _round_up(m, 32))
  bn = block_n or (256 if n % 256 == 0 else 128)
  if scheme == "w4a16":
    common = math.gcd(group_size, k // 2)
    bk = block_k or (512 if common % 512 == 0 else 256 if common % 256 == 0 else 128)
    if common % bk or bk % 128:
      raise ValueError(
          f"pallas_qmatmul: w4a16 on TPU needs a block_k (multiple of 128, the lanes of x) "
          f"dividing both group_size={group_size} and K/2={k // 2}; got block_k={bk}")
    k_pad = k
  else:
    bk = block_k or next(b for b in (512, 256, 128) if k % b == 0 or b == 128)
    k_pad = _round_up(k, bk)
  for name, v, mult in (("block_m", bm, 32), ("block_n", bn, 128), ("block_k", bk, 128)):
    if v <= 0 or v % mult:
      raise ValueError(
          f"pallas_qmatmul: {name} must be a positive multiple of {mult} on TPU; got {name}={v}")
  return Config(scheme=scheme, flavor="tpu", block_m=bm, block_n=bn, block_k=bk, split_k=1,
                m_pad=_round_up(m, bm), n_pad=_round_up(n, bn), k_pad=k_pad,
                group_size=group_size, interpret=interpret)


# ----------------------------------------------------------------------------- entry point


def pallas_qmatmul(x: jax.Array, qw: QWeight, *, flavor: str | None = None,
                   interpret: Any = None, block_m: int | None = None,
                   block_n: int | None = None, block_k: int | None = None,
                   split_k: int | None = None, group_m: int = 8) -> jax.Array:
  """x [..., K] @ qw -> [..., N] in x.dtype with the Pallas kernels.

  flavor: "gpu" (Triton) or "tpu" (Mosaic); default by backend ("tpu" on TPU, else
  "gpu"). interpret: as in `backends.resolve_interpret` (None: compiled on the flavor's
  own backend, interpret mode on CPU; for "tpu" also a `pltpu.InterpretParams`). Blocks default
  per shape (`gpu_config`, `tpu_config`); split_k (GPU only) splits K for small grids;
  group_m (GPU only) is the M-block group of the grouped (L2-friendly) tile order.
  """
  check_matmul(x, qw)
  flavor = backends.pallas_flavor("pallas_qmatmul", flavor)
  interpret = backends.resolve_interpret("pallas_qmatmul", flavor, interpret)
  k, n = qw.shape
  lead = x.shape[:-1]
  x2 = x.reshape(-1, k)
  m = x2.shape[0]
  if flavor == "gpu":
    cfg = gpu_config(qw.scheme, m, k, n, qw.group_size, interpret=interpret, block_m=block_m,
                     block_n=block_n, block_k=block_k, split_k=split_k, group_m=group_m)
    call = _gpu_call
  else:
    if split_k not in (None, 1):
      raise ValueError(f"pallas_qmatmul: split_k={split_k} is GPU-only; the TPU grid walks K")
    cfg = tpu_config(qw.scheme, m, k, n, qw.group_size, interpret=interpret, block_m=block_m,
                     block_n=block_n, block_k=block_k)
    call = _tpu_call
  w, scale = qw.data, qw.scale
  if cfg.n_pad != n:  # only when no block divides N: a padded copy of the weight
    w = jnp.pad(w, ((0, 0), (0, cfg.n_pad - n)))
    scale = jnp.pad(scale, ((0, 0), (0, cfg.n_pad - n)), constant_values=1.0)
  if qw.scheme == "w4a16":
    # Same bytes as int8: Mosaic and Triton handle signed bytes best.
    w = lax.bitcast_convert_type(w, jnp.int8)
    xp = jnp.pad(x2, ((0, cfg.m_pad - m), (0, 0)))
    out = call(cfg, x.dtype, xp, w, scale)
  else:
    xq, sx = quantize_activations(x2, qw.scheme)
    xq = jnp.pad(xq, ((0, cfg.m_pad - m), (0, cfg.k_pad - k)))
    sx = jnp.pad(sx, ((0, cfg.m_pad - m), (0, 0)), constant_values=1.0)
    if cfg.k_pad != k:  # zero rows add nothing to the dot
      w = jnp.pad(w, ((0, cfg.k_pad - k), (0, 0)))
    out = call(cfg, x.dtype, xq, w, sx, scale)
  return out[:m, :n].reshape(*lead, n)
