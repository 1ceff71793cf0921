"""Matmul FLOPs one device runs, read from a compiled program's HLO, loops counted in full.

XLA's `cost_analysis()` counts a while loop's body once, so a step that accumulates
gradients over k microbatches, or a pipeline's loop over its ticks, looks k times
cheaper than it is. Here every `dot` costs 2 x (output elements) x (contracted size),
a while loop with a known trip count costs that many bodies, a conditional its most
expensive branch (an upper bound: the branch taken is decided at run time), and a fusion
or call what it calls.
"""
from __future__ import annotations

import functools
import math
import re

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]")
_DOT = re.compile(r" dot\(%([\w.\-]+), %[\w.\-]+\).*lhs_contracting_dims=\{([\d,]*)\}")
_CALLS = re.compile(r"(?:calls|body)=%([\w.\-]+)")
_BRANCHES = re.compile(r"(?:branch_computations=\{([^}]*)\}|true_computation=%([\w.\-]+), "
                       r"false_computation=%([\w.\-]+))")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _dims(text: str) -> tuple[int, ...]:
  return tuple(int(d) for d in text.split(",") if d)


def dot_flops(hlo_text: str) -> float:
  """Matmul FLOPs of the ENTRY computation of `hlo_text` (a compiled program's `as_text()`)."""
  bodies: dict[str, list[str]] = {}
  entry, name = None, None
  for line in hlo_text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      name = match[1]
      bodies[name] = []
      entry = name if line.startswith("ENTRY") else entry
    elif name is not None and line.strip() == "}":
      name = None
    elif name is not None:
      bodies[name].append(line)
  if entry is None:
    raise ValueError("dot_flops: no ENTRY computation in the HLO text")
  shapes = {m[1]: _dims(m[3]) for lines in bodies.values() for m in map(_INSTRUCTION.match, lines)
            if m}

  @functools.cache
  def cost(computation: str) -> float:
    total = 0.0
    for line in bodies[computation]:
      instruction = _INSTRUCTION.match(line)
      dot = _DOT.search(line)
      if dot and instruction:
        lhs = shapes[dot[1]]
        contracted = math.prod(lhs[d] for d in _dims(dot[2]))
        total += 2.0 * math.prod(_dims(instruction[3])) * contracted
      branches = _BRANCHES.search(line)
      if branches:
        names = (re.findall(r"%([\w.\-]+)", branches[1]) if branches[1]
                 else [branches[2], branches[3]])
        total += max(cost(b) for b in names)
      for called in _CALLS.findall(line):
        trips = _TRIPS.search(line) if " while(" in line else None
        total += (int(trips[1]) if trips else 1) * cost(called)
    return total

  return cost(entry)
