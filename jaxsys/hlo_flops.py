"""Matmul FLOPs and HBM bytes one device runs, read from a compiled program's HLO, loops
counted in full.

XLA's `cost_analysis()` counts a while loop's body once, so a step that accumulates
gradients over k microbatches, or a pipeline's loop over its ticks, looks k times
cheaper than it is. Here every `dot` costs 2 x (output elements) x (contracted size), a
`convolution` (how TPU programs write their dots) 2 x its multiply-adds on input values,
a TPU (Mosaic) kernel the FLOPs of its own cost estimate (`pl.CostEstimate`), a while loop
with a known trip count that many bodies (`trip_count`), a conditional its most expensive
branch (an upper bound: the branch taken is decided at run time), and a fusion or call
what it calls. `hbm_bytes` counts the bytes each top-level instruction reads and writes
the same way (see there).
"""
from __future__ import annotations

import functools
import math
import re

_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{$")
_COMMENT = re.compile(r"/\*.*?\*/")  # e.g. /*index=5*/ inside long tuple shapes
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]")
_DOT = re.compile(r" dot\(%([\w.\-]+), %[\w.\-]+\).*lhs_contracting_dims=\{([\d,]*)\}")
_CONV = re.compile(r" convolution\(%([\w.\-]+), %([\w.\-]+)\)(.*)dim_labels=(\w+_\w+->\w+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_KERNEL = re.compile(r'custom_call_target="tpu_custom_call".*?"cost_estimate":\{"flops":"(\d+)"')
_CALLS = re.compile(r"(?:calls|body)=%([\w.\-]+)")
_BRANCHES = re.compile(r"(?:branch_computations=\{([^}]*)\}|true_computation=%([\w.\-]+), "
                       r"false_computation=%([\w.\-]+))")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONDITION = re.compile(r"condition=%([\w.\-]+)")
_CONSTANT = re.compile(r"^\s*%([\w.\-]+) = [su]32\[\]\S* constant\((\d+)\)")
_BELOW = re.compile(r"compare\(%([\w.\-]+), %([\w.\-]+)\), direction=LT")


def trip_count(line: str, computations: dict[str, list[str]]) -> int | None:
  """The trip count of the while loop on `line`: XLA's `known_trip_count` where the HLO
  records it (XLA:CPU), else, from 0, the condition's `counter < N` on a constant over the
  body's `counter + k` (TPU: a scan steps by 1; a windowed einsum's loop may step by 2),
  else None."""
  known = _TRIPS.search(line)
  if known:
    return int(known[1])
  condition, body = _CONDITION.search(line), re.search(r"body=%([\w.\-]+)", line)
  lines = computations.get(condition[1], []) if condition else []
  constants = {m[1]: int(m[2]) for m in map(_CONSTANT.match, lines) if m}
  bounds = [(m[1], constants[m[2]]) for m in map(_BELOW.search, lines)
            if m and m[2] in constants]
  if len(bounds) != 1:
    return None
  counter, bound = bounds[0]
  index = re.search(rf"%{re.escape(counter)} = .*get-tuple-element\(%[\w.\-]+\), index=(\d+)",
                    "\n".join(lines))
  step = _step(computations.get(body[1], []) if body else [], int(index[1])) if index else 1
  return -(-bound // step)


def _step(body: list[str], index: int) -> int:
  """What a loop body adds to its tuple element `index` (the counter): k of `x + k`, else 1."""
  constants = {m[1]: int(m[2]) for m in map(_CONSTANT.match, body) if m}
  root = next((l for l in body if l.lstrip().startswith("ROOT ") and " tuple(" in l), None)
  if root is None:
    return 1
  operands = re.findall(r"%([\w.\-]+)", root.split(" tuple(", 1)[1])
  if index >= len(operands):
    return 1
  update = next((l for l in body if l.lstrip().startswith(f"%{operands[index]} = ")), "")
  add = re.search(r" add\(%([\w.\-]+), %([\w.\-]+)\)", update)
  steps = [constants[a] for a in (add.groups() if add else ()) if a in constants]
  return steps[0] if steps and steps[0] > 0 else 1


def _dims(text: str) -> tuple[int, ...]:
  return tuple(int(d) for d in text.split(",") if d)


def _conv_flops(out_dims, lhs_dims, rhs_dims, attributes: str, labels: str) -> float:
  """2 x the multiply-adds a convolution does on input values (not on its padding or the
  zeros a dilation inserts): TPU programs write a batched dot as a convolution whose batch
  rides on a padded or dilated window, of which one tap per output meets the input."""
  lhs_labels, rest = labels.split("_")
  rhs_labels, out_labels = rest.split("->")
  features = rhs_dims[rhs_labels.index("i")]
  # Spatial dimensions by number, the order `window` lists them in (labels may write
  # them in any order: `1fb0_1i0o->b0f1`).
  spatial = sorted((c for c in lhs_labels if c.isdigit()), key=int)
  found = _WINDOW.search(attributes)
  window = dict(re.findall(r"(\w+)=([\w_]+)", found[1])) if found else {}

  def per_dim(key, default):
    values = window.get(key)
    return [default] * len(spatial) if values is None else values.split("x")

  taps = 1
  for d, size, stride, pad, lhs_dilate, rhs_dilate in zip(
      spatial, per_dim("size", "1"), per_dim("stride", "1"), per_dim("pad", "0_0"),
      per_dim("lhs_dilate", "1"), per_dim("rhs_dilate", "1")):
    n, lo = lhs_dims[lhs_labels.index(d)], int(pad.split("_")[0])
    size, stride, ld, rd = int(size), int(stride), int(lhs_dilate), int(rhs_dilate)
    extent = (n - 1) * ld + 1  # the dilated input: values at multiples of ld
    taps *= sum(1 for o in range(out_dims[out_labels.index(d)]) for k in range(size)
                if 0 <= (x := o * stride + k * rd - lo) < extent and x % ld == 0)
  batch_and_features = math.prod(out_dims) // max(1, math.prod(
      out_dims[out_labels.index(d)] for d in spatial))
  return 2.0 * batch_and_features * features * taps


