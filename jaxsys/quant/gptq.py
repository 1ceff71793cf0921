"""GPTQ (Frantar et al., arXiv 2210.17323): error-compensating weight quantization.

Rows of w [K, N] (input channels) are quantized one at a time; each row's rounding
error, weighted by the inverse Hessian H^-1 (H = X^T X of the layer's calibration
inputs), is pushed onto the rows not yet quantized, which minimises ||X W - X Q||^2
greedily. As in the paper: damping of `damp` x mean(diag H), the upper Cholesky factor
of H^-1 in place of H^-1 itself, lazy batch updates (`block_size` rows at a time,
the rest of W updated once per block), group-wise scales taken when a group starts
(from the already-updated rows), and optional act-order (rows in order of decreasing
diag H; group scales are then fixed up front from the original weight, "static
groups", so groups stay contiguous rows of K as `QWeight` stores them).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxsys.kernels import quant_matmul as qm

_QMAX = {"w8a8_int8": qm.INT8_MAX, "w8a8_fp8": qm.FP8_MAX, "w4a16": qm.INT4_MAX}


def _codes(w, scale, scheme: str):
  """Float codes of w / scale on the scheme's grid (exact in float32)."""
  scaled = w / scale
  if scheme == "w8a8_fp8":
    return jnp.clip(scaled, -qm.FP8_MAX, qm.FP8_MAX).astype(qm.FP8).astype(jnp.float32)
  lo = -8.0 if scheme == "w4a16" else -qm.INT8_MAX
  return jnp.clip(jnp.round(scaled), lo, _QMAX[scheme])


def _scale(w_GN, scheme: str):
  """Symmetric absmax scale over the rows of w_GN -> [N] (as quantize_weight does)."""
  absmax = jnp.max(jnp.abs(w_GN), axis=0)
  return jnp.where(absmax > 0, absmax / _QMAX[scheme], 1.0)


def _check(w_KN, h_KK, scheme, group_size, block_size, damp) -> int:
  if scheme not in qm.SCHEMES:
    raise ValueError(f"gptq: scheme={scheme!r} is not known; choose one of {qm.SCHEMES}")
  if w_KN.ndim != 2 or h_KK.shape != (w_KN.shape[0],) * 2:
    raise ValueError(f"gptq: need w [K, N] and hessian [K, K]; got w {tuple(w_KN.shape)}, "
                     f"hessian {tuple(h_KK.shape)}")
  k = w_KN.shape[0]
  g = group_size if scheme == "w4a16" else k
  if k % g:
    raise ValueError(f"gptq: group_size={group_size} must divide K={k}")
  if not isinstance(block_size, int) or block_size <= 0:
    raise ValueError(f"gptq: block_size={block_size!r} must be a positive int")
  if not damp > 0:
    raise ValueError(f"gptq: damp={damp} must be > 0")
  return g


def gptq_quantize(w_KN: jax.Array, hessian_KK: jax.Array, scheme: str, *, group_size: int = 128,
                  block_size: int = 128, damp: float = 0.01, act_order: bool = False) -> qm.QWeight:
  """GPTQ-quantized QWeight of w [K, N] given the input Gram matrix X^T X [K, K]."""
  g = _check(w_KN, hessian_KK, scheme, group_size, block_size, damp)
  codes, scale = _gptq(w_KN.astype(jnp.float32), hessian_KK.astype(jnp.float32), scheme, g,
                       block_size, float(damp), bool(act_order))
  codes = codes.astype(qm.FP8) if scheme == "w8a8_fp8" else codes.astype(jnp.int8)
  return qm.from_codes(codes, scale, scheme, group_size=g)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _gptq(w, h, scheme, g, block, damp, act_order):
  k, n = w.shape
  diag = jnp.diagonal(h)
  dead = diag == 0  # inputs that are always zero: any code is exact, pick 0
  h = h + jnp.diag(jnp.where(dead, 1.0, 0.0))
  w = jnp.where(dead[:, None], 0.0, w)
  h = h + damp * jnp.mean(jnp.diagonal(h)) * jnp.eye(k)

  # Per-channel scales, or act-order's static groups: fixed from the original w.
  static = act_order or g == k
  # Equal blocks (one loop body, compiled once); with dynamic groups a block never
  # straddles a group, so a group's scale is set when its first block starts.
  block = math.gcd(k if static else g, block)
  scale_GN = jax.vmap(lambda x: _scale(x, scheme))(w.reshape(k // g, g, n))
  perm = jnp.argsort(-jnp.diagonal(h), stable=True) if act_order else jnp.arange(k)
  wp, hp = w[perm], h[perm][:, perm]
  row_scale = jnp.repeat(scale_GN, g, axis=0)[perm]  # [K, N], used when static

  # U upper with H^-1 = U^T U: row i of U holds the update weights of row i's error.
  hinv = jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(hp, lower=True), jnp.eye(k))
  u = jnp.linalg.cholesky(hinv).T
  rows_K = jnp.arange(k)

  def one_block(b, carry):
    wp, codes, scales = carry
    i1 = b * block
    w1 = jax.lax.dynamic_slice_in_dim(wp, i1, block)
    u_rows = jax.lax.dynamic_slice_in_dim(u, i1, block)          # [block, K]
    u1 = jax.lax.dynamic_slice_in_dim(u_rows, i1, block, axis=1)  # [block, block]
    if static:
      s1 = jax.lax.dynamic_slice_in_dim(row_scale, i1, block)
    else:  # dynamic groups: a group's scale comes from its rows as updated so far
      group = i1 // g
      fresh = _scale(jax.lax.dynamic_slice_in_dim(wp, group * g, g), scheme)
      scales = jnp.where(i1 % g == 0, scales.at[group].set(fresh), scales)
      s1 = jnp.broadcast_to(scales[group], (block, n))

    def row(i, carry):
      w1, c1, e1 = carry
      wi, si = w1[i], s1[i]
      ci = _codes(wi, si, scheme)
      err = (wi - ci * si) / u1[i, i]
      w1 = w1 - jnp.outer(u1[i], err)  # U is upper: rows < i (done) are untouched
      return w1, c1.at[i].set(ci), e1.at[i].set(err)

    zeros = jnp.zeros_like(w1)
    _, c1, e1 = jax.lax.fori_loop(0, block, row, (w1, zeros, zeros))
    codes = jax.lax.dynamic_update_slice_in_dim(codes, c1, i1, 0)
    # Lazy batch update: the rows after this block take its errors at once.
    later = (rows_K >= i1 + block)[:, None]
    wp = wp - jnp.where(later, jnp.dot(u_rows.T, e1, precision=jax.lax.Precision.HIGHEST), 0.0)
    return wp, codes, scales

  init = (wp, jnp.zeros((k, n), jnp.float32), jnp.ones((k // g, n), jnp.float32))
  _, codes, scales = jax.lax.fori_loop(0, k // block, one_block, init)
  return codes[jnp.argsort(perm)], scale_GN if static else scales
