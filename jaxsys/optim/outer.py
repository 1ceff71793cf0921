"""Shared pieces of the outer (low-communication) optimizers: the interface, compression, bytes.

An outer optimizer runs every `sync_every` inner steps, once per replica, inside
`jax.vmap(..., axis_name=...)` or `jax.shard_map` over the replica mesh axis, and
does its own collectives over `axis_name`:

  outer = jaxsys.optim.diloco(sync_every=50)
  state = outer.init(params)                                 # per replica
  params, state = outer.sync(params, state, axis_name="replica")
  outer.bytes_per_sync(params, num_replicas=4)               # bytes ONE replica sends

Byte counts follow the ring rules of `jaxsys.comm_bytes`, per replica.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsys import mesh as mesh_lib
from jaxsys.comm_bytes import ring_allreduce_bytes, tree_bytes

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
