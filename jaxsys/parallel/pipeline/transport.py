"""How microbatches travel between stages: round the stage ring within a replica (`Ring`),
or routed between replicas at every chunk boundary (`Routed`, NoLoCo's random routing).

The executor asks its transport three things: whose rows a microbatch is at a chunk
(`origin`, the replica its loss and weight count for), those rows (`rows`), and where a
lane's output goes (`send`). Only `Routed` knows about routes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxsys.parallel import routing
from jaxsys.parallel.pipeline.layout import AXIS, take
from jaxsys.parallel.schedules import IDLE


class Ring:
  """Each replica runs its own rows: a send goes `step` stages round the ring (and, where
  the schedule sends both ways, `step` back)."""

  def __init__(self, stages: int, replica):
    self.stages, self.replica = stages, replica

  def origin(self, mb_index, g):
    """The replica whose rows microbatch `mb_index` is at chunk g: this one."""
    del mb_index, g
    return self.replica

  def rows(self, mbs, mb_index, g):
    """Microbatch `mb_index`'s rows as chunk g meets them (`mbs`: [R here, M, ...])."""
    del g
    return take(take(mbs, 0), mb_index)

  def send(self, value, sent, step: int, both_ways: bool):
    """`value` to the stage `step` on, and `step` back where `both_ways`: (arrivals)."""
    del sent
    p = self.stages
    ring = lambda d: jax.lax.ppermute(value, AXIS, [(i, (i + d) % p) for i in range(p)])
    return ring(step), ring(-step) if both_ways else None


class Routed(Ring):
  """Every replica holds all R replicas' rows; microbatch m's chunk g runs on the replica
  `offsets[m, g]` on from the one its rows are (`routing.offsets`), so a send first moves
  to the replica that runs the microbatch's next chunk, then round the stage ring."""

  def __init__(self, stages: int, replica, offsets, replicas: int):
    super().__init__(stages, replica)
    self.offsets, self.replicas = offsets, replicas
    self.chunks = offsets.shape[1]

  def _at(self, mb_index, g):
    return self.offsets[mb_index, jnp.clip(g, 0, self.chunks - 1)]

  def origin(self, mb_index, g):
    return (self.replica - self._at(mb_index, g)) % self.replicas

  def rows(self, mbs, mb_index, g):
    return take(take(mbs, self.origin(mb_index, g)), mb_index)

  def send(self, value, sent, step: int, both_ways: bool):
    """`sent`: the lane's (kind, microbatch, chunk); nothing moves for an idle lane."""
    kind, mb_index, g = sent
    hops = jnp.where(kind != IDLE, self._at(mb_index, g + step) - self._at(mb_index, g), 0)
    return super().send(routing.shift(value, hops, self.replicas), sent, step, both_ways)
