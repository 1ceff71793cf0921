"""Named device meshes and logical-axis sharding rules.

A mesh spec names mesh axes and their sizes (``"data=2,tensor=4"``); ``make_mesh``
turns it into a ``jax.sharding.Mesh``, ``make_hybrid_mesh`` builds a DCN x ICI mesh
for multi-slice / multi-host runs. Model code never names mesh axes: it annotates
arrays with logical axes (``embed``, ``heads``, ...) and ``logical_to_sharding``
maps those to ``NamedSharding`` through a rule table.

Example:
  mesh = make_mesh("data=2,fsdp=-1")
  shardings = logical_to_sharding({"w": ("embed", "mlp")}, mesh)
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Union

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# The mesh's axis names, defined here only; modules name them as mesh.DATA etc.
REPLICA, DATA, STAGE, FSDP, CONTEXT, TENSOR = "replica", "data", "stage", "fsdp", "context", "tensor"
AXIS_NAMES: tuple[str, ...] = (REPLICA, DATA, STAGE, FSDP, CONTEXT, TENSOR)

MeshSpec = Union[str, Sequence[tuple[str, int]], Mapping[str, int]]


@dataclasses.dataclass(frozen=True)
class Degrees:
  """A mesh's parallel degrees, one per axis name (1 where the mesh lacks the axis): the
  one description of how far a mesh splits each way, built once from it (`degrees`)."""
  replica: int = 1
  data: int = 1
  stage: int = 1
  fsdp: int = 1
  context: int = 1
  tensor: int = 1

  @property
  def batch_shards(self) -> int:
    """How many ways one replica's batch is split: data x fsdp."""
    return self.data * self.fsdp


def degrees(mesh) -> Degrees:
  """The parallel degrees of a Mesh or AbstractMesh (an empty one: all 1)."""
  return Degrees(**{a: n for a, n in dict(mesh.shape).items() if a in AXIS_NAMES})
Rules = Sequence[tuple[str, Union[str, tuple[str, ...], None]]]

DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("replica", "data", "fsdp")),
    ("length", "context"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("stage", "stage"),
)

# Logical axes replicated over a mesh axis that does not divide them, rather than refused
# (given their shape): fewer K/V heads than `tensor` keeps every K/V head on each tensor
# shard, as MaxText and Megatron do; the attention kernels repeat them to the query split.
REPLICATED_WHEN_INDIVISIBLE = frozenset({"kv_heads"})

_VALID_SIZES = "a positive int or -1"

# ---------------------------------------------------------------------------
# Mesh specs
# ---------------------------------------------------------------------------


def _as_size(value: Any, name: str, field: str) -> int:
  """Validates one axis size; bools and floats are rejected so `2.5` never truncates."""
  if isinstance(value, str):
    if not re.fullmatch(r"\s*-?\d+\s*", value):
      raise ValueError(f"{field}: axis {name!r} has non-integer size {value!r}; "
                       f"sizes must be {_VALID_SIZES}")
    value = int(value)
  elif isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"{field}: axis {name!r} has non-integer size {value!r}; "
                     f"sizes must be {_VALID_SIZES}")
  value = int(value)
  if value == 0 or value < -1:
    raise ValueError(f"{field}: axis {name!r} has size {value}; sizes must be {_VALID_SIZES}")
  return value


def parse_mesh_spec(spec: MeshSpec, *, field: str = "mesh") -> tuple[tuple[str, int], ...]:
  """Normalises a mesh spec to ``((axis, size), ...)``, keeping the given order.

  Accepts ``"data=2,tensor=4"`` (``" x "`` also separates, as `describe` prints),
  ``[("data", 2), ("tensor", 4)]`` or ``{"data": 2, "tensor": 4}``. An empty spec
  gives ``()``. ``field`` names the config field in error messages.
  """
  if isinstance(spec, str):
    pairs = []
    for item in re.split(r"\s*,\s*|\s+x\s+", spec.strip()):
      if not item:
        continue
      if item.count("=") != 1:
        raise ValueError(f"{field}: cannot parse {item!r} in {spec!r}; expected "
                         f"'axis=size' items separated by commas, e.g. 'data=2,tensor=4'")
      name, size = (s.strip() for s in item.split("="))
      pairs.append((name, size))
  elif isinstance(spec, Mapping):
    pairs = list(spec.items())
  elif isinstance(spec, Sequence):
    pairs = []
    for item in spec:
      if isinstance(item, str) or not isinstance(item, Sequence) or len(item) != 2:
        raise ValueError(f"{field}: entry {item!r} in {spec!r} is not an (axis, size) pair")
      pairs.append(tuple(item))
  else:
    raise ValueError(f"{field}: {spec!r} is not a mesh spec; use 'data=2,tensor=4', "
                     f"[('data', 2), ('tensor', 4)] or {{'data': 2, 'tensor': 4}}")

  out: list[tuple[str, int]] = []
  for name, size in pairs:
    if name not in AXIS_NAMES:
      raise ValueError(f"{field}: unknown axis {name!r} in {spec!r}; valid axes are "
                       f"{', '.join(AXIS_NAMES)}")
    if any(name == n for n, _ in out):
      raise ValueError(f"{field}: axis {name!r} appears twice in {spec!r}; "
                       f"each of {', '.join(AXIS_NAMES)} may appear once")
    out.append((name, _as_size(size, name, field)))
  if sum(s == -1 for _, s in out) > 1:
    raise ValueError(f"{field}: more than one axis has size -1 in {spec!r}; "
                     f"at most one size may be -1, the others must be positive ints")
  return tuple(out)


