"""Kernels under a device mesh: `jax.shard_map` over the axes a kernel computes independently.

A Pallas kernel is a custom call that XLA's partitioner cannot split: on a multi-device
mesh it would gather its operands and compute the whole global problem on every device.
These wrappers run it once per shard instead, splitting
- attention over batch and heads (a shard holds q heads with exactly the kv heads they read),
- qmatmul over the token dims of x and the weight's output features N.
The mesh is the one visible while tracing (`jax.set_mesh`, or `under_mesh` for a function
jitted with shardings, as the train step is), else the one in the operands' types. A dim is split over the
Explicit axes its operand's type names, then the Auto axes the logical-axis rules of
`jaxsys.mesh` give it (`batch`, `heads`, `mlp`); an axis that does not divide the dim is
left out (the dim is replicated over it), as is every axis already manual.
Context parallelism plugs in here too: `sharded_context_attention` also splits the
sequence over one axis and runs a ring kernel (jaxsys.parallel.context) across it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from jaxsys import mesh as mesh_lib
from jaxsys.kernels import backends

# Replicas of the outer optimizers run under `jax.vmap(spmd_axis_name="replica")`, which
# puts the vmapped dim on this axis; a kernel's own dims must not use it too.
_VMAPPED_AXES = (mesh_lib.REPLICA,)


def under_mesh(fn: Callable, mesh) -> Callable:
  """fn, traced with `mesh` visible, for `jax.jit` with shardings on a `Mesh`.

  Without it the kernels find the mesh only in the types of committed array arguments
  (not of numpy inputs); `jax.set_mesh` cannot be entered inside `jax.jit`, this can.
  The kernels are chosen for the mesh's devices (a TPU slice's, compiled from a CPU host).
  """
  target = mesh.devices.flat[0].platform

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), backends.targeting(target):
      return fn(*args, **kwargs)
  return traced


def _names(entry) -> tuple[str, ...]:
  """A PartitionSpec entry as a tuple of mesh axis names."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]):
  return None if not axes else axes[0] if len(axes) == 1 else axes


def _axes_of(mesh, axis_type) -> set[str]:
  return {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == axis_type}


def _free(mesh) -> set[str]:
  """The axes a kernel may still split over: not manual (inside an enclosing shard_map)."""
  return _axes_of(mesh, AxisType.Auto) | _axes_of(mesh, AxisType.Explicit)


def _mesh(*operands):
  """The mesh visible while tracing, else the first one in the operands' types; may be empty."""
  mesh = jax.sharding.get_abstract_mesh()
  for x in operands:
    if not mesh.empty:
      break
    mesh = jax.typeof(x).sharding.mesh
  return mesh


def _typed(x, dim: int) -> tuple[str, ...]:
  """The Explicit mesh axes x's type splits `dim` over (Auto layouts are not in the type)."""
  spec = jax.typeof(x).sharding.spec
  return _names(spec[dim]) if dim < len(spec) else ()


def _rule(mesh, logical: str) -> tuple[str, ...]:
  """The Auto mesh axes the logical-axis rules give `logical` on this mesh."""
  auto = _axes_of(mesh, AxisType.Auto) - set(_VMAPPED_AXES)
  entry = mesh_lib.logical_to_partition_spec((logical,), mesh)[0]
  return tuple(a for a in _names(entry) if a in auto)


def _split(mesh, size: int, candidates: tuple[str, ...], used: set[str]) -> tuple[str, ...]:
  """The candidates, in order, whose sizes multiply to a divisor of `size`; adds them to used."""
  free, picked, parts = _free(mesh), [], 1
  for a in candidates:
    if a in free and a not in used and size % (parts * mesh.shape[a]) == 0:
      picked.append(a)
      used.add(a)
      parts *= mesh.shape[a]
  return tuple(picked)


def _fit(mesh, x, spec: P):
  """x resharded to `spec`'s Explicit axes where its type differs: shard_map needs a match."""
  explicit = _axes_of(mesh, AxisType.Explicit)
  target = [tuple(a for a in _names(e) if a in explicit) for e in spec]
  target += [()] * (x.ndim - len(target))
  typed = jax.typeof(x).sharding.spec
  have = [_names(typed[d]) if d < len(typed) else () for d in range(x.ndim)]
  if not explicit or have == target:
    return x
  return jax.sharding.reshard(x, P(*map(_entry, target)))


def _splittable(mesh) -> bool:
  return not mesh.empty and math.prod(mesh.shape[a] for a in _free(mesh)) > 1


def _shard_map(per_shard: Callable, mesh, args: list, in_specs: list, out_specs: P):
  def run():
    fitted = [_fit(mesh, x, s) for x, s in zip(args, in_specs)]
    # check_vma=False: pallas_call has no varying-manual-axes rule; the specs say it all.
    return jax.shard_map(per_shard, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                         axis_names=_free(mesh), check_vma=False)(*fitted)

  if jax.sharding.get_abstract_mesh().empty:  # the mesh came from the operands' types
    with jax.sharding.use_abstract_mesh(mesh):
      return run()
  return run()


