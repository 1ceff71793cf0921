"""Training with Hybrid Data Parallelism: whole documents, each on as many devices as it needs.

A step takes a global batch of whole documents (jaxsys.data.documents), plans it
(`hdp.plan`: micro-steps, each device a cell of `tokens_per_device` tokens) and runs every
micro-step as one compiled program over a view of the same devices, `data = N/c,
context = c` for c the step's largest ring (`hdp_layout.pack_step`): ring attention over
`context` where c > 1, the plain kernels where c = 1. So a run compiles at most
log2(N) + 1 micro-step programs. The summed token loss, token count and gradients
accumulate over the micro-steps in the parameters' (replicated) sharding; one optimizer
update divides by the whole batch's token count, so the step equals a single-device step
over the same documents, however they were split.

The pool is a mesh's batch axes (`data`, `fsdp`): each of their devices, with the devices
of its `tensor` group and its pipeline's stages, is one slot of the plan. The views regroup
the slots into `data = S/c, context = c` and keep `stage` and `tensor`, so every view
reads the parameters where they are. With `fsdp` the pool trains as ZeRO-2 does
(ByteScale's HDP with ZeRO): the parameters are gathered once a step for its micro-steps,
the gradients accumulate reduce-scattered over `fsdp`, and the update runs on the shards.
Over pipelines (`Pipelined`) the micro-steps are the schedule's microbatches, m to a
program.
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
from jaxsys.parallel import hdp, hdp_layout, hdp_schedule, pipeline, relocate
from jaxsys.train import grads
from jaxsys.train import step as step_lib
from jaxsys.train.state import REPLICA_AXIS as REPLICA, TrainState


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
class Pipelined:
  """Pools of pipelines: each slot spans `stage` (with `tensor`), and a program runs
  `schedule`'s m microbatches, m of the plan's micro-batches, over its view: ring attention
  inside the stages (the executor's uniform ticks) where the view has context > 1."""
  schedule: pipeline.Schedule
  layout: pipeline.Layout
  vocab_algorithm: int = 2
  gather_once: bool = False


class _HDPBase:
  """What the executors share: the pool, a view's gradient function (the model's, or a
  pipeline's with `pipelined`), the accumulator and the optimizer update."""

  def __init__(self, model_cfg, optimizer, mesh: Mesh, state_sh: TrainState,
               tokens_per_device: int, pipelined: Pipelined | None = None):
    self.pool = Pool(mesh)
    self.pipelined = pipelined
    # Micro-steps one program runs: the pipeline's microbatches, for a pool of pipelines.
    self.microbatches = 1 if pipelined is None else pipelined.schedule.microbatches
    # Every program's devices in the pool's order; the state stays on its own mesh (the
    # same shards on the same devices, rewrapped without a copy on the way in and out).
    self.model_cfg, self.optimizer, self.mesh = model_cfg, optimizer, self.pool.mesh
    self.tokens_per_device = tokens_per_device
    self.params_sh = _on_mesh(state_sh.params, self.mesh)
    # The parameters as each micro-step reads them: whole on every slot (gathered over fsdp).
    self.gathered_sh = _on_mesh(self.params_sh, self.mesh, lambda spec: _without(spec, "fsdp"))
    self._gather_jit = jax.jit(lambda p: p, out_shardings=self.gathered_sh)
    rep = NamedSharding(self.mesh, P())
    self._acc_sh = (rep, rep, self.params_sh)
    self._zeros_jit = jax.jit(_zero_sums, out_shardings=self._acc_sh)
    state_rep = NamedSharding(mesh, P())
    self._update_acc_sh = (state_rep, state_rep, state_sh.params)
    update = functools.partial(step_lib.apply_gradients, optimizer=optimizer)
    self._update = jax.jit(lambda s, acc: update(s, total=acc[0], count=acc[1], grads=acc[2]),
                           out_shardings=(state_sh, state_rep), donate_argnums=0)

  def _gather(self, params):
    """The state's parameters as every micro-step reads them, on the pool's mesh."""
    return self._gather_jit(_on(params, self.params_sh))

  def _zeros(self, params):
    """Zero sums of the state's parameters, laid out as the pool accumulates them."""
    return self._zeros_jit(_on(params, self.params_sh))

  @property
  def num_devices(self) -> int:
    """The plan's devices: the pool's slots."""
    return self.pool.size

  @property
  def pools(self) -> tuple["_HDPBase", ...]:
    return (self,)

  @staticmethod
  def batch_of(parts: list[dict]) -> dict:
    return parts[0]

  def _view_program(self, view: Mesh, params_sh, acc_sh):
    """The jitted micro-step over the `data, context` view `view`, and its batch sharding.
    Parameters and sums take `params_sh`' and `acc_sh`'s layouts (the pool's, for the
    lock-step executor) so each view compiles once."""
    batch_sh = NamedSharding(view, P("data", "context"))
    fn = accumulating(self._grad_fn(view), params_sh)
    jitted = jax.jit(sharded.under_mesh(fn, view),
                     in_shardings=(params_sh, batch_sh, acc_sh),
                     out_shardings=acc_sh, donate_argnums=2,
                     compiler_options=step_lib.compiler_options(self.model_cfg, view))
    return jitted, batch_sh

  def _grad_fn(self, view: Mesh) -> grads.GradFn:
    """The gradient function of a micro-step over `view`."""
    split, p = _context_split(view), self.pipelined
    if p is None:
      return grads.autodiff(self.model_cfg, split)
    return grads.pipelined(self.model_cfg, p.schedule, p.layout, view,
                           vocab_algorithm=p.vocab_algorithm, context_split=split,
                           gather_once=p.gather_once)

  def __call__(self, state: TrainState, batch: dict[str, Any]):
    docs = batch["tokens"]
    plan = batch.get("plan") or self.plan([len(d) - 1 for d in docs])
    return self.run(state, docs, plan)

  def lower(self, state: TrainState, c: int = 2) -> list:
    """The update's and a ring of `c` slots' micro-step programs, lowered for `state`'s
    shapes (abstract or real): what a compile check builds ahead of any batch."""
    fn, batch_sh = self.ring(c)
    rows = batch_sh.mesh.shape["data"] * self.microbatches
    batch = {f: jax.ShapeDtypeStruct((rows, c * self.tokens_per_device),
                                     jnp.float32 if f == "loss_mask" else jnp.int32)
             for f in FIELDS}
    acc = jax.eval_shape(_zero_sums, state.params)  # shapes: each program lays them out
    return [self._update.lower(state, acc), fn.lower(acc[2], batch, acc)]

  def _finish(self, state, acc, micro_batches: int, reductions: float):
    """The update, and the step's metrics: `grad_reductions`, the gradient all-reduces it
    ran in units of one over the whole pool (the loop's comm_bytes)."""
    state, metrics = self._update(state, _on(acc, self._update_acc_sh))
    return state, {**metrics, "micro_steps": jnp.asarray(micro_batches),
                   "grad_reductions": np.float32(reductions)}  # a host value


def _zero_sums(params):
  return jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params)


