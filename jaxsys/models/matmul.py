"""The model's one matmul: activations [..., K] times a weight [K, N]."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxsys import mesh as mesh_lib


def splits_sequence() -> bool:
  """Whether the mesh traced under splits the sequence: a `context` axis of size > 1 that
  the compiler lays out (not one a `shard_map` around this code has made manual)."""
  mesh = jax.sharding.get_abstract_mesh()
  return (not mesh.empty and mesh_lib.degrees(mesh).context > 1
          and "context" not in mesh.manual_axes)


def matmul(x, w_KN, **kwargs):
  """x [..., K] @ w [K, N]: one 2-D matmul, its token dims flattened into M, unless the
  sequence is split over `context`. Flattening keeps the weight gradient a
  single-contraction dot ([K, M] x [M, N]); contracting over (batch, length) as two dims
  makes XLA:CPU materialise a transposed copy of the activation gradient first. But M of a
  data-sharded batch and a context-sharded length is no tiling of the devices, so XLA
  all-gathers the length to make it, and every dense layer would run on the whole sequence
  on every context shard: then the token dims stay apart."""
  if x.ndim == 2 or splits_sequence():
    return jax.lax.dot_general(x, w_KN, (((x.ndim - 1,), (0,)), ((), ())), **kwargs)
  return jnp.dot(x.reshape(-1, x.shape[-1]), w_KN, **kwargs).reshape(*x.shape[:-1],
                                                                      w_KN.shape[-1])
