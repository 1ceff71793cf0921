"""NoLoCo's random routing (arXiv 2506.10911): microbatches hop between the replicas' pipelines.

R replicas each run a pipeline over the `stage` axis. With random routing a microbatch
leaves stage s of its replica for stage s+1 of a replica drawn per microbatch, and its
gradient comes back the same way; the paper credits this mixing for keeping replicas
close without an all-reduce. Here the draw at each chunk boundary is a cyclic shift k
over `replica`, uniform in [0, R): the microbatch on replica i moves to (i + k) mod R, so
every boundary's move is a permutation of the replicas (each sends and receives one
microbatch) and every destination, the own replica included, has probability 1/R, as
under the authors' uniformly drawn permutations (jkolehm/noloco `dipaco_pipeline.py`).
What this gives up: a boundary's permutation is one of the R cyclic shifts, not any of R!.

Draws are `jax.random` of (seed, step, microbatch, boundary): they change every step and
are the same on every device. `offsets[m, g]` is the sum of microbatch m's shifts before
chunk g, so chunk g of the microbatch that started on replica r runs on r + offsets[m, g].

The move itself (`shift`): XLA needs a static permutation per collective, and choosing
one of R ppermutes by a `lax.switch` does not work here: in one tick different stages
move different microbatches, so the branch differs between stage groups, and XLA:CPU
rendezvouses a collective-permute over every device of the program (measured: a 4x2
mesh deadlocks, or returns wrong rows, when the stage groups take different branches).
So every device runs the same ceil(log2 R) ppermutes, shifting by 1, 2, 4, ..., and
keeps each result or not by one bit of its own k: ceil(log2 R) times an activation's
bytes per move (R = 2: once, as the switch would), no data-dependent collective.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys import mesh as mesh_lib

AXIS = mesh_lib.REPLICA
ROUTINGS = ("fixed", "random")
# The routing draws' own stream of the seed, so they are independent of NoLoCo's pairings
# (which fold the same seed with the sync count).
_STREAM = 0x726F7574  # "rout"


def draw_shifts(seed: int, step, replicas: int, microbatches: int, chunks: int) -> jax.Array:
  """[microbatches, chunks - 1] int32 shifts, uniform in [0, replicas), drawn from (seed, step)."""
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _STREAM), step)
  return jax.random.randint(key, (microbatches, chunks - 1), 0, replicas, jnp.int32)


def offsets(shifts, replicas: int):
  """[M, G-1] shifts -> [M, G] offsets: chunk g of a microbatch runs offsets[m, g] replicas on."""
  zero = jnp.zeros((shifts.shape[0], 1), jnp.int32)
  return jnp.concatenate([zero, jnp.cumsum(shifts, axis=1, dtype=jnp.int32)], axis=1) % replicas


def routes(shifts, replicas: int) -> np.ndarray:
  """[M, G, R]: the replica that runs chunk g of the microbatch m that started on replica r."""
  off = np.asarray(offsets(jnp.asarray(shifts), replicas))
  return (np.arange(replicas)[None, None, :] + off[:, :, None]) % replicas


def hops(replicas: int) -> int:
  """ppermutes one `shift` runs: ceil(log2 R)."""
  return math.ceil(math.log2(replicas)) if replicas > 1 else 0


def shift(x, k, replicas: int, axis: str = AXIS):
  """x of replica (i - k) mod R, on every replica i; k must be the same across `axis`.

  Shifts by 2^b, each kept where bit b of k is set: every device runs the same collectives.
  """
  k = jnp.asarray(k) % replicas
  for b in range(hops(replicas)):
    step = 1 << b
    moved = jax.lax.ppermute(x, axis, [(i, (i + step) % replicas) for i in range(replicas)])
    x = jnp.where((k >> b) & 1 == 1, moved, x)
  return x