class HDPStep(_HDPBase):
  """Lock-step HDP: (state, document batch) -> (state, metrics) over `hdp.plan`'s
  micro-steps, each one program over the pool's `data = N/c, context = c` view (over pools
  of pipelines, m micro-steps to a program over the view of c, their largest ring)."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._programs: dict[int, tuple[Callable, NamedSharding]] = {}

  def ring(self, c: int) -> tuple[Callable, NamedSharding]:
    return self.program(c)

  def program(self, c: int) -> tuple[Callable, NamedSharding]:
    """The jitted micro-step of views with context c, and its batch sharding (cached)."""
    if c not in self._programs:
      self._programs[c] = self._view_program(self.pool.view(c), self.gathered_sh, self._acc_sh)
    return self._programs[c]

  def compile_all(self, params) -> None:
    """Compiles (by running once on padding) every view's program, so later steps time
    only compute: a benchmark's warm-up. Training compiles views as it meets them."""
    c = 1
    while c <= self.num_devices:
      fn, batch_sh = self.program(c)
      fields = self._pack([[]] * self.microbatches, [], c)
      jax.block_until_ready(fn(self._gather(params), _put(fields, batch_sh), self._zeros(params)))
      c *= 2

  def fit(self, docs, micro_steps: int):
    """(kept, plan of those docs): what of `docs` one step takes, at most `micro_steps`
    micro-steps, in a few plans (`hdp.fit_documents`). The plan indexes the kept
    documents; callers pass docs[kept] alongside it."""
    return hdp.fit_documents([len(d) - 1 for d in docs], budget=micro_steps,
                             capacity=micro_steps * self.num_devices * self.tokens_per_device,
                             plan=self.plan, micro_batches=self.micro_batches)

  def plan(self, lengths) -> hdp.Plan:
    return hdp.plan([int(n) for n in lengths], num_devices=self.num_devices,
                    tokens_per_device=self.tokens_per_device)

  @staticmethod
  def micro_batches(plan: hdp.Plan) -> int:
    return len(plan)

  def _pack(self, micro_steps, docs, c: int) -> dict[str, np.ndarray]:
    """Micro-steps packed over the view of c as one program's batch: micro-step j's row k
    at row k * len(micro_steps) + j, so `pipeline.split_microbatches` takes micro-step j
    as microbatch j and row k stays on the view's data shard k."""
    fields = [hdp_layout.pack_step(micro, docs, num_devices=self.num_devices,
                                   tokens_per_device=self.tokens_per_device, view=c)[1]
              for micro in micro_steps]
    return {k: np.stack([f[k] for f in fields], axis=1).reshape(-1, c * self.tokens_per_device)
            for k in FIELDS}

  def run(self, state: TrainState, docs, steps: hdp.Plan):
    """One update over `docs` laid out by the plan `steps`: its micro-steps, `microbatches`
    to a program over the view of their largest ring (the last padded with empty ones),
    then the update."""
    m = self.microbatches

    def programs():
      for start in range(0, len(steps), m):
        group = steps[start:start + m]
        c = max(hdp_layout.view_size(micro) for micro in group)
        yield c, self._pack(group + [[]] * (m - len(group)), docs, c)
    state, metrics = self.run_packed(state, programs())
    return state, {**metrics, "micro_steps": jnp.asarray(len(steps))}

  def run_packed(self, state: TrainState, micro_batches):
    """One update over programs' batches given as (c, fields [N/c * microbatches,
    c * tokens_per_device]) in any layout the ring masks right (positions and segment ids
    per token), e.g. a static mesh's packed rows."""
    params, acc, count = self._gather(state.params), self._zeros(state.params), 0
    for c, fields in micro_batches:
      count += 1
      fn, batch_sh = self.program(c)
      acc = fn(params, _put(fields, batch_sh), acc)
    # Every program all-reduces its gradients over the pool once.
    return self._finish(state, acc, count, reductions=float(count))


