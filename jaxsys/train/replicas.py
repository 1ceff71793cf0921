"""Outer optimizers around any inner step: R replicas on the `replica` mesh axis.

The run's arrays get a leading [R] dim sharded on `replica` (the DiLoCo view `[replica,
...]` of the same parameters); each replica may itself shard over data/fsdp/tensor/context
or be a pipeline over `stage`. The inner step is any replica step (`grads.replica_step`),
so inner optimizer states stay per replica and are never averaged, and its metrics stay
per replica too (combined on the host when a row is logged): between syncs the replicas
never communicate. After each step the
outer optimizer says is due (every `sync_every` steps; Streaming DiLoCo's fragments in
between) the loop calls `sync_fn`: the outer optimizer's `sync` under `jax.shard_map` over
`replica` only (the other axes stay automatic), so its collectives are explicit in the
HLO. Its update is elementwise plus collectives over `replica`, so it runs on any view of
the parameters as it is (a pipeline's stages included). For an outer optimizer that
`overlaps` (CO2; Streaming DiLoCo with overlap_steps > 0) the loop instead runs
`sync_train_fn`, the sync and the next inner step as one program: the step does not wait
for the collective the sync launches, so the two can overlap (on XLA:CPU, where a program
runs its collectives in line, `comm_device` runs CO2's apart on twin devices instead).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxsys import mesh as mesh_lib
from jaxsys.config import OuterConfig
from jaxsys.checkpoint import layouts
from jaxsys.optim import outer as outer_lib
from jaxsys.optim.co2 import co2
from jaxsys.optim.diloco import diloco
from jaxsys.optim.noloco import noloco
from jaxsys.optim.streaming import streaming_diloco
from jaxsys.train.state import REPLICA_AXIS as AXIS, TrainState

def make_outer_optimizer(cfg: OuterConfig) -> outer_lib.OuterOptimizer | None:
  """The outer optimizer named by `cfg.name`, None for 'none' (plain DP).

  The config's fields are the algorithm's own arguments (`outer.lr` is `diloco(lr=...)`);
  unset (None) ones take the algorithm's default. An error names the config field.
  """
  if cfg.name == "none":
    return None
  make = {"diloco": diloco, "noloco": noloco, "co2": co2,
          "streaming_diloco": streaming_diloco}[cfg.name]
  takes = inspect.signature(make).parameters
  kw = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
        if f.name in takes and getattr(cfg, f.name) is not None}
  try:
    return make(**kw)
  except ValueError as e:  # each algorithm's error starts with its argument: sync_every=0
    raise ValueError(f"outer.{e}") from None


def num_replicas(mesh: Mesh, outer_name: str) -> int:
  """Size of the mesh's `replica` axis; an outer optimizer needs one of size >= 2."""
  size = dict(mesh.shape).get(AXIS, 0)
  if size < 2:
    raise ValueError(
        f"outer.name={outer_name!r} needs a mesh with a 'replica' axis of size >= 2, but "
        f"the mesh is {mesh_lib.describe(mesh)}; e.g. mesh='replica=4,data=-1'")
  return size


def start_from_params(step, params, optimizer, outer: outer_lib.OuterOptimizer,
                      replicas: int) -> TrainState:
  """Every replica and the outer state at `params` (one replica's), fresh inner and outer states."""
  stack = layouts.TRANSFORMS["replicas"].to_view
  return with_fresh_outer(outer, step, stack(params, replicas),
                          stack(optimizer.init(params), replicas))


def with_fresh_outer(outer: outer_lib.OuterOptimizer, step, params, opt_state) -> TrainState:
  """Replicas at `params` [R, ...] and inner states, the outer state fresh at them."""
  return TrainState(step=step, params=params, opt_state=opt_state,
                    outer=jax.vmap(outer.init)(params))


def make_sync(outer: outer_lib.OuterOptimizer, mesh: Mesh, average: bool = True) -> Callable:
  """(params [R..], outer state [R..]) -> same, by `outer.sync` under shard_map over
  `replica`; `average=False`: without its collective (`outer.in_flight` left local)."""
  def per_replica(params, state):
    squeeze = lambda t: jax.tree.map(lambda x: x[0], t)
    params, state = outer.sync(squeeze(params), squeeze(state),
                               axis_name=AXIS if average else None)
    return jax.tree.map(lambda x: x[None], (params, state))

  spec = PartitionSpec(AXIS)
  return jax.shard_map(per_replica, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec),
                       axis_names={AXIS})