def _format(axes: Sequence[tuple[str, int]]) -> str:
  return " x ".join(f"{n}={s}" for n, s in axes) or "(no axes)"


def _fill(axes: Sequence[tuple[str, int]], total: int, what: str,
          unit: str = "devices") -> tuple[int, ...]:
  """Resolves a -1 size so the product is `total`; errors name `what` (e.g. 'mesh data=2 x ...')."""
  sizes = [s for _, s in axes]
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if total % known:
      raise ValueError(f"{what}: {total} {unit} do not divide by {known}")
    sizes[sizes.index(-1)] = total // known
  elif known != total:
    raise ValueError(f"{what} needs {known} {unit} but {total} are available; choose sizes "
                     f"whose product is {total} (or use -1 for one axis)")
  return tuple(sizes)


def _device_grid(shape: Sequence[int], devices: Sequence[Any]) -> np.ndarray:
  """Topology-aware device array where jax knows the topology, plain reshape otherwise."""
  try:
    return np.asarray(mesh_utils.create_device_mesh(tuple(shape), devices))
  except Exception as e:  # pylint: disable=broad-except
    # Topology handlers raise for shapes they cannot map onto the physical torus (and on
    # some platforms at all); the row-major order is still a correct, if slower, mesh.
    logging.info("create_device_mesh(%s) failed (%s); using device order as given", shape, e)
    return np.asarray(devices, dtype=object).reshape(shape)


def _mesh(device_array: np.ndarray, names: Sequence[str]) -> Mesh:
  # Auto axes (jax's Mesh default) keep `jit` + NamedSharding working the same on every
  # jax version; spelled out in case the constructor's default ever changes.
  axis_type = getattr(jax.sharding, "AxisType", None)
  if axis_type is None:
    return Mesh(device_array, tuple(names))
  return Mesh(device_array, tuple(names), axis_types=(axis_type.Auto,) * len(names))


