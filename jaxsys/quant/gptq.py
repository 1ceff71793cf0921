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
  if block_size <= 0 or (scheme == "w4a16" and g % min(block_size, g)):
    raise ValueError(f"gptq: block_size={block_size} must be positive and, for w4a16, a "
                     f"multiple or divisor of group_size={g}")
  if not damp > 0:
    raise ValueError(f"gptq: damp={damp} must be > 0")
  return g


def gptq_quantize(w_KN: jax.Array, hessian_KK: jax.Array, scheme: str, *, group_size: int = 128,
                  block_size: int = 128, damp: float = 0.01, act_order: bool = False) -> qm.QWeight:
  """GPTQ-quantized QWeight of w [K, N] given the input Gram matrix X^T X [K, K]."""
  g = _check(w_KN, hessian_KK, scheme, group_size, block_size, damp)
  codes, scale = _gptq(w_KN.astype(jnp.float32), hessian_KK.astype(jnp.float32), scheme, g,
                       min(block_size, w_KN.shape[0]), float(damp), bool(act_order))
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

  groups = k // g
  per_row = lambda s_GN: jnp.repeat(s_GN, g, axis=0)  # [K // g, N] -> [K, N]
  static = act_order or g == k  # per-channel scales, or act-order: fixed from the original w
  if not static:
    block = min(block, g)  # blocks never straddle a group, so a group's scale is set at its start
  scale_GN = jax.vmap(lambda x: _scale(x, scheme))(w.reshape(groups, g, n))
  if act_order:
    perm = jnp.argsort(-jnp.diagonal(h), stable=True)
  else:
    perm = jnp.arange(k)
  wp, hp = w[perm], h[perm][:, perm]
  row_scale = per_row(scale_GN)[perm]  # used when static

  # U upper with H^-1 = U^T U: row i of U holds the update weights of row i's error.
  hinv = jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(hp, lower=True), jnp.eye(k))
  u = jnp.linalg.cholesky(hinv).T

  codes = jnp.zeros((k, n), jnp.float32)
  scales_dyn = []
  for i1 in range(0, k, block):
    i2 = min(i1 + block, k)
    w1, u1 = wp[i1:i2], u[i1:i2, i1:i2]
    if static:
      s1 = row_scale[i1:i2]
    else:  # dynamic groups: a group's scale comes from its rows as updated so far
      if i1 % g == 0:
        scales_dyn.append(_scale(wp[i1:i1 + g], scheme))
      s1 = jnp.broadcast_to(scales_dyn[-1], (i2 - i1, n))

    def row(i, carry, u1=u1, s1=s1):
      w1, c1, e1 = carry
      wi, si = w1[i], s1[i]
      ci = _codes(wi, si, scheme)
      err = (wi - ci * si) / u1[i, i]
      w1 = w1 - jnp.outer(u1[i], err)  # U is upper: rows < i (done) are untouched
      return w1, c1.at[i].set(ci), e1.at[i].set(err)

    zeros = jnp.zeros_like(w1)
    _, c1, e1 = jax.lax.fori_loop(0, i2 - i1, row, (w1, zeros, zeros))
    codes = codes.at[i1:i2].set(c1)
    wp = wp.at[i2:].add(-jnp.dot(u[i1:i2, i2:].T, e1, precision=jax.lax.Precision.HIGHEST))

  inv = jnp.argsort(perm)
  scale = scale_GN if static else jnp.stack(scales_dyn)
  return codes[inv], scale