def jit_steps(inner_step: Callable, outer: outer_lib.OuterOptimizer, mesh: Mesh,
              view: layouts.View, state_sh, batch_sh, compiler_options
              ) -> tuple[Callable, Callable, Callable | None]:
  """(train_fn, sync_fn, sync_train_fn) of a replica run, jitted with donation: any inner
  step (pipelined or not), the outer sync and, for an outer optimizer that `overlaps`, the
  two as one program (None otherwise). The wrapper MaxText's DiLoCo is around its step.

  An `elementwise` outer optimizer syncs the trained view as it is; another (Streaming
  DiLoCo's layer fragments) syncs the saved form, converted through `view` and back.
  """
  sync_state = sync_of_state(outer, mesh, view)

  def sync_then_step(state, batch):  # an outer that overlaps: the sync in the next step
    return inner_step(sync_state(state), batch)

  def jit(fn, ins, outs):
    return jax.jit(fn, in_shardings=ins, out_shardings=outs, donate_argnums=0,
                   compiler_options=compiler_options)
  step_out = (state_sh, NamedSharding(mesh, PartitionSpec(AXIS)))  # each replica's metrics
  return (jit(inner_step, (state_sh, batch_sh), step_out),
          jit_sync(outer, mesh, view, state_sh, compiler_options),
          jit(sync_then_step, (state_sh, batch_sh), step_out)
          if outer.overlaps else None)


def jit_sync(outer: outer_lib.OuterOptimizer, mesh: Mesh, view: layouts.View, state_sh,
             compiler_options, average: bool = True) -> Callable:
  """The outer sync alone, jitted with donation: for an inner step that is not one program
  (HDP's micro-steps), so nothing can fuse it into the next step, or (`average=False`)
  without its collective, which `comm_device` runs apart."""
  return jax.jit(sync_of_state(outer, mesh, view, average), in_shardings=(state_sh,),
                 out_shardings=state_sh, donate_argnums=0, compiler_options=compiler_options)


def sync_of_state(outer: outer_lib.OuterOptimizer, mesh: Mesh, view: layouts.View,
                  average: bool = True) -> Callable[[TrainState], TrainState]:
  """state -> state after the outer sync of its replicas (the inner states untouched)."""
  sync = make_sync(outer, mesh, average)

  def sync_state(state: TrainState) -> TrainState:
    synced = state.replace(opt_state=None)  # the inner states take no part
    if not outer.elementwise:
      synced = view.to_saved(synced)
    params, outer_state = sync(synced.params, synced.outer)
    synced = synced.replace(params=params, outer=outer_state)
    if not outer.elementwise:
      synced = view.to_view(synced)
    return synced.replace(opt_state=state.opt_state)
  return sync_state


def replica_meshes(mesh: Mesh) -> list[Mesh]:
  """Each replica's devices as a mesh of the other axes; [mesh] without a `replica` axis."""
  if AXIS not in mesh.axis_names:
    return [mesh]
  at = mesh.axis_names.index(AXIS)
  names = tuple(a for a in mesh.axis_names if a != AXIS)
  return [Mesh(np.take(mesh.devices, r, axis=at), names) for r in range(mesh.shape[AXIS])]