def _put(fields: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
  return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
          for k, v in fields.items()}


class PerRankHDPStep(_HDPBase):
  """Per-rank HDP (ByteScale's DP-Balance): each device runs its own micro-batches of
  `hdp_schedule.schedule`, and only the gradient all-reduce at the end waits for all.

  A ring is one program over its run of devices (`data = 1, context = c`), with cells
  of the ring's size; each run's programs accumulate on the run. Then, per local
  micro-batch size (`hdp_schedule.local_cell`), one program over the pool runs every
  device's local micro-batches of that size in a loop of its own length (`shard_map`: no
  collective inside, so a device that is done does not wait), from zero sums kept per
  device. The rings are dispatched first, so a device starts its local work when its
  own rings are done; finally one all-reduce sums the per-device and per-run sums.
  A ring program compiles once per ring size and cell size (`hdp_schedule.CELL_STEPS` at
  most) and is loaded onto each other run of slots of that size (`relocate.Programs`);
  local programs compile per local size (`hdp_schedule.LOCAL_SIZES`) and power of two of
  local micro-batches.
  """

  def __init__(self, *args, widen: bool = False, **kwargs):
    super().__init__(*args, **kwargs)
    # hdp_schedule.schedule's: rings may take up to twice the devices they need when the
    # FLOP estimate says that ends sooner (it knows no link speed; off: least padding).
    self.widen = widen
    # XLA:CPU runs a device's programs on a shared thread pool, not in dispatch order, and
    # two rings on overlapping devices in flight at once can leave a collective's
    # rendezvous short of a thread (seen: 7 of 8 arrived, then an abort). On CPU the
    # simulated devices share the cores anyway, so rings run one at a time there.
    self._one_ring_at_a_time = self.mesh.devices.flat[0].platform == "cpu"
    self._rings: dict[tuple[int, ...], tuple] = {}
    # A ring's programs over any run of its size: compiled for the first, loaded onto others.
    self._ring_programs, self._ring_zeros = relocate.Programs(), relocate.Programs()
    self._locals: dict[int, Callable] = {}
    # Per-slot sums [S, ...]: a row per slot, each row split as the gathered parameters.
    stacked = NamedSharding(self.mesh, self.pool.stacked(P()))
    self._stacked_sh = (stacked, stacked,
                        _on_mesh(self.gathered_sh, self.mesh, self.pool.stacked))
    n = self.num_devices
    self._stacked_zeros = jax.jit(
        lambda p: jax.tree.map(lambda x: jnp.zeros((n,) + x.shape, x.dtype), _zero_sums(p)),
        out_shardings=self._stacked_sh)
    # The per-device sums are added where they lie, then summed over the pool: one
    # all-reduce, not one per local program.
    self._reduce = jax.jit(
        lambda locals_, rings: jax.tree.map(
            lambda ring, *local: (ring + sum(local)).sum(0), rings, *locals_),
        out_shardings=self._acc_sh)

  def plan(self, lengths) -> hdp_schedule.Schedule:
    return hdp_schedule.schedule([int(n) for n in lengths], num_devices=self.num_devices,
                                 tokens_per_device=self.tokens_per_device,
                                 d_model=self.model_cfg.d_model, widen=self.widen)

  def fit(self, docs, micro_steps: int):
    """(kept, schedule of those docs): what of `docs` one step takes, at most `micro_steps`
    micro-batches on every device, in one schedule (`hdp_schedule.fit`). The schedule
    indexes the kept documents; callers pass docs[kept] alongside it."""
    return hdp_schedule.fit([len(d) - 1 for d in docs], budget=micro_steps,
                            num_devices=self.num_devices,
                            tokens_per_device=self.tokens_per_device,
                            d_model=self.model_cfg.d_model, widen=self.widen)

  @staticmethod
  def micro_batches(sched: hdp_schedule.Schedule) -> int:
    return int(sched.micro_batches().max(initial=0))

  def ring(self, c: int) -> tuple[Callable, NamedSharding]:
    return self.ring_program(tuple(range(c)))[:2]

  def ring_program(self, block: tuple[int, ...]):
    """(jitted micro-step, batch sharding, jitted zero sums, parameter shardings) of a run
    of slots (`block`: their indices in the pool), over its view (the batch sharding's
    mesh); `_run_sums` runs them as programs compiled once per ring size and cell."""
    if block not in self._rings:
      view = self.pool.view(len(block), block)
      params_sh = _on_mesh(self.gathered_sh, view)
      rep = NamedSharding(view, P())
      acc_sh = (rep, rep, params_sh)
      fn, batch_sh = self._view_program(view, params_sh, acc_sh)
      self._rings[block] = (fn, batch_sh, jax.jit(_zero_sums, out_shardings=acc_sh), params_sh)
    return self._rings[block]

  def local_program(self, k: int) -> Callable:
    """Every device's (up to) k local micro-batches, as many as its count says."""
    if k not in self._locals:
      fn = functools.partial(_local_sums, model_cfg=self.model_cfg)
      spec = self.pool.stacked(P())
      # Manual over the slots only: a slot's tensor group runs its model as one.
      mapped = jax.shard_map(fn, mesh=self.mesh, in_specs=(P(), spec, spec),
                             out_specs=spec, axis_names=set(self.pool.slot_axes),
                             check_vma=False)
      self._locals[k] = jax.jit(mapped, in_shardings=(self.gathered_sh, self._stacked_sh[0],
                                                      self._stacked_sh[0]),
                                out_shardings=self._stacked_sh)
    return self._locals[k]

  def compile_for(self, params, batches) -> None:
    """Compiles (by running once on padding) the programs that the schedules of
    `batches` (lists of documents) need, so later steps time only compute: a
    benchmark's warm-up."""
    runs, locals_ = set(), set()
    for docs in batches:
      sched = self.plan([len(doc) - 1 for doc in docs])
      runs |= set(self._run_batches(sched, docs))
      locals_ |= {(_axis(local), size) for size, local in self._local_batches(sched, docs).items()}
    gathered = self._gather(params)
    self._run_sums(gathered, {run: [] for run in runs})
    for k, size in locals_:
      no_batches = [()] * self.num_devices
      jax.block_until_ready(
          self.local_program(k)(gathered, *self._local_inputs(k, size, no_batches, [])))

  def _run_batches(self, sched: hdp_schedule.Schedule, docs) -> dict[tuple, list]:
    """The rings' micro-batches by their run of slots and cell: {(block, cell): each
    packed [1, c * cell], in the schedule's order}. A pool of pipelines also runs each
    slot's local micro-batches so, as runs of one slot (a pipeline is no local program):
    every run pipelines its micro-batches of a cell, m to a program, at its own pace."""
    out: dict[tuple, list] = {}
    for ring in sched.rings:
      c = len(ring.devices)
      _, fields = hdp_layout.pack_step(ring.entries(), docs, num_devices=c,
                                       tokens_per_device=ring.cell, view=c)
      out.setdefault((ring.devices, ring.cell), []).append(fields)
    if self.pipelined is not None:
      for size, local in sorted(self._local_batches(sched, docs).items()):
        for d, batches in enumerate(local):
          for batch in batches:
            _, fields = hdp_layout.pack_step([(i, (0,)) for i in batch], docs, num_devices=1,
                                             tokens_per_device=size)
            out.setdefault(((d,), size), []).append(fields)
    return out

  def _run_sums(self, params, runs: dict[tuple, list]) -> tuple[dict, float]:
    """({block: its sums}, all-reduces): each run's micro-batches, `microbatches` to a
    program (the last padded with empty ones), accumulated on the run's devices. Each
    program all-reduces over its run: (c - 1) / (N - 1) of the pool's bytes, averaged over
    the pool's devices."""
    m, sums, reductions = self.microbatches, {}, 0.0
    for (block, cell), cells in runs.items():
      fn, batch_sh, zeros, params_sh = self.ring_program(block)
      view = batch_sh.mesh
      if block not in sums:
        on_run = _on(params, params_sh)
        sums[block] = (on_run, self._ring_zeros(zeros, view, on_run))
      on_run, acc = sums[block]
      _, empty = hdp_layout.pack_step([], [], num_devices=len(block), tokens_per_device=cell,
                                      view=len(block))
      for start in range(0, max(1, len(cells)), m):
        group = cells[start:start + m]
        fields = {f: np.concatenate([g[f] for g in group + [empty] * (m - len(group))])
                  for f in FIELDS}
        acc = self._ring_programs(fn, view, on_run, _put(fields, batch_sh), acc)
        reductions += (len(block) - 1) / max(1, self.num_devices - 1)
        if self._one_ring_at_a_time:
          jax.block_until_ready(acc)
      sums[block] = (on_run, acc)
    return {block: acc for block, (_, acc) in sums.items()}, reductions

  def _local_batches(self, sched: hdp_schedule.Schedule, docs) -> dict[int, list]:
    return local_batches(sched, [len(doc) - 1 for doc in docs], self.tokens_per_device)

  def _local_inputs(self, k: int, size: int, local, docs):
    """A local program's inputs: every device's micro-batches (`local[d]`, lists of
    document indices) packed into fields [N, k, size], and their counts [N]."""
    fields = {f: np.zeros((self.num_devices, k, size), np.float32 if f == "loss_mask"
                          else np.int32) for f in FIELDS}
    for d, batches in enumerate(local):
      for b, batch in enumerate(batches):
        _, cell = hdp_layout.pack_step([(i, (0,)) for i in batch], docs, num_devices=1,
                                       tokens_per_device=size)
        for f in FIELDS:
          fields[f][d, b] = cell[f][0]
    counts = np.array([len(batches) for batches in local], np.int32)
    stacked = self._stacked_sh[0]
    return _put(fields, stacked), _put({"n": counts}, stacked)["n"]

  def _run_locals(self, params, sched: hdp_schedule.Schedule, docs) -> list:
    """Per local micro-batch size, every device's local sums [S, ...] (one program each;
    none for a pool of pipelines, whose local micro-batches are runs)."""
    if self.pipelined is not None:
      return []
    return [self.local_program(k)(params, *self._local_inputs(k, size, local, docs))
            for size, local in sorted(self._local_batches(sched, docs).items())
            for k in [_axis(local)]]

  def run(self, state: TrainState, docs, sched: hdp_schedule.Schedule):
    """One update over `docs` as the schedule lays them out."""
    params = self._gather(state.params)
    # The rings first: a device starts its local work when its own rings are done.
    block_sums, ring_reductions = self._run_sums(params, self._run_batches(sched, docs))
    local_sums = self._run_locals(params, sched, docs)
    ring_sums = self._per_device(block_sums, _on(state.params, self.params_sh))
    acc = self._reduce(local_sums, ring_sums)
    # One all-reduce over the pool at the end, besides the rings' own.
    return self._finish(state, acc, self.micro_batches(sched), 1.0 + ring_reductions)

  def _per_device(self, block_sums: dict, params):
    """The runs' sums stacked [S, ...] over the pool: each run's sums added on its first
    slot's devices, zeros elsewhere (this process's devices)."""
    def stack(zeros, *leaves):
      shards = {s.device: s.data for s in zeros.addressable_shards}
      for block, leaf in zip(block_sums, leaves):
        ring = {s.device: s.data for s in leaf.addressable_shards}
        for device in self.pool.slot_devices(block[0]):
          if device in shards:
            shards[device] = shards[device] + ring[device][None]
      return jax.make_array_from_single_device_arrays(
          zeros.shape, zeros.sharding, [shards[s.device] for s in zeros.addressable_shards])

    return jax.tree.map(stack, self._stacked_zeros(params), *block_sums.values())


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


