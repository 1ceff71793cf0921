"""Training with Hybrid Data Parallelism: whole documents, each on as many devices as it needs.

ByteScale's HDP with its per-rank balance (DP-Balance). A step takes a global batch of
whole documents (jaxsys.data.documents). `Planner` schedules them (`hdp_schedule`: each
long document a ring on the run of slots it needs, each slot's short documents its own
local micro-batches) and emits the step as one list of `Program`s; `HDPStep` runs them
and ends with one all-reduce over the pool and one optimizer update. A ring's program runs
over its run of slots as a `data = 1, context = c` view: ring attention where c > 1, the
plain kernels where c = 1; programs of one ring shape compile once and are loaded onto
the other runs (`relocate.Programs`). The summed token loss, token count and gradients
accumulate, and the update divides by the whole batch's token count, so the step equals a
single-device step over the same documents, however they were split.

The pool is a mesh's batch axes (`data`, `fsdp`): each of their devices, with the devices
of its `tensor` group and its pipeline's stages, is one slot. The views regroup slots
into `data, context` and keep `stage` and `tensor`, so every view reads the parameters
where they are. With `fsdp` the pool trains as ZeRO-2 does (ByteScale's HDP with ZeRO):
the parameters are gathered once a step, the gradients are summed into their fsdp shards,
and the update runs on the shards. A micro-step's gradient function is the model's or a
pipeline's (`ViewGrads`); over pipelines a program runs the schedule's m microbatches.
With an outer optimizer, `replicas.PerReplica` runs one such step in each replica.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsys import mesh as mesh_lib
from jaxsys.config import RunConfig
from jaxsys.kernels import sharded
from jaxsys.models import transformer
from jaxsys.data.packing import FIELDS
from jaxsys.parallel import cost, hdp, hdp_layout, hdp_schedule, pipeline, relocate
from jaxsys.train import grads, replicas
from jaxsys.train import step as step_lib
from jaxsys.train.state import TrainState


def accumulating(grad_fn: grads.GradFn, params_sh=None) -> Callable:
  """(params, batch, acc) -> acc + `grad_fn`'s (summed token loss, token count, gradients);
  `params_sh`: the parameters' shardings (where a jit gives them)."""
  def sums(params, batch, acc):
    total, count, g = grad_fn(params, batch)
    # The gradients laid out as the parameters they differentiate, then summed into acc's
    # layout (a reduce-scatter over fsdp): left free, XLA pulls acc's fsdp split back into
    # the activations' gradients and replicates them to get there.
    if params_sh is not None:
      g = jax.lax.with_sharding_constraint(g, params_sh)
    return jax.tree.map(jnp.add, acc, (total, count, g))
  return sums


def _context_split(view: Mesh) -> step_lib.ContextSplit | None:
  """A view's context split: on a ring, ring attention on the planner's own layout."""
  return step_lib.ContextSplit(step_lib.LAID_OUT) if view.shape["context"] > 1 else None


# The mesh axes that split the batch: their devices are the pool's slots.
SLOT_AXES = (mesh_lib.DATA, mesh_lib.FSDP)
# The mesh axes a slot may span: each slot is a group that shards the model over them
# (`tensor`), or a pipeline over its stages (`stage`).
KEPT_AXES = (mesh_lib.STAGE, mesh_lib.TENSOR)