def make_mesh(spec: MeshSpec, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds a named mesh over `devices` (default: all), e.g. ``make_mesh("data=2,tensor=-1")``."""
  axes = parse_mesh_spec(spec)
  if not axes:
    raise ValueError(f"mesh: spec {spec!r} has no axes; give at least one of "
                     f"{', '.join(AXIS_NAMES)}, e.g. 'data=-1'")
  devices = list(jax.devices() if devices is None else devices)
  shape = _fill(axes, len(devices), f"mesh {_format(axes)}")
  return _mesh(_device_grid(shape, devices), [n for n, _ in axes])


# ---------------------------------------------------------------------------
# Hybrid (DCN x ICI) meshes
# ---------------------------------------------------------------------------


def _merge_axis_order(dcn: Sequence[str], ici: Sequence[str], what: str) -> list[str]:
  """Union of both axis orders; DCN-only axes go before ICI-only ones (they are the outer axes)."""
  out: list[str] = []
  ici_rest = list(ici)
  for name in dcn:
    if name in ici_rest:
      i = ici_rest.index(name)
      out.extend(ici_rest[:i])
      ici_rest = ici_rest[i + 1:]
    elif name in ici:
      # `name` was already emitted as an ICI axis ahead of an earlier DCN axis.
      raise ValueError(f"{what}: the specs order their shared axes differently; "
                       f"list shared axes in the same order in both specs")
    out.append(name)
  out.extend(ici_rest)
  if [n for n in out if n in ici] != list(ici):
    raise ValueError(f"{what}: the specs order their shared axes differently; "
                     f"list shared axes in the same order in both specs")
  return out


def _granules(devices: Sequence[Any]) -> tuple[list[list[Any]], str | None]:
  """Groups devices by slice (TPU multislice) or process; returns groups and the key used."""
  for attr in ("slice_index", "process_index"):
    keys = [getattr(d, attr, None) for d in devices]
    if all(k is not None for k in keys):
      groups: dict[Any, list[Any]] = collections.defaultdict(list)
      for k, d in zip(keys, devices):
        groups[k].append(d)
      return [groups[k] for k in sorted(groups)], attr
  return [list(devices)], None


def _hybrid_device_array(ici_spec: MeshSpec, dcn_spec: MeshSpec,
                         devices: Sequence[Any]) -> tuple[np.ndarray, list[str]]:
  """Device array and axis names of a hybrid mesh; split out so tests can use fake devices."""
  ici = parse_mesh_spec(ici_spec, field="ici_spec")
  dcn = parse_mesh_spec(dcn_spec, field="dcn_spec")
  what = f"hybrid mesh dcn {_format(dcn)} x ici {_format(ici)}"
  if not ici and not dcn:
    raise ValueError(f"{what}: both specs are empty; give at least one axis, "
                     f"e.g. ici_spec='fsdp=-1', dcn_spec='data=2'")
  names = _merge_axis_order([n for n, _ in dcn], [n for n, _ in ici], what)
  dcn_axes = [(n, dict(dcn).get(n, 1)) for n in names]
  ici_axes = [(n, dict(ici).get(n, 1)) for n in names]

  devices = list(devices)
  granules, key = _granules(devices)
  n = len(devices)
  if len(granules) == 1:
    # One slice / one process (e.g. simulated CPU devices): emulate prod(dcn) granules by
    # splitting the devices into contiguous groups by id, so the layout is still testable.
    if -1 in dict(dcn).values() and -1 in dict(ici).values():
      raise ValueError(f"{what}: with a single granule ({n} devices) only one of the two "
                       f"specs may use -1")
    if -1 in dict(dcn).values():
      ici_sizes = tuple(s for _, s in ici_axes)
      if n % math.prod(ici_sizes):
        raise ValueError(f"{what}: {n} devices do not divide by the ici size "
                         f"{math.prod(ici_sizes)}")
      dcn_sizes = _fill(dcn_axes, n // math.prod(ici_sizes), f"{what} (dcn)")
    else:
      dcn_sizes = tuple(s for _, s in dcn_axes)
    n_groups = math.prod(dcn_sizes)
    if n % n_groups:
      raise ValueError(f"{what}: {n} devices in 1 granule cannot be split into "
                       f"{n_groups} equal DCN groups")
    ordered = sorted(devices, key=lambda d: d.id)
    per = n // n_groups
    granules = [ordered[i * per:(i + 1) * per] for i in range(n_groups)]
    key = None
  else:
    dcn_sizes = _fill(dcn_axes, len(granules), f"{what}: dcn", unit=f"granules (by {key})")
  sizes = {len(g) for g in granules}
  if len(sizes) != 1:
    raise ValueError(f"{what}: granules (by {key}) have unequal device counts "
                     f"{sorted(len(g) for g in granules)}; every granule needs the same number")
  per = sizes.pop()
  ici_sizes = _fill(ici_axes, per, f"{what} over {len(granules)} granules of {per} devices: ici",
                    unit="devices per granule")

  if key is not None:
    try:
      arr = mesh_utils.create_hybrid_device_mesh(
          ici_sizes, dcn_sizes, devices, process_is_granule=(key == "process_index"))
      return np.asarray(arr), names
    except Exception as e:  # pylint: disable=broad-except
      # Sizes were validated above, so a failure here is a topology mapping jax cannot do;
      # the hand-built layout below keeps the same DCN/ICI split.
      logging.info("create_hybrid_device_mesh failed (%s); building the hybrid mesh by hand", e)

  k = len(names)
  grids = np.stack([_device_grid(ici_sizes, g) for g in granules])  # [G, *ici]
  arr = grids.reshape(tuple(dcn_sizes) + tuple(ici_sizes))  # [*dcn, *ici]
  # Interleave to [dcn0, ici0, dcn1, ici1, ...] then merge pairs: the DCN index is the
  # outer (slower-varying) part of every axis, so each DCN group is a contiguous block.
  arr = arr.transpose([j for i in range(k) for j in (i, k + i)])
  arr = arr.reshape([d * c for d, c in zip(dcn_sizes, ici_sizes)])
  return arr, names


def make_hybrid_mesh(ici_spec: MeshSpec, dcn_spec: MeshSpec,
                     devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Mesh whose axis sizes are dcn * ici, with DCN groups (slices/hosts) as outer blocks.

  Example: ``make_hybrid_mesh("fsdp=4", "data=2")`` -> mesh ``data=2 x fsdp=4`` where
  ``mesh.devices[i]`` holds the devices of slice (or host) ``i``.
  """
  devices = list(jax.devices() if devices is None else devices)
  arr, names = _hybrid_device_array(ici_spec, dcn_spec, devices)
  return _mesh(arr, names)


# ---------------------------------------------------------------------------
# Logical axis rules
# ---------------------------------------------------------------------------


def _rule_axes(rule: str | Sequence[str] | None) -> tuple[str, ...]:
  if rule is None:
    return ()
  if isinstance(rule, str):
    return (rule,)
  return tuple(rule)


def logical_to_partition_spec(logical_axes: Sequence[str | None] | PartitionSpec,
                              mesh: Mesh, rules: Rules = DEFAULT_RULES,
                              shape: Sequence[int] | None = None) -> PartitionSpec:
  """Maps logical axis names to a PartitionSpec over `mesh`.

  Each name takes the mesh axes of its first rule that exist in `mesh` and have size > 1;
  a mesh axis already used by an earlier dim is dropped (a spec may use it once). An entry
  may also be a tuple of logical names (one array dim sharded like several). With `shape`,
  a dim whose mesh axes do not divide it is an error, except for the names in
  REPLICATED_WHEN_INDIVISIBLE, which leave out the axes that do not divide them.
  Example: ``("batch", "embed")`` on ``data=2 x fsdp=4`` -> ``P(("data", "fsdp"), None)``.
  """
  table: dict[str, tuple[str, ...]] = {}
  for name, rule in rules:
    table.setdefault(name, _rule_axes(rule))  # first matching rule wins
  mesh_sizes = dict(mesh.shape)
  logical_axes = tuple(logical_axes)
  if shape is not None and len(shape) != len(logical_axes):
    raise ValueError(f"logical axes {logical_axes} have {len(logical_axes)} dims but the "
                     f"shape {tuple(shape)} has {len(shape)}")

  used: set[str] = set()
  entries: list[str | tuple[str, ...] | None] = []
  for dim, entry in enumerate(logical_axes):
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    axes: list[str] = []
    for name in names:
      if name is None:
        continue
      if name not in table:
        raise ValueError(f"logical axis {name!r} (in {logical_axes}) has no rule; known "
                         f"logical axes are {', '.join(table)}")
      for ax in table[name]:
        # Size-1 axes shard nothing; dropping them keeps specs readable and mesh-agnostic.
        if mesh_sizes.get(ax, 1) > 1 and ax not in used:
          if (name in REPLICATED_WHEN_INDIVISIBLE and shape is not None
              and shape[dim] % (math.prod(mesh_sizes[a] for a in axes) * mesh_sizes[ax])):
            continue
          axes.append(ax)
          used.add(ax)
    if shape is not None:
      parts = math.prod(mesh_sizes[a] for a in axes)
      if shape[dim] % parts:
        sizes = " x ".join(f"{a}={mesh_sizes[a]}" for a in axes)
        raise ValueError(f"logical axis {entry!r} (dim {dim} of shape {tuple(shape)}) has size "
                         f"{shape[dim]}, not divisible by mesh axes {sizes} (= {parts}); "
                         f"change the size or the mesh/rules")
    entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  return PartitionSpec(*entries)


def _is_logical_leaf(x: Any) -> bool:
  # Tuples are pytree nodes; a tuple of names (or an empty tuple, for scalars) is one leaf.
  return isinstance(x, PartitionSpec) or (
      isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x))


