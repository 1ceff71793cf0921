"""NoLoCo (Kolehmainen et al., arXiv 2506.10911): no all-reduce; random peer groups, modified Nesterov.

Each replica i keeps its own outer (slow) weights phi_i and momentum delta_i. After
H inner steps to theta_i, replica i averages with a random group G of n replicas
(n = 2 in the paper) and takes the paper's modified Nesterov step (written here as the
authors' code computes it; the paper's text was not available to check equation numbers):

  delta_i <- alpha delta_i - beta mean_{j in G}(phi_j - theta_j) - gamma (phi_i - mean_{j in G} phi_j)
  phi_i   <- phi_i + delta_i;      theta_i <- phi_i

The gamma term pulls each replica's slow weights toward its group's mean, which is
what keeps replicas together without a global collective. Defaults follow the
authors' code (`SparseOptimizerC`, configs `*_noloco_mean_*`): alpha = 0.5,
beta = gamma = 0.7, n = 2, groups from a seeded random permutation at every sync.

Groups change with the sync index but `ppermute` needs a static permutation, so a
seeded pool of permutations is compiled in and `lax.switch` picks one per sync (the
HLO holds collective-permutes in conditional branches, no all-reduce). With
beta == gamma the step only needs mean_G(theta_j) (the phi terms cancel:
-beta(mean phi - mean theta) - beta(phi_i - mean phi) = beta(mean theta - phi_i)), so a
replica sends theta once; otherwise it sends phi_j - theta_j and phi_j.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsys.optim import outer as outer_lib

POOL_SIZE = 16  # permutations compiled into the sync; one is drawn per sync


class NoLoCoState(NamedTuple):
  rounds: jax.Array  # int32: syncs done (also picks the peer groups)
  anchor: Any  # phi_i: this replica's slow weights
  momentum: Any  # delta_i


def peer_groups(num_replicas: int, group_size: int, seed: int,
                pool_size: int = POOL_SIZE) -> np.ndarray:
  """[pool, R/n, n] replica ids: pool entry p splits a seeded random permutation into groups.

  Group g of a permutation `perm` is perm[g::R/n], as the authors' `batched` helper does.
  """
  rng = np.random.default_rng(seed)
  groups = []
  for _ in range(pool_size):
    perm = rng.permutation(num_replicas)
    groups.append(perm.reshape(group_size, num_replicas // group_size).T)
  return np.stack(groups)


def group_index(seed: int, rounds: jax.Array, pool_size: int = POOL_SIZE) -> jax.Array:
  """Which pool entry sync number `rounds` uses: a seeded draw, so groups look random."""
  key = jax.random.fold_in(jax.random.key(seed), rounds)
  return jax.random.randint(key, (), 0, pool_size)


def _group_mean_fn(groups: np.ndarray, axis_name: str):
  """x -> mean of x over this replica's group, by n-1 collective-permutes within the groups."""
  n = groups.shape[1]

  def fn(x):
    total = x
    for shift in range(1, n):
      pairs = [(int(g[k]), int(g[(k + shift) % n])) for g in groups for k in range(n)]
      total = total + lax.ppermute(x, axis_name, pairs)
    return total / n
  return fn


def noloco(*, sync_every: int, outer_lr: float = 0.7, outer_momentum: float = 0.5,
           gamma: float = 0.7, group_size: int = 2, seed: int = 0,
           pool_size: int = POOL_SIZE) -> outer_lib.OuterOptimizer:
  """NoLoCo's outer step (beta = outer_lr, alpha = outer_momentum)."""
  sync_every = outer_lib.check_sync_every(sync_every)
  beta = outer_lib.check_range("outer_lr", outer_lr, 0.0, lo_open=True)
  alpha = outer_lib.check_range("outer_momentum", outer_momentum, 0.0, 1.0)
  gamma = outer_lib.check_range("gamma", gamma, 0.0)
  if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) \
      or group_size < 2:
    raise ValueError(f"group_size={group_size!r} is invalid; it must be an int >= 2")
  if isinstance(pool_size, bool) or not isinstance(pool_size, (int, np.integer)) or pool_size < 1:
    raise ValueError(f"pool_size={pool_size!r} is invalid; it must be an int >= 1")
  same = beta == gamma

  def init(params) -> NoLoCoState:
    return NoLoCoState(rounds=jnp.zeros((), jnp.int32), anchor=params,
                       momentum=jax.tree.map(jnp.zeros_like, params))

  def sync(params, state: NoLoCoState, *, axis_name: str):
    r = outer_lib.axis_size(axis_name)
    if r % group_size:
      raise ValueError(f"noloco: group_size={group_size} must divide the {r} replicas of "
                       f"axis {axis_name!r}")
    pool = peer_groups(r, group_size, seed, pool_size)

    def with_groups(groups):
      mean = _group_mean_fn(groups, axis_name)

      def step(operands):
        theta, phi = operands
        if same:
          pull = jax.tree.map(lambda t, p: beta * (mean(t) - p), theta, phi)
        else:
          pull = jax.tree.map(
              lambda t, p: -beta * mean(p - t) - gamma * (p - mean(p)), theta, phi)
        return pull
      return step

    pull = lax.switch(group_index(seed, state.rounds, pool_size),
                      [with_groups(g) for g in pool], (params, state.anchor))
    momentum = jax.tree.map(lambda m, d: alpha * m + d, state.momentum, pull)
    anchor = jax.tree.map(lambda p, m: (p + m).astype(p.dtype), state.anchor, momentum)
    return anchor, NoLoCoState(state.rounds + 1, anchor, momentum)

  def bytes_per_sync(params, num_replicas: int) -> int:
    if num_replicas <= 1:
      return 0
    # n-1 collective-permutes of theta (or of phi - theta and phi) in float32
    return (group_size - 1) * outer_lib.tree_bytes(params, jnp.float32) * (1 if same else 2)

  return outer_lib.OuterOptimizer(
      "noloco", sync_every, init, sync, bytes_per_sync,
      dict(outer_lr=beta, outer_momentum=alpha, gamma=gamma, group_size=group_size, seed=seed))
