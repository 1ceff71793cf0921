"""An overlapping outer sync's all-reduce on twin CPU devices: the H inner steps go on
while it crosses the link.

XLA:CPU runs a device's programs one at a time and their collectives in line, so a sync
fused into the next inner step holds that step for the whole transfer. With
`outer.comm_device=True` every process splits its CPU devices in two halves:
the first trains, the second are their twins and only communicate, the way a host's
network card moves data while its cores compute. At a sync the loop runs the outer
update on the training devices without its collective, copies what it would average
(CO2's `pending`) to the twins and launches the all-reduce there; the next sync, H steps
later, copies the average back first. The math is the fused sync's (to float rounding:
the programs fuse differently); only where the collective runs changes.
"""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding

from jaxsys.optim import outer as outer_lib
from jaxsys.train.state import REPLICA_AXIS as AXIS, TrainState


def split_devices(devices=None) -> tuple[list[jax.Device], dict[jax.Device, jax.Device]]:
  """(training devices, training device -> its twin): each process's first half of its
  devices trains, the second half are the twins, in order. ValueError for an odd count."""
  devices = list(jax.devices() if devices is None else devices)
  by_process: dict[int, list[jax.Device]] = {}
  for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
    by_process.setdefault(d.process_index, []).append(d)
  train, twin = [], {}
  for process, local in by_process.items():
    if len(local) % 2 or local[0].platform != "cpu":
      raise ValueError(
          f"outer.comm_device=True needs an even number of CPU devices in each "
          f"process (half train, half are their communication twins); process {process} has "
          f"{len(local)} {local[0].platform} devices (e.g. --xla_force_host_platform_device_count"
          f"={2 * len(local)}, or the lab's --devices_per_process=2)")
    half = len(local) // 2
    train += local[:half]
    twin.update(zip(local[:half], local[half:]))
  return train, twin


def training_devices(comm_device: bool, devices=None) -> list[jax.Device] | None:
  """The devices a run's mesh spans: all of `devices` (default jax's), or their training
  half with communication twins."""
  return split_devices(devices)[0] if comm_device else devices


def _moved(x: jax.Array, device_map: dict, mesh: Mesh) -> jax.Array:
  """`x` on `mesh`, each local shard copied to `device_map[its device]` (no host hop)."""
  sharding = NamedSharding(mesh, x.sharding.spec)
  return jax.make_array_from_single_device_arrays(
      x.shape, sharding, [jax.device_put(s.data, device_map[s.device])
                          for s in x.addressable_shards])


class OffDeviceSync:
  """`sync(state)`: the outer update on the training devices, its all-reduce launched on
  the twins; `land(state)`: the state with the last all-reduce's result in place (what the
  fused sync would hold). `setup.make_setup` builds it for an outer optimizer with
  `in_flight` (CO2) when `outer.comm_device` is set."""

  def __init__(self, outer: outer_lib.OuterOptimizer, mesh: Mesh, local_sync: Callable):
    self.field, self.mesh, self.local_sync = outer.in_flight, mesh, local_sync
    _, self.twin_of = split_devices()
    self.back = {t: d for d, t in self.twin_of.items()}
    self.twins = Mesh(np.vectorize(self.twin_of.get, otypes=[object])(mesh.devices),
                      mesh.axis_names)
    self.in_flight = None  # the average launched at the last sync, on the twins
    self._mean = None

  def _all_reduce(self, tree):
    if self._mean is None:
      specs = jax.tree.map(lambda x: x.sharding.spec, tree)
      mean = jax.shard_map(lambda t: lax.pmean(t, AXIS), mesh=self.twins, in_specs=(specs,),
                           out_specs=specs)
      self._mean = jax.jit(mean, donate_argnums=0)
    return self._mean(tree)

  def land(self, state: TrainState) -> TrainState:
    """`state` with the average in flight written where the fused sync keeps it."""
    if self.in_flight is None:
      return state
    landed = jax.tree.map(lambda x: _moved(x, self.back, self.mesh), self.in_flight)
    self.in_flight = None
    return state.replace(outer=state.outer._replace(**{self.field: landed}))

  def __call__(self, state: TrainState) -> TrainState:
    state = self.local_sync(self.land(state))
    local = getattr(state.outer, self.field)
    self.in_flight = self._all_reduce(
        jax.tree.map(lambda x: _moved(x, self.twin_of, self.twins), local))
    return state