def _open_braces(line: str, depth: int, quoted: bool) -> tuple[int, bool]:
  """`depth` and `quoted` after `line`: braces outside string literals counted."""
  escaped = False
  for c in line:
    if quoted:
      escaped, quoted = (False, True) if escaped else (c == "\\", c != '"')
    elif c == '"':
      quoted = True
    elif c in "{}":
      depth += 1 if c == "{" else -1
  return depth, quoted


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
  """{computation name: its instructions, one string each} and the ENTRY's name.

  An instruction may span lines: a custom call's backend_config can hold JSON printed
  over many lines, some of them a lone `}`. Its lines are joined, so only a `}` outside
  every instruction ends a computation (libtpu 0.0.50 may follow it with attributes:
  `}, execution_thread="sparsecore"`).
  """
  bodies: dict[str, list[str]] = {}
  entry = name = None
  pending, depth, quoted = [], 0, False
  for line in _COMMENT.sub("", hlo_text).splitlines():
    if pending:
      pending.append(line)
    elif name is None:
      match = _COMPUTATION.match(line)
      if match:
        name = match[2]
        bodies[name] = []
        entry = name if match[1] else entry
      continue
    elif line.lstrip().startswith("}"):  # also `}, execution_thread="sparsecore"`
      name = None
      continue
    else:
      pending = [line]
    depth, quoted = _open_braces(line, depth, quoted)
    if depth <= 0 and not quoted:
      bodies[name].append(" ".join(pending))
      pending, depth = [], 0
  return bodies, entry


def _parse(hlo_text: str) -> tuple[dict[str, list[str]], str, dict[str, tuple[int, ...]]]:
  """The computations of `hlo_text` (name -> lines), the ENTRY's name and every value's dims."""
  bodies, entry = computations(hlo_text)
  if entry is None:
    raise ValueError("dot_flops: no ENTRY computation in the HLO text")
  shapes = {m[1]: _dims(m[3]) for lines in bodies.values() for m in map(_INSTRUCTION.match, lines)
            if m}
  return bodies, entry, shapes