class Pool:
  """A mesh's devices as HDP slots: `devices` [..., S, ...] has the batch axes merged into
  one axis of S slots at position `at` (size-1 axes dropped), the kept axes around it in
  the mesh's order, so every view below is a reshape of `mesh` (the pool's order of the
  devices: a jitted program's arrays must all list them in one order)."""

  def __init__(self, mesh: Mesh):
    # The mesh with the batch axes side by side where the first of them is (e.g.
    # data=2,stage=2,fsdp=2 as data,fsdp,stage): each device keeps its place on every axis.
    axes = list(mesh.axis_names)
    at = next((i for i, a in enumerate(axes) if a in SLOT_AXES), 0)
    order = ([i for i in range(at) if axes[i] not in SLOT_AXES]
             + [i for i, a in enumerate(axes) if a in SLOT_AXES]
             + [i for i in range(at, len(axes)) if axes[i] not in SLOT_AXES])
    self.mesh = Mesh(mesh.devices.transpose(order), tuple(axes[i] for i in order))
    names = [a for a in self.mesh.axis_names if self.mesh.shape[a] > 1 or a in SLOT_AXES]
    others = {a: mesh.shape[a] for a in names if a not in SLOT_AXES + KEPT_AXES}
    if others:
      raise ValueError(f"HDP regroups the batch axes {SLOT_AXES} into data=S/c,context=c "
                       f"views and keeps {KEPT_AXES}; this mesh also has {others}")
    devices = self.mesh.devices.reshape([self.mesh.shape[a] for a in names])
    slots = [i for i, a in enumerate(names) if a in SLOT_AXES]
    if not slots:  # one slot: the whole mesh is one group
      devices, names, slots = devices[None], ["data", *names], [0]
    self.at = slots[0]
    self.slot_axes = tuple(names[i] for i in slots)
    self.kept = tuple(a for a in names if a not in SLOT_AXES)
    shape = devices.shape
    self.devices = devices.reshape(shape[:self.at] + (-1,) + shape[slots[-1] + 1:])

  @property
  def size(self) -> int:
    return self.devices.shape[self.at]

  def slot_devices(self, slot: int) -> list:
    return list(np.take(self.devices, [slot], axis=self.at).flat)

  def view(self, c: int, block: tuple[int, ...] | None = None) -> Mesh:
    """The `data = S/c, context = c` view of the slots (of `block`'s slots, if given)."""
    devices = self.devices if block is None else np.take(self.devices, block, axis=self.at)
    shape = devices.shape
    devices = devices.reshape(shape[:self.at] + (shape[self.at] // c, c) + shape[self.at + 1:])
    names = self.kept[:self.at] + ("data", "context") + self.kept[self.at:]
    return Mesh(devices, names)

  def stacked(self, spec: P) -> P:
    """A spec of [S, ...] arrays: one row per slot, the rest as `spec`."""
    return P(self.slot_axes, *spec)


def _without(spec: P, axis: str) -> P:
  """`spec` with mesh axis `axis` taken out (those dims then split over what is left)."""
  # pylint: disable-next=protected-access
  return P(*(sharded._entry(tuple(n for n in sharded._names(e) if n != axis)) for e in spec))


def _on_mesh(shardings, mesh: Mesh, spec_fn=lambda spec: spec):
  return jax.tree.map(lambda s: NamedSharding(mesh, spec_fn(s.spec)), shardings)


@dataclasses.dataclass(frozen=True)
class ViewGrads:
  """A micro-step's gradient function on any `data, context` view of a pool (`of_view`),
  `microbatches` of the plan's micro-batches to a program. `local`: one slot's gradient
  function, for the slots' local micro-batches run as one program over the pool (None for
  a pool of pipelines, whose local micro-batches run as rings of one slot)."""
  of_view: Callable[[Mesh], grads.GradFn]
  microbatches: int = 1
  local: grads.GradFn | None = None


def model_grads(model_cfg: transformer.TransformerConfig) -> ViewGrads:
  """The model's autodiff: ring attention over a view's `context` where it is > 1."""
  return ViewGrads(lambda view: grads.autodiff(model_cfg, _context_split(view)),
                   local=grads.autodiff(model_cfg))


def pipeline_grads(model_cfg: transformer.TransformerConfig, schedule: pipeline.Schedule,
                   layout: pipeline.Layout, *, vocab_algorithm: int = 2,
                   gather_once: bool = False) -> ViewGrads:
  """Pools of pipelines: each slot spans `stage` (with `tensor`); a program runs
  `schedule`'s m microbatches, m of the plan's micro-batches, over its view (ring attention
  inside the stages, the executor's uniform ticks, where the view has context > 1)."""
  def of_view(view: Mesh) -> grads.GradFn:
    return grads.pipelined(model_cfg, schedule, layout, view, vocab_algorithm=vocab_algorithm,
                           context_split=_context_split(view), gather_once=gather_once)
  return ViewGrads(of_view, microbatches=schedule.microbatches)


@dataclasses.dataclass(frozen=True)
class Program:
  """One program of a step. Over a run of slots (`slots`): micro-batches over its
  `data = len(slots) / context, context` view, `fields` [rows, context * cell], their sums
  accumulated on the run. Local (`slots` None): every slot's own micro-batches of `cell`
  tokens, `fields` [S, k, cell], `counts` [S] of them each."""
  slots: tuple[int, ...] | None
  context: int
  cell: int
  fields: dict[str, np.ndarray]
  counts: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Planner:
  """A pool's per-rank schedule of a step's documents (`hdp_schedule`) and its programs.
  `widen`: rings may take up to twice the devices they need when the FLOP estimate says
  that ends sooner (it knows no link speed; off: least padding)."""
  num_devices: int
  tokens_per_device: int
  d_model: int = cost.DEFAULT_D_MODEL
  widen: bool = False

  def plan(self, lengths) -> hdp_schedule.Schedule:
    return hdp_schedule.schedule([int(n) for n in lengths], num_devices=self.num_devices,
                                 tokens_per_device=self.tokens_per_device,
                                 d_model=self.d_model, widen=self.widen)

  def fit(self, docs, micro_steps: int) -> tuple[list[int], hdp_schedule.Schedule]:
    """(kept, schedule of those docs): what of `docs` one step takes, at most `micro_steps`
    micro-batches on every device, in one schedule (`hdp_schedule.fit`). The schedule
    indexes the kept documents; callers pass docs[kept] alongside it."""
    return hdp_schedule.fit([len(d) - 1 for d in docs], budget=micro_steps,
                            num_devices=self.num_devices,
                            tokens_per_device=self.tokens_per_device,
                            d_model=self.d_model, widen=self.widen)

  @staticmethod
  def micro_batches(sched: hdp_schedule.Schedule) -> int:
    """The most micro-batches a device runs."""
    return int(sched.micro_batches().max(initial=0))

  def programs(self, sched: hdp_schedule.Schedule, docs, *, microbatches: int = 1,
               local: bool = True) -> list[Program]:
    """The step's programs, in dispatch order: the rings first (a device starts its local
    work when its own rings are done), each run's micro-batches of a cell `microbatches` to
    a program (the last padded with empty ones); then, with `local`, one program per local
    micro-batch size, else each slot's local micro-batches as runs of one slot (a
    pipeline's: every run pipelines its micro-batches at its own pace)."""
    runs: dict[tuple, list] = {}
    for ring in sched.rings:
      c = len(ring.devices)
      _, fields = hdp_layout.pack_step(ring.entries(), docs, num_devices=c,
                                       tokens_per_device=ring.cell, view=c)
      runs.setdefault((ring.devices, ring.cell), []).append(fields)
    by_size = local_batches(sched, [len(doc) - 1 for doc in docs], self.tokens_per_device)
    if not local:
      for size, per_slot in sorted(by_size.items()):
        for d, batches in enumerate(per_slot):
          for batch in batches:
            runs.setdefault(((d,), size), []).append(_one_slot(batch, docs, size))
    out = []
    for (slots, cell), cells in runs.items():
      c = len(slots)
      _, empty = hdp_layout.pack_step([], [], num_devices=c, tokens_per_device=cell, view=c)
      for start in range(0, len(cells), microbatches):
        group = cells[start:start + microbatches]
        group += [empty] * (microbatches - len(group))
        out.append(Program(slots, c, cell, {f: np.concatenate([g[f] for g in group])
                                            for f in FIELDS}))
    if local:
      out += [_local_program(size, per_slot, docs) for size, per_slot in sorted(by_size.items())]
    return out


def _one_slot(batch, docs, size: int) -> dict[str, np.ndarray]:
  """A local micro-batch's documents packed into one slot's cell of `size` tokens [1, size]."""
  return hdp_layout.pack_step([(i, (0,)) for i in batch], docs, num_devices=1,
                              tokens_per_device=size)[1]


def _local_program(size: int, per_slot, docs) -> Program:
  """Every slot's local micro-batches of `size` tokens (`per_slot[d]`: lists of document
  indices) as one program: fields [S, k, size], k the most any slot runs to a power of 2."""
  k = _axis(per_slot)
  fields = {f: np.zeros((len(per_slot), k, size), np.float32 if f == "loss_mask" else np.int32)
            for f in FIELDS}
  for d, batches in enumerate(per_slot):
    for b, batch in enumerate(batches):
      cell = _one_slot(batch, docs, size)
      for f in FIELDS:
        fields[f][d, b] = cell[f][0]
  counts = np.array([len(batches) for batches in per_slot], np.int32)
  return Program(None, 1, size, fields, counts)


def _summed(params, sums, step=None):
  """A 'gradient function' whose batch is already the step's sums: with `grads.model_step`
  it is the update every step applies to its gradients."""
  del params, step
  return sums


class HDPStep:
  """(state, document batch) -> (state, metrics): the programs of `planner` over `pool`,
  each micro-step `grads`' gradient function on its view, then the optimizer's update.

  A run's programs accumulate on the run's devices; a local program runs every slot's
  micro-batches in a loop of the slot's own length (`shard_map`: no collective inside, so
  a slot that is done does not wait) into per-slot sums; finally the per-slot sums are
  added where they lie and summed over the pool: one all-reduce.
  """

  def __init__(self, pool: Pool, view_grads: ViewGrads, planner: Planner, optimizer,
               state_sh: TrainState, compiler_options: dict[str, Any] | None = None):
    self.pool, self.grads, self.planner = pool, view_grads, planner
    self.compiler_options = compiler_options
    # Every program's devices in the pool's order; the state stays on its own mesh (the
    # same shards on the same devices, rewrapped without a copy on the way in and out).
    self.mesh = pool.mesh
    self.params_sh = _on_mesh(state_sh.params, self.mesh)
    # The parameters as each micro-step reads them: whole on every slot (gathered over fsdp).
    self.gathered_sh = _on_mesh(self.params_sh, self.mesh, lambda spec: _without(spec, "fsdp"))
    self._gather_jit = jax.jit(lambda p: p, out_shardings=self.gathered_sh)
    rep = NamedSharding(self.mesh, P())
    self._acc_sh = (rep, rep, self.params_sh)
    self._state_rep = NamedSharding(state_sh.step.mesh, P())
    self._update_acc_sh = (self._state_rep, self._state_rep, state_sh.params)
    self._update = jax.jit(grads.model_step(_summed, optimizer),
                           out_shardings=(state_sh, self._state_rep), donate_argnums=0)
    # XLA:CPU runs a device's programs on a shared thread pool, not in dispatch order, and
    # two rings on overlapping devices in flight at once can leave a collective's
    # rendezvous short of a thread (seen: 7 of 8 arrived, then an abort). On CPU the
    # simulated devices share the cores anyway, so rings run one at a time there.
    self._one_ring_at_a_time = self.mesh.devices.flat[0].platform == "cpu"
    self._runs: dict[tuple, tuple] = {}
    # A run's programs over any run of its shape: compiled for the first, loaded onto others.
    self._run_programs, self._run_zeros = relocate.Programs(), relocate.Programs()
    self._locals: dict[int, Callable] = {}
    # Per-slot sums [S, ...]: a row per slot, each row split as the gathered parameters.
    stacked = NamedSharding(self.mesh, pool.stacked(P()))
    self._stacked_sh = (stacked, stacked,
                        _on_mesh(self.gathered_sh, self.mesh, pool.stacked))
    n = self.num_devices
    self._stacked_zeros = jax.jit(
        lambda p: jax.tree.map(lambda x: jnp.zeros((n,) + x.shape, x.dtype), _zero_sums(p)),
        out_shardings=self._stacked_sh)
    # The per-slot sums are added where they lie, then summed over the pool: one
    # all-reduce, not one per program.
    self._reduce = jax.jit(
        lambda locals_, runs: jax.tree.map(
            lambda run, *local: (run + sum(local)).sum(0), runs, *locals_),
        out_shardings=self._acc_sh)

  @property
  def num_devices(self) -> int:
    """The plan's devices: the pool's slots."""
    return self.pool.size

  @property
  def steps(self) -> tuple[HDPStep, ...]:
    """The pools a batch is planned for: this one (`replicas.PerReplica` has one a replica)."""
    return (self,)

  @staticmethod
  def batch_of(parts: list[dict]) -> dict:
    return parts[0]

  def plan(self, lengths) -> hdp_schedule.Schedule:
    return self.planner.plan(lengths)

  def fit(self, docs, micro_steps: int):
    return self.planner.fit(docs, micro_steps)

  def programs(self, sched: hdp_schedule.Schedule, docs) -> list[Program]:
    """The planner's programs of `sched` for this step's gradient function."""
    return self.planner.programs(sched, docs, microbatches=self.grads.microbatches,
                                 local=self.grads.local is not None)

  def __call__(self, state: TrainState, batch: dict[str, Any]):
    docs = batch["tokens"]
    sched = batch.get("plan") or self.plan([len(d) - 1 for d in docs])
    return self.run(state, docs, sched)

  def run(self, state: TrainState, docs, sched: hdp_schedule.Schedule):
    """One update over `docs` as the schedule lays them out."""
    return self.run_programs(state, self.programs(sched, docs),
                             micro_steps=self.planner.micro_batches(sched))

  def run_programs(self, state: TrainState, programs: list[Program], micro_steps: int = 0):
    """One update over `programs` (any layout the ring masks right: positions and segment
    ids per token, e.g. a static mesh's packed rows as runs over all slots)."""
    params = self._gather(state.params)
    run_sums, local_sums, reductions = {}, [], 0.0
    for prog in programs:
      if prog.slots is None:
        fn = self.local_program(prog.fields["inputs"].shape[1])
        stacked = self._stacked_sh[0]
        local_sums.append(fn(params, _put(prog.fields, stacked),
                             _put({"n": prog.counts}, stacked)["n"]))
        continue
      fn, batch_sh, zeros, params_sh = self.program(prog.slots, prog.context)
      view = batch_sh.mesh
      key = (prog.slots, prog.context)
      if key not in run_sums:
        on_run = replicas.on_devices(params, params_sh)
        run_sums[key] = (on_run, self._run_zeros(zeros, view, on_run))
      on_run, acc = run_sums[key]
      acc = self._run_programs(fn, view, on_run, _put(prog.fields, batch_sh), acc)
      run_sums[key] = (on_run, acc)
      # Each program all-reduces over its run: (c - 1) / (N - 1) of the pool's bytes,
      # averaged over the pool's devices.
      reductions += (len(prog.slots) - 1) / max(1, self.num_devices - 1)
      if self._one_ring_at_a_time:
        jax.block_until_ready(acc)
    per_slot = self._per_slot([(slots, acc) for (slots, _), (_, acc) in run_sums.items()],
                              replicas.on_devices(state.params, self.params_sh))
    acc = self._reduce(local_sums, per_slot)
    # One all-reduce over the pool at the end, besides the runs' own.
    state, metrics = self._update(state, replicas.on_devices(acc, self._update_acc_sh))
    return state, {**metrics,
                   "micro_steps": jax.device_put(np.int32(micro_steps), self._state_rep),
                   # The gradient all-reduces, in units of one over the whole pool (the
                   # loop's comm_bytes): a host value.
                   "grad_reductions": np.float32(1.0 + reductions)}

  def program(self, slots: tuple[int, ...], c: int | None = None):
    """(jitted micro-step, batch sharding, jitted zero sums, parameter shardings) of a run
    of slots (their indices in the pool) over its `data = len(slots) / c, context = c`
    view (c: the run's size by default), the view being the batch sharding's mesh."""
    c = len(slots) if c is None else c
    if (slots, c) not in self._runs:
      view = self.pool.view(c, slots)
      params_sh = _on_mesh(self.gathered_sh, view)
      rep = NamedSharding(view, P())
      acc_sh = (rep, rep, params_sh)
      batch_sh = NamedSharding(view, P("data", "context"))
      fn = jax.jit(sharded.under_mesh(accumulating(self.grads.of_view(view), params_sh), view),
                   in_shardings=(params_sh, batch_sh, acc_sh), out_shardings=acc_sh,
                   donate_argnums=2, compiler_options=self.compiler_options)
      self._runs[slots, c] = (fn, batch_sh, jax.jit(_zero_sums, out_shardings=acc_sh),
                              params_sh)
    return self._runs[slots, c]

  def local_program(self, k: int) -> Callable:
    """Every slot's (up to) k local micro-batches, as many as its count says."""
    if k not in self._locals:
      fn = functools.partial(_local_sums, grad_fn=self.grads.local)
      spec = self.pool.stacked(P())
      # Manual over the slots only: a slot's tensor group runs its model as one.
      mapped = jax.shard_map(fn, mesh=self.mesh, in_specs=(P(), spec, spec),
                             out_specs=spec, axis_names=set(self.pool.slot_axes),
                             check_vma=False)
      self._locals[k] = jax.jit(mapped, in_shardings=(self.gathered_sh, self._stacked_sh[0],
                                                      self._stacked_sh[0]),
                                out_shardings=self._stacked_sh,
                                compiler_options=self.compiler_options)
    return self._locals[k]

  def compile_for(self, state: TrainState, batches) -> TrainState:
    """Runs once every program the schedules of `batches` (lists of documents) need, one
    of each, so later steps time only compute: a benchmark's warm-up. Returns the state
    after (it is donated)."""
    seen, programs = set(), []
    for docs in batches:
      for prog in self.programs(self.plan([len(doc) - 1 for doc in docs]), docs):
        key = (prog.slots, prog.context, prog.cell, prog.fields["inputs"].shape)
        if key not in seen:
          seen.add(key)
          programs.append(prog)
    return self.run_programs(state, programs)[0]

  def lower(self, state: TrainState, c: int = 2) -> list:
    """The update's and a ring of `c` slots' micro-step programs, lowered for `state`'s
    shapes (abstract or real): what a compile check builds ahead of any batch."""
    fn, batch_sh, _, _ = self.program(tuple(range(c)))
    batch = {f: jax.ShapeDtypeStruct((self.grads.microbatches, c * self.planner.tokens_per_device),
                                     jnp.float32 if f == "loss_mask" else jnp.int32)
             for f in FIELDS}
    acc = jax.eval_shape(_zero_sums, state.params)  # shapes: each program lays them out
    return [self._update.lower(state, acc), fn.lower(acc[2], batch, acc)]

  def _gather(self, params):
    """The state's parameters as every micro-step reads them, on the pool's mesh."""
    return self._gather_jit(replicas.on_devices(params, self.params_sh))

  def _per_slot(self, run_sums: list[tuple], params):
    """The runs' sums ((slots, sums) pairs) stacked [S, ...] over the pool: each run's sums
    added on its first slot's devices, zeros elsewhere (this process's devices)."""
    def stack(zeros, *leaves):
      shards = {s.device: s.data for s in zeros.addressable_shards}
      for (slots, _), leaf in zip(run_sums, leaves):
        ring = {s.device: s.data for s in leaf.addressable_shards}
        for device in self.pool.slot_devices(slots[0]):
          if device in shards:
            shards[device] = shards[device] + ring[device][None]
      return jax.make_array_from_single_device_arrays(
          zeros.shape, zeros.sharding, [shards[s.device] for s in zeros.addressable_shards])

    return jax.tree.map(stack, self._stacked_zeros(params), *(acc for _, acc in run_sums))


def _zero_sums(params):
  return jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params)


def _put(fields: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
  return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
          for k, v in fields.items()}


def _axis(local) -> int:
  """A local program's micro-batch axis: the most any device runs, to a power of two."""
  return hdp.block_size(max(1, max(len(batches) for batches in local)))


def local_batches(sched: hdp_schedule.Schedule, lengths, tokens_per_device: int
                  ) -> dict[int, list]:
  """The local micro-batches of a schedule of `lengths` by their slots
  (`hdp_schedule.local_cell`): {slots: each device's micro-batches of that size}, one
  local program each."""
  out: dict[int, list] = {}
  for d, batches in enumerate(sched.local):
    for batch in batches:
      size = hdp_schedule.local_cell(sum(int(lengths[i]) for i in batch), tokens_per_device)
      out.setdefault(size, [[] for _ in sched.local])[d].append(batch)
  return out


def compiled_programs(sched: hdp_schedule.Schedule, lengths, tokens_per_device: int
                      ) -> dict[str, set]:
  """The programs `HDPStep` (the model's gradients) compiles for a schedule of `lengths`
  (no devices needed): "ring shape": (ring size, cell), each a ring program compiled once;
  "ring": (run of slots, cell), where they run (each beyond its shape's first a
  relocation, or a compile where relocating fails); "local": (micro-batch axis, slots),
  each compiled."""
  return {"ring": {(r.devices, r.cell) for r in sched.rings},
          "ring shape": {(len(r.devices), r.cell) for r in sched.rings},
          "local": {(_axis(local), size)
                    for size, local in local_batches(sched, lengths, tokens_per_device).items()}}


def _local_sums(params, batch, counts, *, grad_fn: grads.GradFn):
  """One device's sums over its first counts[0] micro-batches (batch [1, k, tpd])."""
  sums = accumulating(grad_fn)

  def body(b, acc):
    micro = {f: jax.lax.dynamic_index_in_dim(v[0], b, keepdims=True) for f, v in batch.items()}
    return sums(params, micro, acc)
  acc = jax.lax.fori_loop(0, counts[0], body, _zero_sums(params))
  return jax.tree.map(lambda x: x[None], acc)


class BatchPlanner:
  """The loader's documents -> an HDP step's batch: each pool fills `micro_steps` micro-steps.

  The loader offers more documents than fit. With several pools (one per replica) the
  offer is cut, in order, into one run of documents per pool, each of about the same
  tokens; each pool keeps what of its run (and of what the pools before it left) its
  `fit` takes, the first document always, and the last pool's leftovers go back to
  `loader` (the next batch starts with them, in order), so micro-steps are not left part
  empty by a token cut.
  """

  def __init__(self, executor: HDPStep | replicas.PerReplica, loader, micro_steps: int):
    self.executor, self.loader, self.micro_steps = executor, loader, micro_steps

  def __call__(self, batch):
    docs = batch["tokens"]
    pools = self.executor.steps
    before = np.cumsum([0] + [len(d) for d in docs])[:-1]
    share = [min(len(pools) - 1, int(t * len(pools) // max(1, before[-1] + len(docs[-1]))))
             for t in before] if docs else []
    left, parts = [], []  # indices into the loader's batch
    for r, pool in enumerate(pools):
      offer = left + [i for i, p in enumerate(share) if p == r]
      kept, steps = pool.fit([docs[i] for i in offer], self.micro_steps)
      parts.append({"tokens": [docs[offer[i]] for i in kept], "plan": steps})
      kept = set(kept)
      left = [j for i, j in enumerate(offer) if i not in kept]
    if left:
      self.loader.give_back(left)
    return self.executor.batch_of(parts)


def micro_steps_per_step(run: RunConfig, slots: int) -> int:
  """Micro-steps a step fills: data.batch_size * data.seq_len tokens over the pool's
  tokens per micro-step (slots * data.seq_len)."""
  return max(1, -(-run.data.batch_size // slots))


def loader_budget(slots: int, max_len: int) -> int:
  """Tokens the whole-document loader offers a step whose micro-steps hold `slots`: half
  as many again (at least one longest document more), so the step has documents to
  choose from to fill its micro-steps and gives the rest back. (On the stdlib, 8 devices,
  1024 tokens each, 8 micro-steps: 6.3% of slots stay empty with one document more, 4.2%
  with half as many again, 4.2% with twice.)"""
  return slots + max(max_len, slots // 2)


def make_step(model_cfg: transformer.TransformerConfig, optimizer, mesh: Mesh,
              state_sh: TrainState, tokens_per_device: int, *, widen: bool = False,
              view_grads: ViewGrads | None = None) -> HDPStep:
  """The HDP step over `mesh`'s pool, `tokens_per_device` tokens a slot (the model's
  gradients unless `view_grads` says otherwise)."""
  pool = Pool(mesh)
  planner = Planner(pool.size, tokens_per_device, model_cfg.d_model, widen)
  return HDPStep(pool, view_grads or model_grads(model_cfg), planner, optimizer, state_sh,
                 step_lib.compiler_options(model_cfg, pool.mesh))


def make_executor(run: RunConfig, optimizer, mesh, state_sh: TrainState,
                  schedule: pipeline.Schedule | None = None,
                  layout: pipeline.Layout | None = None) -> HDPStep | replicas.PerReplica:
  """The HDP step of `run` on `mesh`, data.seq_len tokens a slot: one pool, or one per
  replica (`replicas.PerReplica`) when the mesh has a `replica` axis; pools of pipelines
  running `schedule` over the stage view `layout` when given."""
  view_grads = None if layout is None else pipeline_grads(
      run.model, schedule, layout, vocab_algorithm=run.pipeline.vocab_algorithm,
      gather_once=run.pipeline.gather_once)
  step = functools.partial(make_step, run.model, optimizer, tokens_per_device=run.data.seq_len,
                           widen=run.parallel.hdp_widen_rings, view_grads=view_grads)
  if mesh_lib.REPLICA not in mesh.axis_names:
    return step(mesh, state_sh)
  return replicas.PerReplica(step, mesh, state_sh)


def slots(mesh: Mesh) -> int:
  """The slots of every pool on `mesh` (one pool per replica)."""
  return sum(Pool(m).size for m in replicas.replica_meshes(mesh))
