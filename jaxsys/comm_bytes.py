"""Communication accounting: the bytes one participant sends, by the ring rules.

Bandwidth-optimal rings, per participant: an all-reduce of n bytes over R sends
2(R-1)/R * n, an all-gather of a c-byte chunk (R-1) * c, an all-to-all of n bytes
(R-1)/R * n, a reduce-scatter to a c-byte chunk (R-1) * c, a collective-permute its whole
buffer. `ring_allreduce_bytes` and `tree_bytes` count what a strategy means to send;
`collective_bytes_from_hlo` applies the same rules to a compiled program's collectives.
"""
from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys import hlo_flops


def tree_bytes(params, dtype=None) -> int:
  """Bytes of the leaves of `params` (in `dtype` if given)."""
  return sum(int(np.prod(x.shape)) * (jnp.dtype(dtype or x.dtype).itemsize)
             for x in jax.tree.leaves(params))


def ring_allreduce_bytes(payload: int, num_replicas: int) -> int:
  """Bytes one participant sends in a ring all-reduce of `payload` bytes: 2(R-1)/R * payload."""
  return 2 * (num_replicas - 1) * payload // num_replicas


_COLLECTIVE = re.compile(
    r"=\s*(\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")
_SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
             "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+), "
                       r"false_computation=%?([\w.\-]+)")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
# The mesh form may name its devices before the grouped axes:
# mesh['a'=2,'b'=4], device_ids=(...) {'a'}.
_GROUPS = re.compile(r"replica_groups=(?:\{\{([0-9,]*)\}|\[[0-9]+,([0-9]+)\]<=|"
                     r"mesh\[([^\]]*)\](?:, device_ids=\((?:[^()]|\([^()]*\))*\))? \{([^}]*)\})")
_COMMENT = re.compile(r"/\*.*?\*/")  # e.g. /*index=5*/ inside long tuple shapes


def _shape_bytes(text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    if dtype not in _ITEMSIZE:
      continue
    total += _ITEMSIZE[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
  return total


def collective_ops_from_hlo(hlo_text: str) -> list[tuple[str, int]]:
  """(op, result bytes) of every collective in an HLO module's text (async -start forms too)."""
  return [(op, _shape_bytes(shape))
          for shape, op in _COLLECTIVE.findall(_COMMENT.sub("", hlo_text))]


def _group_size(line: str, default: int) -> int:
  """Participants per group of the collective on `line`, in any of XLA's three spellings:
  {{0,2,4,6},...}, the iota form [2,4]<=[8], or mesh['a'=2,'b'=4] {'b'}."""
  groups = _GROUPS.search(line)
  if not groups:
    return default
  explicit, iota, mesh, axes = groups.groups()
  if explicit is not None:
    return len(explicit.split(","))
  if iota is not None:
    return int(iota)
  sizes = {name.strip("'"): int(size) for name, size in
           (item.split("=") for item in mesh.split(","))}
  return math.prod(sizes[a.strip().strip("'")] for a in axes.split(",") if a.strip())


def _sent_bytes(line: str, default_group: int, kind: str | None = None) -> int:
  """Bytes one participant sends for the collective on `line` (0 if none, or if not of
  `kind`), by the ring rules."""
  found = _COLLECTIVE.search(line)
  if not found or kind not in (None, found.group(2)):
    return 0
  nbytes, op = _shape_bytes(found.group(1)), found.group(2)
  r = _group_size(line, default_group)
  if op == "all-reduce":
    return 2 * (r - 1) * nbytes // r
  if op in ("all-gather", "all-to-all"):  # all-gather's result is R chunks
    return (r - 1) * nbytes // r
  if op == "reduce-scatter":  # result = one chunk of R
    return (r - 1) * nbytes
  return nbytes  # collective-permute: its whole buffer


def collective_bytes_from_hlo(hlo_text: str, num_replicas: int, trips: bool = False,
                              kind: str | None = None) -> int:
  """Bytes one participant sends when the compiled program runs once (ring rules above);
  of collectives of `kind` only (e.g. "all-gather"), if given.

  Walks the call graph from the ENTRY computation: a conditional counts its largest
  branch (exactly one runs), a called computation counts once, a while body once or,
  with `trips`, as many times as its known trip count (a pipeline's ticks, accumulation's
  microbatches). A collective's group size comes from its `replica_groups`;
  `num_replicas` is used where the HLO lists none. `-start` ops of async collectives
  return (operand, result, ...) tuples, so their bytes count twice; the sync-form ops
  XLA:CPU emits are exact.
  """
  comps, entry = hlo_flops.computations(hlo_text)

  def times(line: str) -> int:
    """How often what `line` calls runs per run of it (a while's body and condition: per
    trip, with `trips`; the condition holds no collectives)."""
    count = hlo_flops.trip_count(line, comps) if trips and " while(" in line else None
    return count or 1

  @functools.cache
  def cost(name: str) -> int:
    total = 0
    for line in comps.get(name, ()):
      total += _sent_bytes(line, num_replicas, kind)
      branches = _BRANCHES.search(line)
      if branches:
        names = (re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches.group(1)
                 else branches.group(2, 3))
        total += max(cost(b) for b in names)
      total += times(line) * sum(cost(c) for c in _CALLS.findall(line))
    return total
  return cost(entry)