def attention_spec(mesh, q, k) -> tuple[P, int]:
  """The PartitionSpec of q, k, v (and the output) for the kernel's shard_map on `mesh`,
  and how many times each K/V head is repeated first (`repeat_kv`).

  Heads are split by the axes dividing Hq. Where their product n does not divide Hkv but
  is a multiple of it (fewer K/V heads than `tensor`), each K/V head is repeated n / Hkv
  times, as the references replicate K/V heads: a shard then holds Hq / n query heads and
  the one K/V head they read. Otherwise heads are split only by axes dividing Hkv, so q
  head h and kv head h // (Hq // Hkv) share a shard.
  """
  used: set[str] = set()
  batch = _split(mesh, q.shape[0], _typed(q, 0) + _rule(mesh, "batch"), used)
  candidates = _typed(q, 2) + _rule(mesh, "heads")
  heads = _split(mesh, q.shape[2], candidates, set(used))
  parts, kv = math.prod(mesh.shape[a] for a in heads), k.shape[2]
  if kv % parts == 0 or parts % kv:
    heads = _split(mesh, kv, candidates, used)
    parts = kv
  return P(_entry(batch), None, _entry(heads), None), parts // kv


def repeat_kv(k, v, repeat: int):
  """Each K/V head `repeat` times in a row (its gradient sums over the copies)."""
  if repeat == 1:
    return k, v
  return jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)


def sharded_attention(kernel: Callable, q, k, v, q_segment_ids, kv_segment_ids, **kw):
  """kernel(q, k, v, q_segment_ids=..., kv_segment_ids=..., **kw) split over batch and heads.

  q [B, T, Hq, D], k/v [B, S, Hkv, D], segment ids [B, T] / [B, S] or None.
  """
  mesh = _mesh(q, k, v)
  if not _splittable(mesh):
    return kernel(q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, **kw)
  qkv, repeat = attention_spec(mesh, q, k)
  k, v = repeat_kv(k, v, repeat)
  args, specs = [q, k, v], [qkv] * 3
  if q_segment_ids is not None:
    args += [q_segment_ids, kv_segment_ids]
    specs += [P(qkv[0], None)] * 2

  def per_shard(q, k, v, *ids):
    q_ids, kv_ids = ids or (None, None)
    return kernel(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, **kw)

  return _shard_map(per_shard, mesh, args, specs, qkv)


def sharded_context_attention(kernel: Callable, q, k, v, q_segment_ids, kv_segment_ids,
                              positions, *, axis: str, **kw):
  """kernel(q, k, v, axis_name=axis, segment_ids=..., positions=..., **kw) with the sequence
  split over mesh axis `axis` (which must divide T), batch and heads as `sharded_attention`.

  The kernel is a ring over `axis` (`jaxsys.parallel.context.ring_attention`): positions
  [B, T] are the tokens' causal keys, which travel with them around the ring.
  """
  mesh = _mesh(q, k, v)
  if axis not in _free(mesh):
    raise ValueError(f"sharded_context_attention: mesh axis {axis!r} is not a free axis of "
                     f"the mesh {dict(mesh.shape)}")
  if q.shape[1] % mesh.shape[axis] or k.shape[1] != q.shape[1]:
    raise ValueError(f"sharded_context_attention: sequence length {q.shape[1]} (keys "
                     f"{k.shape[1]}) must be equal and divisible by {axis}={mesh.shape[axis]}")
  (batch, _, heads, _), repeat = attention_spec(mesh, q, k)
  k, v = repeat_kv(k, v, repeat)
  if axis in _names(batch) + _names(heads):  # the sequence claims it first
    raise ValueError(f"sharded_context_attention: axis {axis!r} also splits batch or heads")
  qkv = P(batch, axis, heads, None)
  tokens = P(batch, axis)
  if q_segment_ids is None:
    q_segment_ids = kv_segment_ids = jnp.zeros(q.shape[:2], jnp.int32)
  positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), q.shape[:2])

  def per_shard(q, k, v, q_ids, kv_ids, pos):
    return kernel(q, k, v, axis_name=axis, segment_ids=(q_ids, kv_ids), positions=pos, **kw)

  args = [q, k, v, q_segment_ids, kv_segment_ids, positions]
  return _shard_map(per_shard, mesh, args, [qkv] * 3 + [tokens] * 3, qkv)


def qmatmul_specs(mesh, x, qw) -> tuple[P, P, P]:
  """PartitionSpecs (x, the weight's data and scale, output) for qmatmul's shard_map.

  The first token dim follows the `batch` rule, N the `mlp` rule (the tensor-parallel axis
  of output features); K is never split (w8a8 scales each token over all of K).
  """
  used: set[str] = set()
  tokens = [_split(mesh, x.shape[d], _typed(x, d) + (_rule(mesh, "batch") if d == 0 else ()),
                   used) for d in range(x.ndim - 1)]
  n = _split(mesh, qw.shape[1], _typed(qw.data, 1) + _rule(mesh, "mlp"), used)
  lead = tuple(map(_entry, tokens))
  return P(*lead, None), P(None, _entry(n)), P(*lead, _entry(n))


def sharded_qmatmul(kernel: Callable, x, qw):
  """kernel(x, qw) for x [..., K] and a QWeight [K, N], split over x's token dims and N."""
  mesh = _mesh(x, qw.data)
  if not _splittable(mesh):
    return kernel(x, qw)
  x_spec, w_spec, out_spec = qmatmul_specs(mesh, x, qw)

  def per_shard(x, data, scale):
    return kernel(x, dataclasses.replace(qw, data=data, scale=scale))

  return _shard_map(per_shard, mesh, [x, qw.data, qw.scale], [x_spec, w_spec, w_spec], out_spec)