def programs(sched: hdp_schedule.Schedule, lengths, tokens_per_device: int) -> dict[str, set]:
  """The programs `PerRankHDPStep` runs for a schedule of `lengths` (no devices needed):
  "ring shape": (ring size, cell), each a ring program compiled once; "ring": (block of
  slots, cell), where they run (each beyond its shape's first a relocation, or a compile
  where relocating fails); "local": (micro-batch axis, slots), each compiled."""
  return {"ring": {(r.devices, r.cell) for r in sched.rings},
          "ring shape": {(len(r.devices), r.cell) for r in sched.rings},
          "local": {(_axis(local), size)
                    for size, local in local_batches(sched, lengths, tokens_per_device).items()}}


def _on(tree, shardings):
  """Pool arrays read on a view of some of their devices, each by its shards there (no copy):
  every view keeps the axes that split them, so those devices hold a whole array."""
  def on(x, sharding):
    devices = set(sharding.mesh.devices.flat)
    return jax.make_array_from_single_device_arrays(
        x.shape, sharding, [s.data for s in x.addressable_shards if s.device in devices])
  return jax.tree.map(on, tree, shardings)


def _local_sums(params, batch, counts, *, model_cfg: transformer.TransformerConfig):
  """One device's sums over its first counts[0] micro-batches (batch [1, k, tpd])."""
  sums = accumulating(grads.autodiff(model_cfg))

  def body(b, acc):
    micro = {f: jax.lax.dynamic_index_in_dim(v[0], b, keepdims=True) for f, v in batch.items()}
    return sums(params, micro, acc)
  acc = jax.lax.fori_loop(0, counts[0], body, _zero_sums(params))
  return jax.tree.map(lambda x: x[None], acc)