class PerReplica:
  """Any host-driven inner step (many programs a step, e.g. HDP's, so not one program to
  run per replica under `shard_map`) in each of an outer optimizer's replicas:
  `make_step(mesh, state_sh)` builds one replica's step on its devices, which steps the
  replica's slice of the stacked state [R, ...] (its parameters and inner optimizer state)
  over its own part of the batch (`batch_of`); the outer state is left to the sync. A
  replica's slice is each of its devices' own shard, used in place, and the result is
  stacked back the same way, so nothing crosses replicas in a step. Metrics come back per
  replica [R], as `grads.replica_step`'s (`grads.replica_totals` combines them); host
  values (numbers, not arrays) as the replicas' mean.
  """

  def __init__(self, make_step: Callable[[Mesh, TrainState], Any], mesh: Mesh,
               state_sh: TrainState):
    self.mesh, self.state_sh = mesh, state_sh
    self.meshes = replica_meshes(mesh)
    self.replica_sh = [_replica_shardings(state_sh, m) for m in self.meshes]
    self.steps = [make_step(m, sh) for m, sh in zip(self.meshes, self.replica_sh)]

  @staticmethod
  def batch_of(parts: list[Any]) -> dict:
    """The batch of replica r's step `parts[r]`."""
    return {"replicas": parts}

  def lower(self, state: TrainState, *args) -> Any:
    """Replica 0's step lowered (every replica's is the same on its devices)."""
    sh = self.replica_sh[0]
    one = lambda x, s: jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=s)
    return self.steps[0].lower(TrainState(
        step=jax.ShapeDtypeStruct((), state.step.dtype, sharding=sh.step),
        params=jax.tree.map(one, state.params, sh.params),
        opt_state=jax.tree.map(one, state.opt_state, sh.opt_state)), *args)

  def __call__(self, state: TrainState, batch: dict[str, Any]):
    # Every replica's slice first: a step donates its slice, and the step counter's slices
    # are the stacked one's own shards.
    mine = [(step, part, TrainState(step=on_devices(state.step, sh.step),
                                    params=_slice(state.params, sh.params),
                                    opt_state=_slice(state.opt_state, sh.opt_state)))
            for step, sh, part, mesh in zip(self.steps, self.replica_sh, batch["replicas"],
                                            self.meshes)
            if any(d.process_index == jax.process_index() for d in mesh.devices.flat)]
    outs = [step(one, part) for step, part, one in mine]  # this process's replicas
    states, metrics = [s for s, _ in outs], [m for _, m in outs]
    stack = lambda sh, *x: _stack(x, sh)
    state = state.replace(
        step=_stack([s.step for s in states], self.state_sh.step, lead=False),
        params=jax.tree.map(stack, self.state_sh.params, *[s.params for s in states]),
        opt_state=jax.tree.map(stack, self.state_sh.opt_state, *[s.opt_state for s in states]))
    per_replica = NamedSharding(self.mesh, PartitionSpec(AXIS))
    return state, {k: _stack([m[k] for m in metrics], per_replica)
                   if isinstance(metrics[0][k], jax.Array)
                   else np.mean([m[k] for m in metrics], dtype=np.float32)
                   for k in metrics[0]}


def _replica_shardings(state_sh: TrainState, mesh: Mesh) -> TrainState:
  """One replica's shardings on its `mesh`: the stacked state's, less the leading `replica`."""
  one = lambda sh: NamedSharding(mesh, PartitionSpec(*sh.spec[1:]))
  return TrainState(step=NamedSharding(mesh, PartitionSpec()),
                    params=jax.tree.map(one, state_sh.params),
                    opt_state=jax.tree.map(one, state_sh.opt_state))


def on_devices(tree, shardings):
  """Arrays read on some of their devices (`shardings`' meshes), each by its shards there,
  without a copy: those devices must hold a whole array (e.g. a view that keeps the axes
  that split it, or one replica of a replicated value)."""
  def on(x, sharding):
    devices = set(sharding.mesh.devices.flat)
    return jax.make_array_from_single_device_arrays(
        x.shape, sharding, [s.data for s in x.addressable_shards if s.device in devices])
  return jax.tree.map(on, tree, shardings)


def _slice(tree, shardings):
  """Of stacked leaves [R, ...], the replica whose devices `shardings` name: each device's
  shard [1, ...] of it, as [...]."""
  def one(x, sharding):
    devices = set(sharding.mesh.devices.flat)
    return jax.make_array_from_single_device_arrays(
        x.shape[1:], sharding, [s.data[0] for s in x.addressable_shards if s.device in devices])
  return jax.tree.map(one, tree, shardings)


def _stack(leaves, sharding, lead: bool = True):
  """Replicas' arrays, each on its replica's devices, as one array of `sharding` (stacked
  [R, ...] with `lead`; else the same value on every replica, e.g. the step)."""
  shards = [s.data[None] if lead else s.data for x in leaves for s in x.addressable_shards]
  shape = ((sharding.mesh.shape[AXIS],) if lead else ()) + leaves[0].shape
  return jax.make_array_from_single_device_arrays(shape, sharding, shards)