def _costs(bodies, shapes, matmuls: bool = True, kernels: bool = True):
  """A computation's FLOPs, its loops' bodies times their trip counts (once if unknown)."""
  @functools.cache
  def cost(computation: str) -> float:
    total = 0.0
    for line in bodies[computation]:
      instruction = _INSTRUCTION.match(line)
      dot = _DOT.search(line)
      if dot and instruction and matmuls:
        lhs = shapes[dot[1]]
        contracted = math.prod(lhs[d] for d in _dims(dot[2]))
        total += 2.0 * math.prod(_dims(instruction[3])) * contracted
      conv = _CONV.search(line)
      if conv and instruction and matmuls:
        total += _conv_flops(_dims(instruction[3]), shapes[conv[1]], shapes[conv[2]], conv[3],
                             conv[4])
      kernel = _KERNEL.search(line)
      if kernel and kernels:
        total += float(kernel[1])
      branches = _BRANCHES.search(line)
      if branches:
        names = (re.findall(r"%([\w.\-]+)", branches[1]) if branches[1]
                 else [branches[2], branches[3]])
        total += max(cost(b) for b in names)
      trips = (trip_count(line, bodies) or 1) if " while(" in line else 1
      for called in _CALLS.findall(line):
        total += trips * cost(called)
    return total
  return cost


def dot_flops(hlo_text: str, *, matmuls: bool = True, kernels: bool = True) -> float:
  """FLOPs of the ENTRY computation of `hlo_text` (a compiled program's `as_text()`): its
  matmuls (dots, convolutions) and its TPU kernels, or either alone."""
  bodies, entry, shapes = _parse(hlo_text)
  return _costs(bodies, shapes, matmuls, kernels)(entry)


def loops_of_unknown_length(hlo_text: str) -> int:
  """While loops that run FLOPs but whose trip count the HLO does not fix (e.g. a
  blockwise attention's loop over the key blocks a causal query block needs, bounds that
  are values): `dot_flops` counts each body once, so it is then a lower bound."""
  bodies, _, shapes = _parse(hlo_text)
  cost = _costs(bodies, shapes)
  return sum(1 for lines in bodies.values() for line in lines
             if " while(" in line and trip_count(line, bodies) is None
             and cost(re.search(r"body=%([\w.\-]+)", line)[1]) > 0)


# ---------------------------------------------------------------------------------- bytes

_HEAD = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([\d,]*)\]")
_ELEMENT_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
                  "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
                  "f64": 8, "c64": 8, "c128": 16}
# Instructions that move no data of their own: plumbing, and loops and calls whose bodies
# are counted instead. An asynchronous op is counted at its start.
_FREE = frozenset(("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
                   "conditional", "call", "after-all", "partition-id", "replica-id",
                   "opt-barrier", "add-dependency", "domain", "iota"))
_SLICES = ("dynamic-slice", "slice")


def _array_bytes(type_text: str) -> float:
  """Bytes of every array in an HLO type (a tuple's elements summed); f8 types are 1 byte."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(type_text):
    size = 1 if dtype.startswith("f8") else _ELEMENT_BYTES.get(dtype, 0)
    total += size * math.prod(_dims(dims))
  return total


def _balanced(text: str, start: int) -> int:
  """The index just past the bracket that closes the one at `start`."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  return len(text)


def _instruction(line: str) -> tuple[str, str, str, list[str], str] | None:
  """(name, result type, opcode, operand names, attributes) of an instruction line."""
  head = _HEAD.match(line)
  if not head:
    return None
  rest = line[head.end():]
  end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
  type_text, rest = rest[:end], rest[end:].lstrip()
  paren = rest.find("(")
  if paren < 0:
    return None
  close = _balanced(rest, paren)
  return (head[1], type_text, rest[:paren], re.findall(r"%([\w.\-]+)", rest[paren:close]),
          rest[close:])