class Planner:
  """The loader's documents -> an HDP step's batch: each pool fills `micro_steps` micro-steps.

  The loader offers more documents than fit. With several pools (one per replica) the
  offer is cut, in order, into one run of documents per pool, each of about the same
  tokens; each pool keeps what of its run (and of what the pools before it left) its
  `fit` takes, the first document always, and the last pool's leftovers go back to
  `loader` (the next batch starts with them, in order), so micro-steps are not left part
  empty by a token cut.
  """

  def __init__(self, executor: "HDPExecutor", loader, micro_steps: int):
    self.executor, self.loader, self.micro_steps = executor, loader, micro_steps

  def __call__(self, batch):
    docs = batch["tokens"]
    pools = self.executor.pools
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


def make_executor(run: RunConfig, optimizer, mesh, state_sh: TrainState,
                  schedule: pipeline.Schedule | None = None,
                  layout: pipeline.Layout | None = None) -> "HDPExecutor":
  """The HDP step of `run` on `mesh`: one pool (`Pool`), data.seq_len tokens per slot, or
  one per replica (`ReplicaPools`) when the mesh has a `replica` axis; pools of pipelines
  running `schedule` over the stage view `layout` when given."""
  pipelined = None if layout is None else Pipelined(
      schedule, layout, vocab_algorithm=run.pipeline.vocab_algorithm,
      gather_once=run.pipeline.gather_once)

  def executor(mesh, state_sh):
    args = (run.model, optimizer, mesh, state_sh, run.data.seq_len, pipelined)
    if run.parallel.hdp_schedule == "per_rank":
      return PerRankHDPStep(*args, widen=run.parallel.hdp_widen_rings)
    return HDPStep(*args)
  if REPLICA not in mesh.axis_names:
    return executor(mesh, state_sh)
  return ReplicaPools(executor, mesh, state_sh)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
  """Each replica's devices as a mesh of the other axes; [mesh] without a `replica` axis."""
  if REPLICA not in mesh.axis_names:
    return [mesh]
  at = mesh.axis_names.index(REPLICA)
  names = tuple(a for a in mesh.axis_names if a != REPLICA)
  return [Mesh(np.take(mesh.devices, r, axis=at), names) for r in range(mesh.shape[REPLICA])]


