"""Shared pieces of the outer (low-communication) optimizers: the interface, compression, bytes.

An outer optimizer runs every `sync_every` inner steps, once per replica, inside
`jax.vmap(..., axis_name=...)` or `jax.shard_map` over the replica mesh axis, and
does its own collectives over `axis_name`:

  outer = jaxsys.optim.diloco(sync_every=50)
  state = outer.init(params)                                 # per replica
  params, state = outer.sync(params, state, axis_name="replica")
  outer.bytes_per_sync(params, num_replicas=4)               # bytes ONE replica sends

Byte counts assume bandwidth-optimal ring algorithms, per replica: all-reduce of n
bytes sends 2(R-1)/R * n, all-gather of a c-byte chunk sends (R-1) * c, all-to-all
of n bytes sends (R-1)/R * n, a collective-permute sends its whole buffer.
`collective_bytes_from_hlo` applies the same rules to a compiled program's collectives.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsys import hlo_flops
from jaxsys import mesh as mesh_lib

COMPRESSIONS = (None, "bf16", "int8", "fp8")
_QMAX = {"int8": 127.0, "fp8": 448.0}  # largest magnitude of int8 / float8_e4m3fn
_QDTYPE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class OuterOptimizer:
  """An outer optimizer: `init(params) -> state`, `sync(params, state, *, axis_name)`.

  The loop calls `sync` after each inner step for which `due(step)` holds (every
  `sync_every` steps unless `due_at` says otherwise). `bytes_per_sync` is what one replica
  sends per round of `sync_every` steps; `peak_bytes_per_sync` the most one call sends.
  `overlaps`: a sync's result is not needed by the next inner step, so the loop may run
  the two as one program and the collective can overlap that step's compute.
  `elementwise`: `sync` treats every parameter entry alike, so it runs on any view of the
  parameters (a pipeline's stages); False (Streaming DiLoCo's layer fragments) needs the
  canonical `[layers, ...]` form.
  `in_flight`: the state field an overlapping sync averages last; `sync(...,
  axis_name=None)` leaves it un-averaged, for the caller to average apart from the steps
  (`jaxsys.train.comm_device`) and write back before the next sync.
  """
  name: str
  sync_every: int
  init: Callable[[Any], Any]
  sync: Callable[..., tuple[Any, Any]]
  bytes_per_sync: Callable[[Any, int], int]
  hparams: dict[str, Any] = dataclasses.field(default_factory=dict)
  due_at: Callable[[int], bool] | None = None
  peak_bytes: Callable[[Any, int], int] | None = None
  bytes_by_step: Callable[[Any, int, int], int] | None = None
  overlaps: bool = False
  elementwise: bool = True
  in_flight: str | None = None

  def due(self, step: int) -> bool:
    """Whether the loop calls `sync` after inner step `step` (1-based)."""
    return self.due_at(step) if self.due_at else step % self.sync_every == 0

  def peak_bytes_per_sync(self, params, num_replicas: int) -> int:
    return (self.peak_bytes or self.bytes_per_sync)(params, num_replicas)

  def bytes_after(self, params, num_replicas: int, steps: int) -> int:
    """Bytes one replica has sent after `steps` inner steps."""
    if self.bytes_by_step:
      return self.bytes_by_step(params, num_replicas, steps)
    return steps // self.sync_every * self.bytes_per_sync(params, num_replicas)


def check_sync_every(sync_every: Any, where: str = "sync_every") -> int:
  """sync_every must be an int >= 1 (bools and floats are refused so 2.5 never truncates)."""
  if isinstance(sync_every, (bool, np.bool_)) or not isinstance(sync_every, (int, np.integer)) \
      or sync_every < 1:
    raise ValueError(f"{where}={sync_every!r} is invalid; it must be an int >= 1 "
                     "(inner steps between outer syncs)")
  return int(sync_every)


def check_compression(compression: Any, where: str = "compression") -> str | None:
  if compression in ("none", ""):
    compression = None
  if compression not in COMPRESSIONS:
    raise ValueError(f"{where}={compression!r} is unknown; valid: none, bf16, int8, fp8")
  return compression


def check_range(name: str, value: Any, lo: float, hi: float | None = None, *,
                lo_open: bool = False) -> float:
  """One-line error unless lo <= value (< or <=) hi."""
  ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool) \
      and math.isfinite(value) and (value > lo if lo_open else value >= lo) \
      and (hi is None or value <= hi)
  if not ok:
    bound = f"{'>' if lo_open else '>='} {lo}" + ("" if hi is None else f" and <= {hi}")
    raise ValueError(f"{name}={value!r} is invalid; it must be a number {bound}")
  return float(value)


def axis_size(axis_name: str) -> int:
  """Size of a named axis inside vmap or shard_map (a static int)."""
  return int(lax.axis_size(axis_name))


def tree_bytes(params, dtype=None) -> int:
  """Bytes of the leaves of `params` (in `dtype` if given)."""
  return sum(int(np.prod(x.shape)) * (jnp.dtype(dtype or x.dtype).itemsize)
             for x in jax.tree.leaves(params))


def ring_allreduce_bytes(payload: int, num_replicas: int) -> int:
  """Bytes one participant sends in a ring all-reduce of `payload` bytes: 2(R-1)/R * payload."""
  return 2 * (num_replicas - 1) * payload // num_replicas


def num_workers(mesh_spec, devices=None) -> int:
  """Workers whose bytes a run counts: the `replica` axis's size when it has one, else the
  data-parallel shards (`data` x `fsdp`), from any spec `jaxsys.mesh.make_mesh` accepts."""
  shape = dict(mesh_lib.make_mesh(mesh_spec, devices).shape)
  if shape.get("replica", 1) > 1:
    return shape["replica"]
  return shape.get("data", 1) * shape.get("fsdp", 1)


# ---------------------------------------------------------------------------
# Compressed mean over the replica axis
# ---------------------------------------------------------------------------


def _quantize(x_RM, kind: str):
  """Rows of x [R, M] -> (q [R, M], scale [R]): one absmax scale per row (bf16: no scale)."""
  if kind == "bf16":
    return x_RM.astype(jnp.bfloat16), jnp.ones(x_RM.shape[:1], jnp.float32)
  scale = jnp.max(jnp.abs(x_RM), axis=-1) / _QMAX[kind]
  scale = jnp.where(scale > 0, scale, 1.0).astype(jnp.float32)
  y = x_RM / scale[:, None]
  if kind == "int8":
    y = jnp.clip(jnp.round(y), -127, 127)
  return y.astype(_QDTYPE[kind]), scale


def _dequantize(q, scale):
  return q.astype(jnp.float32) * scale[..., None]


def _chunks(x, num: int):
  """x -> [num, ceil(size/num)] float32, zero-padded."""
  m = -(-x.size // num)
  return jnp.pad(x.reshape(-1).astype(jnp.float32), (0, num * m - x.size)).reshape(num, m)


def quantize_roundtrip(x, kind: str | None, chunks: int = 1):
  """x -> dequantize(quantize(x)), one scale per chunk as `compressed_mean` sends it."""
  if kind is None:
    return x
  q, s = _quantize(_chunks(x, chunks), kind)
  return _dequantize(q, s).reshape(-1)[:x.size].reshape(x.shape).astype(x.dtype)


_WIRE = {"bf16": (jnp.bfloat16, jnp.uint16), "fp8": (jnp.float8_e4m3fn, jnp.uint8)}


def _on_wire(q, kind: str):
  """bf16/fp8 travel as their bits: XLA:CPU widens bf16/f8 collectives to f32/f16."""
  return lax.bitcast_convert_type(q, _WIRE[kind][1]) if kind in _WIRE else q


def _off_wire(q, kind: str):
  return lax.bitcast_convert_type(q, _WIRE[kind][0]) if kind in _WIRE else q


def _quantized_mean(x, axis_name: str, kind: str, num: int):
  """Mean over `axis_name` of x, sent as bf16/int8/fp8: reduce-scatter by all-to-all + all-gather.

  A low-precision all-reduce would overflow (int8) or sum in the wire type (and
  XLA:CPU widens bf16/f8 all-reduces to f32/f16), so: split x into R chunks, quantize
  each with its own scale, all-to-all them so replica r holds every replica's chunk r,
  dequantize and average in float32, re-quantize the averaged chunk and all-gather it.
  Wire bytes per replica: 2(R-1)/R * n * itemsize plus the scales (int8/fp8), i.e.
  the ring all-reduce volume at 1 or 2 bytes per value.
  """
  n = x.size
  q, s = _quantize(_chunks(x, num), kind)
  q = _off_wire(lax.all_to_all(_on_wire(q, kind), axis_name, 0, 0, tiled=True), kind)
  if kind != "bf16":
    s = lax.all_to_all(s, axis_name, 0, 0, tiled=True)
  mean_chunk = jnp.mean(_dequantize(q, s), axis=0)  # row j came from replica j
  q2, s2 = _quantize(mean_chunk[None], kind)
  q_all = _off_wire(lax.all_gather(_on_wire(q2[0], kind), axis_name, tiled=False), kind)  # [R, M]
  s_all = lax.all_gather(s2[0], axis_name, tiled=False) if kind != "bf16" else jnp.ones(num)
  return _dequantize(q_all, s_all).reshape(-1)[:n].reshape(x.shape).astype(x.dtype)


def compressed_mean(tree, axis_name: str, compression: str | None):
  """Mean of `tree` over `axis_name`, sent as float32 (all-reduce) or bf16 / int8 / fp8."""
  if compression is None:
    return lax.pmean(tree, axis_name)
  num = axis_size(axis_name)
  return jax.tree.map(lambda x: _quantized_mean(x, axis_name, compression, num), tree)


def mean_bytes(params, num_replicas: int, compression: str | None) -> int:
  """Bytes one replica sends for `compressed_mean(params)` over `num_replicas` replicas."""
  r = num_replicas
  if r <= 1:
    return 0
  if compression is None:
    return ring_allreduce_bytes(tree_bytes(params, jnp.float32), r)
  itemsize, scale = (2, 0) if compression == "bf16" else (1, 4)
  total = 0
  for x in jax.tree.leaves(params):
    m = -(-int(np.prod(x.shape)) // r)
    # all-to-all of [R, m] values (+ [R] f32 scales), then all-gather of m values (+ a scale)
    total += 2 * (r - 1) * (m * itemsize + scale)
  return total


# ---------------------------------------------------------------------------
# Bytes on the wire, read from a compiled program
# ---------------------------------------------------------------------------

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
