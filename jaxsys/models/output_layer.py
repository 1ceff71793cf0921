"""The output layer and its cross-entropy, with a backward that keeps what it chooses.

`token_losses(h_BTD, w_DV, targets_BT, tiles)`: the per-token cross-entropy [B, T]
(float32) of the logits h @ w. The logits are the matmul's output in the compute dtype
(h's, as every layer's output is; MaxText's and torchtitan's bf16 logits), the loss on
them float32. The backward is written by hand, so what the step keeps for it is decided
here, not by autodiff (which keeps float32 logits or probabilities, and under bf16 makes
the output layer's weight gradient a float32 matmul):

- `tiles=1`: the logits in the compute dtype and each row's logsumexp;
- `tiles=n>1`: only the logsumexp. The forward runs the vocabulary in n tiles with a
  running logsumexp, the backward computes each tile's logits again (one more
  output-layer matmul, as MaxText's `num_vocab_tiling`): no [B, T, V] tensor is ever
  whole, at most a [B, T, V / n] tile.

Tile j holds the vocabulary entries v with v % n == j, so a vocabulary split in
contiguous blocks over a mesh axis stays where it is in every tile.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxsys.models.matmul import matmul

f32 = jnp.float32


def _tiled(w_DV, tiles: int):
  """[tiles, D, V / tiles]: tile j is the columns j, j + tiles, j + 2 tiles, ..."""
  d, v = w_DV.shape
  return jnp.moveaxis(w_DV.reshape(d, v // tiles, tiles), 2, 0)


def _untiled(w_nDV):
  n, d, width = w_nDV.shape
  return jnp.moveaxis(w_nDV, 0, 2).reshape(d, width * n)


def _target_one_hot(targets_BT, tiles: int, tile, width: int):
  """Each token's target as a one-hot row over tile `tile`'s entries; zeros where its
  target is in another tile. (A product, not a gather: gathers from a vocabulary split
  over a mesh axis trip XLA's partitioner.)"""
  index = jnp.where(targets_BT % tiles == tile, targets_BT // tiles, -1)
  return jax.nn.one_hot(index, width, dtype=f32)


def _forward(h_BTD, w_DV, targets_BT, tiles: int):
  """(losses [B, T], logsumexp [B, T], the logits in the compute dtype or None if tiled)."""
  if tiles == 1:
    logits = matmul(h_BTD, w_DV)
    z = logits.astype(f32)
    lse = jax.nn.logsumexp(z, axis=-1)
    return lse - jnp.sum(z * _target_one_hot(targets_BT, 1, 0, z.shape[-1]), -1), lse, logits

  def tile(carry, tile_and_weight):
    peak, total, label = carry
    j, w_c = tile_and_weight
    z = matmul(h_BTD, w_c).astype(f32)
    new_peak = jnp.maximum(peak, jnp.max(z, axis=-1))
    total = total * jnp.exp(peak - new_peak) + jnp.sum(jnp.exp(z - new_peak[..., None]), -1)
    label = label + jnp.sum(z * _target_one_hot(targets_BT, tiles, j, z.shape[-1]), -1)
    return (new_peak, total, label), None

  zeros = jnp.zeros(targets_BT.shape, f32)
  (peak, total, label), _ = jax.lax.scan(
      tile, (jnp.full(targets_BT.shape, -jnp.inf, f32), zeros, zeros),
      (jnp.arange(tiles), _tiled(w_DV, tiles)))
  lse = peak + jnp.log(total)
  return lse - label, lse, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def token_losses(h_BTD, w_DV, targets_BT, tiles: int = 1):
  """Cross-entropy [B, T] of the logits h @ w against `targets` (see the module doc)."""
  return _forward(h_BTD, w_DV, targets_BT, tiles)[0]


def _token_losses_fwd(h_BTD, w_DV, targets_BT, tiles):
  losses, lse, logits = _forward(h_BTD, w_DV, targets_BT, tiles)
  return losses, (h_BTD, w_DV, targets_BT, lse, logits)


def _token_losses_bwd(tiles, saved, d_losses):
  h_BTD, w_DV, targets_BT, lse, logits = saved

  def grads(logits_c, matmul_vjp, tile):
    """(dh, dw) of one tile from its logits: d logits = (softmax - one-hot) x d loss."""
    z = logits_c.astype(f32)
    d_z = (jnp.exp(z - lse[..., None])
           - _target_one_hot(targets_BT, tiles, tile, z.shape[-1])) * d_losses[..., None]
    return matmul_vjp(d_z.astype(logits_c.dtype))

  if tiles == 1:
    _, matmul_vjp = jax.vjp(matmul, h_BTD, w_DV)  # its forward is unused: XLA drops it
    d_h, d_w = grads(logits, matmul_vjp, 0)
    return d_h, d_w, None

  def tile(d_h, tile_and_weight):
    j, w_c = tile_and_weight
    logits_c, matmul_vjp = jax.vjp(matmul, h_BTD, w_c)
    d_h_c, d_w_c = grads(logits_c, matmul_vjp, j)
    return d_h + d_h_c.astype(f32), d_w_c

  d_h, d_w = jax.lax.scan(tile, jnp.zeros(h_BTD.shape, f32),
                          (jnp.arange(tiles), _tiled(w_DV, tiles)))
  return d_h.astype(h_BTD.dtype), _untiled(d_w), None


token_losses.defvjp(_token_losses_fwd, _token_losses_bwd)