def slots(mesh: Mesh) -> int:
  """The slots of every pool on `mesh` (one pool per replica)."""
  return sum(Pool(m).size for m in replica_meshes(mesh))


class ReplicaPools:
  """HDP inside each of an outer optimizer's replicas: one pool per replica, on that
  replica's devices, steps the replica's slice of the stacked state [R, ...] (its
  parameters and inner optimizer state) over its own documents; the outer state is left to
  the sync. A replica's slice is each of its devices' own shard, copied on that device, and
  the result is stacked back the same way, so nothing crosses replicas in a step.
  """

  def __init__(self, executor: Callable[[Mesh, TrainState], "HDPStep | PerRankHDPStep"],
               mesh: Mesh, state_sh: TrainState):
    self.mesh, self.state_sh = mesh, state_sh
    self.meshes = replica_meshes(mesh)
    self.replica_sh = [_replica_shardings(state_sh, m) for m in self.meshes]
    self.pools = [executor(m, sh) for m, sh in zip(self.meshes, self.replica_sh)]

  @staticmethod
  def batch_of(parts: list[dict]) -> dict:
    return {"pools": parts}

  @property
  def num_devices(self) -> int:
    return sum(pool.num_devices for pool in self.pools)

  def lower(self, state: TrainState, c: int = 2) -> list:
    """Replica 0's update and ring programs (every replica's are the same on its devices)."""
    sh = self.replica_sh[0]
    one = lambda x, s: jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=s)
    return self.pools[0].lower(TrainState(
        step=jax.ShapeDtypeStruct((), state.step.dtype, sharding=sh.step),
        params=jax.tree.map(one, state.params, sh.params),
        opt_state=jax.tree.map(one, state.opt_state, sh.opt_state)), c)

  def __call__(self, state: TrainState, batch: dict[str, Any]):
    # Every replica's slice first: a step donates its slice, and the step counter's slices
    # are the stacked one's own shards.
    mine = [(pool, part, TrainState(step=_on(state.step, sh.step),
                                    params=_slice(state.params, sh.params),
                                    opt_state=_slice(state.opt_state, sh.opt_state)))
            for pool, sh, part, mesh in zip(self.pools, self.replica_sh, batch["pools"],
                                            self.meshes)
            if any(d.process_index == jax.process_index() for d in mesh.devices.flat)]
    steps, params, opt_states, metrics = [], [], [], []
    for pool, part, one in mine:  # this process's replicas
      one, m = pool(one, part)
      steps.append(one.step)
      params.append(one.params)
      opt_states.append(one.opt_state)
      metrics.append(m)
    micro_steps = max(int(m.pop("micro_steps")) for m in metrics)  # host values: no wait
    reductions = np.mean([m.pop("grad_reductions") for m in metrics], dtype=np.float32)
    state = state.replace(step=_stack(steps, self.state_sh.step, lead=False),
                          params=jax.tree.map(lambda sh, *x: _stack(x, sh), self.state_sh.params,
                                              *params),
                          opt_state=jax.tree.map(lambda sh, *x: _stack(x, sh),
                                                 self.state_sh.opt_state, *opt_states))
    # Per replica [R], as `grads.replica_step`'s: `grads.replica_totals` combines them.
    per_replica = NamedSharding(self.mesh, P(REPLICA))
    metrics = {k: _stack([m[k] for m in metrics], per_replica) for k in metrics[0]}
    return state, {**metrics, "micro_steps": jnp.asarray(micro_steps),
                   "grad_reductions": reductions}


def _replica_shardings(state_sh: TrainState, mesh: Mesh) -> TrainState:
  """One replica's shardings on its `mesh`: the stacked state's, less the leading `replica`."""
  one = lambda sh: NamedSharding(mesh, P(*sh.spec[1:]))
  return TrainState(step=NamedSharding(mesh, P()), params=jax.tree.map(one, state_sh.params),
                    opt_state=jax.tree.map(one, state_sh.opt_state))


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
  shape = ((sharding.mesh.shape[REPLICA],) if lead else ()) + leaves[0].shape
  return jax.make_array_from_single_device_arrays(shape, sharding, shards)


HDPExecutor = HDPStep | PerRankHDPStep | ReplicaPools