def _fusion_traffic(lines: list[str], operand_bytes: list[float], out_bytes: float) -> float:
  """What a fusion reads and writes of HBM: each operand whole, except one the fused code
  only slices (it reads the slices) or only updates in place (dynamic-update-slice: it
  reads nothing of it); its output whole, except one written in place (the update)."""
  parsed = [p for p in map(_instruction, lines) if p]
  by_name = {p[0]: p for p in parsed}
  params = {p[0]: int(re.search(r"parameter\((\d+)\)", line)[1])
            for p, line in zip(parsed, lines) if p[2] == "parameter"}
  total = 0.0
  for name, index in params.items():
    if index >= len(operand_bytes):
      continue
    uses = [p for p in parsed if name in p[3]]
    if uses and all(u[2] in _SLICES and u[3][0] == name for u in uses):
      total += sum(_array_bytes(u[1]) for u in uses)
    elif uses and all(u[2] == "dynamic-update-slice" and u[3][0] == name for u in uses):
      continue
    else:
      total += operand_bytes[index]
  root = next((p for p, line in zip(parsed, lines) if line.lstrip().startswith("ROOT ")), None)
  outputs = [by_name.get(o) for o in root[3]] if root and root[2] == "tuple" else [root]
  in_place = sum(_array_bytes(by_name[o[3][1]][1]) if o[3][1] in by_name else 0.0
                 for o in outputs if o and o[2] == "dynamic-update-slice")
  whole = sum(_array_bytes(o[1]) for o in outputs if o and o[2] == "dynamic-update-slice")
  return total + out_bytes - whole + in_place


def hbm_bytes(hlo_text: str) -> float:
  """Bytes the ENTRY computation reads and writes, every loop trip counted.

  Each top-level instruction reads its operands and writes its result, as XLA's cost
  analysis counts them; what happens inside a fusion stays on chip. A slice reads only
  what it takes and a dynamic-update-slice writes only its update (in place), also inside
  a fusion; a while loop is its body times its trip count (once when unknown), a
  conditional its most expensive branch.
  """
  bodies, entry = computations(hlo_text)
  if entry is None:
    raise ValueError("hbm_bytes: no ENTRY computation in the HLO text")
  sizes = {p[0]: _array_bytes(p[1]) for lines in bodies.values()
           for p in map(_instruction, lines) if p}

  @functools.cache
  def traffic(computation: str) -> float:
    total = 0.0
    for line in bodies[computation]:
      parsed = _instruction(line)
      if parsed is None:
        continue
      _, type_text, opcode, operands, attributes = parsed
      out, reads = _array_bytes(type_text), [sizes.get(o, 0.0) for o in operands]
      if opcode == "while":
        body = re.search(r"body=%([\w.\-]+)", attributes)
        total += (trip_count(line, bodies) or 1) * traffic(body[1]) if body else 0.0
      elif opcode == "conditional":
        branches = _BRANCHES.search(attributes)
        names = ((re.findall(r"%([\w.\-]+)", branches[1]) if branches[1]
                  else [branches[2], branches[3]]) if branches else [])
        total += max((traffic(b) for b in names if b in bodies), default=0.0)
      elif opcode == "call":
        called = re.search(r"to_apply=%([\w.\-]+)", attributes)
        total += traffic(called[1]) if called and called[1] in bodies else 0.0
      elif opcode in _FREE or opcode.endswith("-done"):
        continue
      elif opcode == "fusion":
        called = re.search(r"calls=%([\w.\-]+)", attributes)
        total += _fusion_traffic(bodies.get(called[1], []) if called else [], reads, out)
      elif opcode in _SLICES:
        total += 2 * out
      elif opcode == "dynamic-update-slice":
        total += 2 * (reads[1] if len(reads) > 1 else out)
      elif opcode.endswith("-start"):  # the result repeats the operands beside the output
        total += sum(reads) + max(out - sum(reads), 0.0)
      else:
        total += sum(reads) + out
    return total

  return traffic(entry)
