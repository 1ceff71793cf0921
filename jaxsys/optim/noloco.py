"""NoLoCo (Kolehmainen et al., arXiv 2506.10911): no all-reduce; random peer groups, modified Nesterov.

Each replica i keeps its own outer (slow) weights phi_i and momentum delta_i. After
H inner steps to theta_i, replica i averages with a random group G of n replicas
(n = 2 in the paper) and takes the modified Nesterov step, written as the authors'
code computes it (jkolehm/noloco `sparse_optimizer_c.outer_step`):

  delta_i <- alpha delta_i - beta mean_{j in G}(phi_j - theta_j) - gamma (phi_i - mean_{j in G} phi_j)
  phi_i   <- phi_i + delta_i;      theta_i <- phi_i

The gamma term pulls each replica's slow weights toward its group's mean, which is
what keeps replicas together without a global collective. Defaults follow that code's
NoLoCo configs (`SparseOptimizerC`, `*_noloco_mean_*`: outer_lr 0.7, outer_momentum
0.5, local_group_size 2, 50 local steps), where one value plays both beta and gamma.
With beta == gamma the step only needs mean_G(theta_j) (the phi terms cancel:
-beta(mean phi - mean theta) - beta(phi_i - mean phi) = beta(mean theta - phi_i)), so a
replica sends theta once; otherwise it sends phi_j - theta_j and phi_j.

Pairs. The authors' code draws a fresh random permutation at every sync, so any of the
(R-1)!! pairings can occur. `ppermute` needs a static permutation, so here the R-1
rounds of a round-robin 1-factorisation (circle method) are compiled in, one branch
each, and `lax.switch` runs a uniformly drawn round per sync. Every pair of replicas
meets in exactly one round, so at every sync each of replica i's R-1 possible
partners is equally likely (1/(R-1)), independently across syncs, with R-1 compiled
branches (linear in R) and collective-permutes only. What this gives up: only R-1
distinct pairings ever occur (15 of the 2,027,025 at R=16), because a fresh random
relabelling per sync is not free: as a static permutation it needs a branch per
(round, relabelling), and as data movement it moves every replica's parameters and
inner and outer optimizer states, several times the sync's own bytes. So the
relabelling is drawn once from `seed`, at trace time: the seed picks which
1-factorisation is used. The pair frequencies are what gossip averaging needs: in
expectation a sync mixes replica i with every other replica equally. Groups of all R
replicas (group_size = R) are also accepted; other group sizes are refused, since no
R-1-branch schedule makes their pairs equally likely in general. Odd R has no
perfect pairing: an error.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsys import comm_bytes
from jaxsys.optim import outer as outer_lib


class NoLoCoState(NamedTuple):
  rounds: jax.Array  # int32: syncs done (with the seed, picks the round of pairs)
  anchor: Any  # phi_i: this replica's slow weights
  momentum: Any  # delta_i


def circle_rounds(num_replicas: int) -> np.ndarray:
  """[R-1, R] partner tables of the circle method: in round k replica i meets table[k, i].

  Replica R-1 sits at the centre and meets k; the others sit on a circle of R-1 and
  k+i meets k-i (mod R-1), so every pair meets in exactly one round.
  """
  r = num_replicas
  table = np.empty((r - 1, r), np.int64)
  for k in range(r - 1):
    table[k, k], table[k, r - 1] = r - 1, k
    for i in range(1, r // 2):
      a, b = (k + i) % (r - 1), (k - i) % (r - 1)
      table[k, a], table[k, b] = b, a
  return table


def check_group_size(group_size: int, num_replicas: int) -> None:
  """One-line error unless NoLoCo can group `num_replicas` by `group_size` (2 or all of them)."""
  r, n = num_replicas, group_size
  if n != r and n != 2:
    raise ValueError(f"noloco: group_size={n} is invalid for the {r} replicas; valid: 2 "
                     f"(random pairs) or {r} (all replicas)")
  if n != r and r % 2:
    raise ValueError(f"noloco: group_size=2 must divide the {r} replicas (an odd number has "
                     "no perfect pairing); use an even replica count")


def peer_groups(num_replicas: int, group_size: int, seed: int) -> np.ndarray:
  """[rounds, R/n, n] replica ids: the groups of every round a sync may draw.

  n = 2: the R-1 circle-method rounds under a relabelling drawn from `seed`;
  n = R: one round, one group of everyone.
  """
  r, n = num_replicas, group_size
  check_group_size(n, r)
  if n == r:
    return np.arange(r).reshape(1, 1, r)
  label = np.random.default_rng(seed).permutation(r)  # replica label[i] plays position i
  table = circle_rounds(r)
  return np.stack([[(label[i], label[j]) for i, j in enumerate(row) if i < j] for row in table])


def round_index(seed: int, rounds: jax.Array, num_rounds: int) -> jax.Array:
  """The round sync number `rounds` uses: uniform over `num_rounds`, seeded by (seed, rounds)."""
  key = jax.random.fold_in(jax.random.key(seed), rounds)
  return jax.random.randint(key, (), 0, num_rounds)


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


def noloco(*, sync_every: int, lr: float = 0.7, momentum: float = 0.5,
           gamma: float = 0.7, group_size: int = 2, seed: int = 0) -> outer_lib.OuterOptimizer:
  """NoLoCo's outer step (beta = lr, alpha = momentum); group_size 2 or R."""
  sync_every = outer_lib.check_sync_every(sync_every)
  beta = outer_lib.check_range("lr", lr, 0.0, lo_open=True)
  alpha = outer_lib.check_range("momentum", momentum, 0.0, 1.0)
  gamma = outer_lib.check_range("gamma", gamma, 0.0)
  if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) \
      or group_size < 2:
    raise ValueError(f"group_size={group_size!r} is invalid; it must be 2 (random pairs) or "
                     "the number of replicas")
  same = beta == gamma

  def init(params) -> NoLoCoState:
    return NoLoCoState(rounds=jnp.zeros((), jnp.int32), anchor=params,
                       momentum=jax.tree.map(jnp.zeros_like, params))

  def sync(params, state: NoLoCoState, *, axis_name: str):
    schedule = peer_groups(outer_lib.axis_size(axis_name), group_size, seed)

    def with_groups(groups):
      mean = _group_mean_fn(groups, axis_name)

      def step(operands):
        theta, phi = operands
        if same:
          return jax.tree.map(lambda t, p: beta * (mean(t) - p), theta, phi)
        return jax.tree.map(lambda t, p: -beta * mean(p - t) - gamma * (p - mean(p)), theta, phi)
      return step

    pull = lax.switch(round_index(seed, state.rounds, len(schedule)),
                      [with_groups(g) for g in schedule], (params, state.anchor))
    momentum = jax.tree.map(lambda m, d: alpha * m + d, state.momentum, pull)
    anchor = jax.tree.map(lambda p, m: (p + m).astype(p.dtype), state.anchor, momentum)
    return anchor, NoLoCoState(state.rounds + 1, anchor, momentum)

  def bytes_per_sync(params, num_replicas: int) -> int:
    if num_replicas <= 1:
      return 0
    # n-1 collective-permutes of theta (or of phi - theta and phi) in float32
    return (group_size - 1) * comm_bytes.tree_bytes(params, jnp.float32) * (1 if same else 2)

  return outer_lib.OuterOptimizer(
      "noloco", sync_every, init, sync, bytes_per_sync,
      dict(lr=beta, momentum=alpha, gamma=gamma, group_size=group_size, seed=seed))
