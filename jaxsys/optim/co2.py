"""CO2 (Sun et al., arXiv 2401.16265): one-step-delayed outer update, staleness penalty, clipping.

Local updating as in DiLoCo, but the all-reduce of round t's local parameters is
only *consumed* at the end of round t+1, so it can run while round t+1 computes
(Fig. 1: the outer update starts every tau local steps, "concurrently launching an
asynchronous all-reduce"). At the end of round t (local parameters x_{t,tau}^(i), outer
parameters x_{t,0}); the paper's text beyond its abstract and Fig. 1 was not available
here, so the update is written as the authors' code computes it:

  g_{t-1}   = (x_{t-1,0} - mean_i x_{t-1,tau}^(i)) / lambda    # last round's average, stale by one
  m_t       = clip(beta m_{t-1} + g_{t-1}, c)                   # outer momentum clipping
  x_{t+1,0} = x_{t,0} - alpha m_t
  launch mean_i x_{t,tau}^(i)                                   # consumed at the next sync

lambda is the staleness gap penalty and clip is element-wise to [-c, c], as in the
authors' code (fairscale-CO2 `CO2DistributedDataParallel`: `co2_gap_penalty`,
`co2_clip_threshold`; there `torch.clamp` is not in place, so its clipping is a no-op).
The first sync has no average yet, so round 1 starts where round 0 did; round 0's
progress arrives one sync later.

Stability. In a direction the H inner steps fully converge (the round's pseudo-gradient
is the whole distance to the local optimum), the delayed heavy-ball recursion
x_{t+1} = x_t - (alpha/lambda) (beta m_{t-1} + (x_{t-1} - x*)) has spectral radius
< 1 only when alpha / lambda < 1 - beta. The authors' code's defaults (alpha = outer_lr
1.0, beta = outer_momentum 0.5, lambda = 1.0) sit outside it (1 >= 0.5) and diverged in
our LM comparison. The defaults here keep alpha and beta and set lambda = 3 (1/3 < 0.5);
a configuration outside the bound is a ValueError unless `allow_unstable=True`, which
only warns (e.g. `co2(..., staleness_penalty=1.0, allow_unstable=True)` for the
published values).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from absl import logging
from jax import lax

from jaxsys.optim import outer as outer_lib


class CO2State(NamedTuple):
  rounds: jax.Array  # int32: syncs done
  anchor: Any  # x_{t,0}
  prev_anchor: Any  # x_{t-1,0}
  pending: Any  # mean_i x_{t-1,tau}^(i): the average launched at the previous sync
  momentum: Any


# The defaults: the authors' lr and momentum; a penalty inside the stability bound.
DEFAULTS = {"lr": 1.0, "momentum": 0.5, "staleness_penalty": 3.0}


def stable(lr: float | None = None, momentum: float | None = None,
           staleness_penalty: float | None = None) -> bool:
  """Whether lr / staleness_penalty < 1 - momentum, CO2's stability bound (None: the
  default)."""
  lr, momentum, penalty = (DEFAULTS[k] if v is None else v for k, v in (
      ("lr", lr), ("momentum", momentum), ("staleness_penalty", staleness_penalty)))
  return lr / penalty < 1.0 - momentum


def co2(*, sync_every: int, lr: float = DEFAULTS["lr"], momentum: float = DEFAULTS["momentum"],
        staleness_penalty: float = DEFAULTS["staleness_penalty"],
        momentum_clip: float | None = None,
        allow_unstable: bool = False) -> outer_lib.OuterOptimizer:
  """CO2's outer step; `momentum_clip=None` turns clipping off (the authors' default).

  Refuses alpha / lambda >= 1 - beta (unstable; see the module docstring) unless
  `allow_unstable`, which warns instead.
  """
  sync_every = outer_lib.check_sync_every(sync_every)
  alpha = outer_lib.check_range("lr", lr, 0.0, lo_open=True)
  beta = outer_lib.check_range("momentum", momentum, 0.0, 1.0)
  lam = outer_lib.check_range("staleness_penalty", staleness_penalty, 0.0, lo_open=True)
  clip = None if momentum_clip is None else outer_lib.check_range(
      "momentum_clip", momentum_clip, 0.0, lo_open=True)
  if not stable(alpha, beta, lam):
    fix = f"staleness_penalty > {alpha / (1.0 - beta):g}" if beta < 1 else "momentum < 1"
    msg = (f"lr={alpha:g}, momentum={beta:g}, staleness_penalty={lam:g} are outside "
           f"CO2's stability bound lr / staleness_penalty < 1 - momentum "
           f"({alpha / lam:g} >= {1.0 - beta:g}); use {fix} or allow_unstable=True")
    if not allow_unstable:
      raise ValueError(msg)
    logging.warning("co2 (allow_unstable=True): %s", msg)

  def init(params) -> CO2State:
    zeros = jax.tree.map(jnp.zeros_like, params)
    return CO2State(rounds=jnp.zeros((), jnp.int32), anchor=params, prev_anchor=params,
                    pending=params, momentum=zeros)

  def sync(params, state: CO2State, *, axis_name: str):
    # Independent of this round's collective below: the update never waits for it.
    have = (state.rounds > 0).astype(jnp.float32)
    grad = jax.tree.map(lambda a, p: have * (a - p) / lam, state.prev_anchor, state.pending)
    momentum = jax.tree.map(lambda m, g: beta * m + g, state.momentum, grad)
    if clip is not None:
      momentum = jax.tree.map(lambda m: jnp.clip(m, -clip, clip), momentum)
    anchor = jax.tree.map(lambda a, m: (a - alpha * m).astype(a.dtype), state.anchor, momentum)
    # axis_name=None: the caller averages `pending` (the loop's communication twins).
    pending = params if axis_name is None else lax.pmean(params, axis_name)
    return anchor, CO2State(state.rounds + 1, anchor, state.anchor, pending, momentum)

  def bytes_per_sync(params, num_replicas: int) -> int:
    return outer_lib.mean_bytes(params, num_replicas, None)

  return outer_lib.OuterOptimizer(
      "co2", sync_every, init, sync, bytes_per_sync,
      dict(lr=alpha, momentum=beta, staleness_penalty=lam, momentum_clip=clip,
           allow_unstable=allow_unstable), overlaps=True, in_flight="pending")
