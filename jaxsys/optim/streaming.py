"""Streaming DiLoCo (Douillard et al., arXiv 2501.18512): DiLoCo synced fragment by fragment.

The parameters are split into P fragments: fragment p holds the layers p, p + P, p + 2P,
... (the paper's strided pattern, which it found slightly better than consecutive
layers) and, so that the fragments weigh the same, rows p, p + P, ... of the other
leaves (embedding, final norm, output layer). Each fragment takes DiLoCo's outer step
every H = `sync_every` inner steps, fragment p at t = floor((p + 1) H / P) (mod H), so the
collectives of one round are spread over it and the peak bytes of a sync are about 1/P of
DiLoCo's:

  start of p at t:     Delta_p = mean_i (anchor_p - theta_{i,p}(t))       (all-reduce)
                       anchor_p = OuterOpt(anchor_p, Delta_p)            (Nesterov SGD)
  end of p at t + tau: theta_{i,p} = (1 - alpha) anchor_p + alpha theta_{i,p}(t + tau)

With `overlap_steps` tau > 0 the replicas take tau more inner steps before the fragment's
result lands (the paper's overlap of the collective with computation); `mixing` alpha
keeps that share of the local parameters (0: take the global ones, as DiLoCo does). With
fragments=1, overlap_steps=0, mixing=0 it is `diloco` exactly.

The loop calls `sync` after every inner step for which `due(step)` holds (a start or an
end of some fragment); the state counts those calls, so each one knows, from the static
schedule of a round, which fragments start and which end (one `lax.switch` branch per
event of a round: a conditional whose branches each hold one fragment's collective).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsys.optim import outer as outer_lib

LAYERS = "layers"  # the params key of the stacked [n_layers, ...] blocks


class StreamingState(NamedTuple):
  events: jax.Array  # int32: sync calls done (starts and ends of fragments)
  anchor: Any  # the outer (global) parameters; fragment p's updated at its start
  momentum: Any  # float32, like the parameters: the outer Nesterov momentum


@dataclasses.dataclass(frozen=True)
class Schedule:
  """When fragments start and end within a round of `sync_every` steps (offsets 1..H)."""
  sync_every: int
  fragments: int
  overlap_steps: int

  def start(self, p: int) -> int:
    return (p + 1) * self.sync_every // self.fragments

  def end(self, p: int) -> int:
    return (self.start(p) + self.overlap_steps - 1) % self.sync_every + 1

  def events(self) -> list[tuple[int, tuple[tuple[str, int], ...]]]:
    """[(offset in the round, ((\"start\" | \"end\", fragment), ...))] in time order; at one
    offset the starts come first (with no overlap a fragment ends where it starts)."""
    out = []
    for offset in range(1, self.sync_every + 1):
      acts = tuple(("start", p) for p in range(self.fragments) if self.start(p) == offset)
      acts += tuple(("end", p) for p in range(self.fragments) if self.end(p) == offset)
      if acts:
        out.append((offset, acts))
    return out

  @functools.cached_property
  def _offsets(self) -> frozenset[int]:
    return frozenset(o for o, _ in self.events())

  def due(self, step: int) -> bool:
    """Whether some fragment starts or lands after inner step `step` (the loop asks every
    step, so the round's offsets are computed once)."""
    return step >= 1 and (step - 1) % self.sync_every + 1 in self._offsets

  def starts_up_to(self, p: int, steps: int) -> int:
    """How many times fragment p has started in the first `steps` inner steps."""
    s = self.start(p)
    return 0 if steps < s else (steps - s) // self.sync_every + 1


def _layer_count(params) -> int:
  leaves = jax.tree.leaves(params.get(LAYERS, {})) if isinstance(params, dict) else []
  return int(leaves[0].shape[0]) if leaves else 0


def fragments_of(params, fragments: int) -> list[list[tuple[int, slice]]]:
  """Per fragment p, the (leaf index in `params`' flattened order, slice) pieces it owns:
  rows p, p + P, ... of every leaf's leading axis, the layer axis of the stacked layers.
  One fragment owns every leaf whole."""
  leaves = jax.tree.leaves(params)
  if fragments == 1:
    return [[(i, slice(None)) for i in range(len(leaves))]]
  n_layers = _layer_count(params)
  if not n_layers or n_layers % fragments:
    raise ValueError(f"fragments={fragments} does not divide the model's {n_layers} layers; "
                     f"valid: a divisor of {n_layers}")
  return [[(i, slice(p, None, fragments) if x.ndim else slice(None))
           for i, x in enumerate(leaves) if x.ndim or p == 0] for p in range(fragments)]


def _take(tree, pieces) -> list:
  leaves = jax.tree.leaves(tree)
  return [leaves[i][piece] for i, piece in pieces]


def _put(tree, pieces, values):
  leaves, treedef = jax.tree.flatten(tree)
  for (i, piece), value in zip(pieces, values):
    leaves[i] = value if piece == slice(None) else leaves[i].at[piece].set(value)
  return jax.tree.unflatten(treedef, leaves)


def streaming_diloco(*, sync_every: int, fragments: int, overlap_steps: int = 0,
                     mixing: float = 0.0, lr: float = 0.7, momentum: float = 0.9,
                     nesterov: bool = True,
                     compression: str | None = None) -> outer_lib.OuterOptimizer:
  """Streaming DiLoCo's outer step over `fragments` fragments; see the module docstring."""
  sync_every = outer_lib.check_sync_every(sync_every)
  if isinstance(fragments, bool) or not isinstance(fragments, (int, np.integer)) or fragments < 1:
    raise ValueError(f"fragments={fragments!r} is invalid; it must be an int >= 1")
  if sync_every < fragments:
    raise ValueError(f"sync_every={sync_every} is invalid with fragments={fragments}; it must "
                     "be >= fragments (fragment p syncs at step floor((p + 1) sync_every / "
                     "fragments) of each round)")
  if (isinstance(overlap_steps, bool) or not isinstance(overlap_steps, (int, np.integer))
      or not 0 <= overlap_steps < sync_every):
    raise ValueError(f"overlap_steps={overlap_steps!r} is invalid; it must be an int >= 0 and "
                     f"< sync_every={sync_every} (a fragment's result lands before it syncs again)")
  mixing = outer_lib.check_range("mixing", mixing, 0.0, 1.0)
  outer_lr = outer_lib.check_range("lr", lr, 0.0, lo_open=True)
  outer_momentum = outer_lib.check_range("momentum", momentum, 0.0, 1.0)
  compression = outer_lib.check_compression(compression)
  schedule = Schedule(sync_every, int(fragments), int(overlap_steps))
  events = schedule.events()

  def init(params) -> StreamingState:
    fragments_of(params, schedule.fragments)  # a fragment count that fits, or one line
    return StreamingState(events=jnp.zeros((), jnp.int32), anchor=params,
                          momentum=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

  def outer_step(anchor, momentum, delta):
    """optax.sgd(outer_lr, outer_momentum, nesterov)'s update, term for term (so that one
    fragment is `diloco` exactly), on a fragment's pieces."""
    momentum = [d + outer_momentum * m for d, m in zip(delta, momentum)]
    step = [d + outer_momentum * m for d, m in zip(delta, momentum)] if nesterov else momentum
    anchor = [jnp.asarray(a + -outer_lr * u).astype(a.dtype) for a, u in zip(anchor, step)]
    return anchor, momentum

  def sync(params, state: StreamingState, *, axis_name: str):
    owned = fragments_of(params, schedule.fragments)

    def event(actions, first_round, params, anchor, momentum):
      for kind, p in actions:
        pieces = owned[p]
        if kind == "start":
          delta = [(a - x).astype(jnp.float32)
                   for a, x in zip(_take(anchor, pieces), _take(params, pieces))]
          delta = outer_lib.compressed_mean(delta, axis_name, compression)
          new_anchor, new_momentum = outer_step(_take(anchor, pieces), _take(momentum, pieces),
                                                delta)
          anchor, momentum = _put(anchor, pieces, new_anchor), _put(momentum, pieces, new_momentum)
          continue
        merged, local = _take(anchor, pieces), _take(params, pieces)
        if mixing:
          merged = [((1 - mixing) * g + mixing * x).astype(x.dtype) for g, x in zip(merged, local)]
        if schedule.end(p) < schedule.start(p):  # it started in the previous round: not yet
          merged = [jnp.where(first_round, x, g) for g, x in zip(merged, local)]
        params = _put(params, pieces, merged)
      return params, anchor, momentum

    branches = [lambda *a, acts=acts: event(acts, *a) for _, acts in events]
    args = (state.events < len(events), params, state.anchor, state.momentum)
    if len(branches) == 1:
      params, anchor, momentum = branches[0](*args)
    else:
      params, anchor, momentum = lax.switch(state.events % len(events), branches, *args)
    return params, StreamingState(state.events + 1, anchor, momentum)

  def fragment_bytes(params, num_replicas: int) -> list[int]:
    leaves = jax.tree.leaves(params)
    shape = lambda x, piece: (len(range(*piece.indices(x.shape[0]))), *x.shape[1:])
    return [outer_lib.mean_bytes([jax.ShapeDtypeStruct(shape(leaves[i], piece), jnp.float32)
                                  for i, piece in pieces], num_replicas, compression)
            for pieces in fragments_of(params, schedule.fragments)]

  def bytes_per_sync(params, num_replicas: int) -> int:
    """Bytes of a whole round (every fragment once): DiLoCo's bytes per sync."""
    return sum(fragment_bytes(params, num_replicas))

  def peak_bytes_per_sync(params, num_replicas: int) -> int:
    return max(fragment_bytes(params, num_replicas))

  def bytes_after(params, num_replicas: int, steps: int) -> int:
    return sum(b * schedule.starts_up_to(p, steps)
               for p, b in enumerate(fragment_bytes(params, num_replicas)))

  return outer_lib.OuterOptimizer(
      "streaming_diloco", sync_every, init, sync, bytes_per_sync,
      dict(fragments=schedule.fragments, overlap_steps=schedule.overlap_steps, mixing=mixing,
           lr=outer_lr, momentum=outer_momentum, nesterov=nesterov,
           compression=compression),
      due_at=schedule.due, peak_bytes=peak_bytes_per_sync, bytes_by_step=bytes_after,
      overlaps=schedule.overlap_steps > 0, elementwise=False)