def logical_to_sharding(logical_tree: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES,
                        shapes: Any = None) -> Any:
  """Pytree of logical-axis tuples (or PartitionSpecs) -> pytree of NamedSharding.

  `shapes` is an optional pytree matching `logical_tree` of shape tuples, arrays or
  ShapeDtypeStructs, used to check that every sharded dim divides evenly.
  """

  def one(logical, shape=None):
    if shape is not None and hasattr(shape, "shape"):
      shape = shape.shape
    return NamedSharding(mesh, logical_to_partition_spec(logical, mesh, rules, shape))

  if shapes is None:
    return jax.tree.map(one, logical_tree, is_leaf=_is_logical_leaf)
  # A shape tuple under a logical leaf is passed whole, since the first tree sets the structure.
  return jax.tree.map(one, logical_tree, shapes, is_leaf=_is_logical_leaf)


def batch_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES, ndim: int = 2) -> NamedSharding:
  """Sharding of a ``[batch, length, ...]`` input batch."""
  if ndim < 1:
    raise ValueError(f"batch_sharding: ndim={ndim}; a batch needs ndim >= 1")
  logical = ("batch", "length", *([None] * (ndim - 2)))[:ndim]
  return NamedSharding(mesh, logical_to_partition_spec(logical, mesh, rules))


def describe(mesh: Mesh) -> str:
  """One line for logs, e.g. ``"data=2 x tensor=4 (8 cpu devices)"``."""
  devs = mesh.devices.ravel()
  first = devs[0]
  n_proc = len({d.process_index for d in devs})
  where = f", {n_proc} processes" if n_proc > 1 else ""
  return f"{_format(list(mesh.shape.items()))} ({mesh.devices.size} {first.platform} devices{where})"
