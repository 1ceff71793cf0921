"""The executor: one `lax.scan` over a schedule's ticks inside a `jax.shard_map` over
`stage` (see the package's docstring), and the entry points that run it."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxsys import mesh as mesh_lib
from jaxsys.models import transformer
from jaxsys.parallel import routing, schedules
from jaxsys.parallel.pipeline import transport
from jaxsys.parallel.pipeline.chunk import Chunk
from jaxsys.parallel.pipeline.head import VocabLayers
from jaxsys.parallel.pipeline.layout import (AXIS, DATA_AXIS, FSDP_AXIS, VOCAB_PARAMS, Batch,
                                             Layout, fsdp_dims, microbatches_by_replica,
                                             param_specs, take)
from jaxsys.parallel.schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, IDLE,
                                       KINDS, Schedule)

_SENDS_GRAD = (BACKWARD, BACKWARD_INPUT)  # the backward kinds that send an input gradient


def pipeline_loss_and_grads(cfg: transformer.TransformerConfig, schedule: Schedule,
                            layout: Layout, params, batch: Batch, *, mesh,
                            vocab_algorithm: int = 2, attention_fn: Callable | None = None,
                            with_counts: bool = False, gather_once: bool = False,
                            fused: bool | None = None):
  """(summed token loss, gradients of it in the pipeline view) of `batch` run by `schedule`.

  `params` are in the `to_stages` view; `batch` is [B, T] arrays with B divisible by
  schedule.microbatches. Divide loss and gradients by the token count for the mean.
  `with_counts` adds a third output, [stages, schedules.KINDS]: the ticks each stage ran
  nothing (idle) and the actions of each kind it ran (forward, backward, backward input,
  backward weight), counted by the program.
  `gather_once`: with an `fsdp` axis, each stage's weights are all-gathered once before the
  ticks and its gradients reduce-scattered once after them (MaxText's
  `pipeline_fsdp_ag_once`), instead of a gather and a reduction in every tick; the cost is
  the stage's whole weights and gradients held on every device of the stage.
  `fused`: run the schedule's fused ticks (True), its table's one-action ticks (False), or
  `schedule.executed`, the shorter in lock step (None).
  """
  loss, grads, counts = execute(cfg, schedule, layout, params, batch, mesh=mesh, train=True,
                                 vocab_algorithm=vocab_algorithm, attention_fn=attention_fn,
                                 gather_once=gather_once, fused=fused)
  return (loss[0], grads, counts) if with_counts else (loss[0], grads)


def replica_loss_and_grads(cfg: transformer.TransformerConfig, schedule: Schedule,
                           layout: Layout, params, batch: Batch, *, mesh, shifts=None,
                           weights=None, vocab_algorithm: int = 2,
                           attention_fn: Callable | None = None, gather_once: bool = False):
  """(loss sums [R], gradients [R, ...]) of R pipelines, one per replica of the `replica` axis.

  `params`: [R, ...] in the `to_stages` view; `batch`: [B, T], replica r's rows
  r*B/R .. (r+1)*B/R - 1. `shifts`: None (fixed routing: replica r runs its own rows) or
  [microbatches, chunks - 1] ints (`routing.draw_shifts`): the boundary after chunk g
  moves microbatch m to the replica shifts[m, g] further on. loss[r] sums the token loss
  of replica r's rows wherever they ran. The gradients are those of sum_r weights[r] *
  loss[r] (weights: [R], default ones), each replica's for its own parameters.
  `gather_once` as in `pipeline_loss_and_grads`.
  """
  replicas = jax.tree.leaves(params)[0].shape[0]
  if dict(mesh.shape).get(routing.AXIS) != replicas:
    raise ValueError(f"parameters of {replicas} replicas need a mesh with replica={replicas}, "
                     f"not {dict(mesh.shape)}")
  loss, grads, _ = execute(cfg, schedule, layout, params, batch, mesh=mesh, train=True,
                            vocab_algorithm=vocab_algorithm, attention_fn=attention_fn,
                            replicas=replicas, shifts=shifts, weights=weights,
                            gather_once=gather_once)
  return loss, grads


def pipeline_loss(cfg: transformer.TransformerConfig, schedule: Schedule, layout: Layout, params,
                  batch: Batch, *, mesh, attention_fn: Callable | None = None,
                  gather_once: bool = False) -> jax.Array:
  """The summed token loss of `batch`, forward only (evaluation), by `schedule.forward_only()`."""
  loss, _, _ = execute(cfg, schedule.forward_only(), layout, params, batch, mesh=mesh,
                        train=False, vocab_algorithm=1, attention_fn=attention_fn,
                        gather_once=gather_once)
  return loss[0]


def execute(cfg, schedule: Schedule, layout: Layout, params, batch: Batch, *, mesh, train: bool,
             vocab_algorithm: int, attention_fn, replicas: int = 1, shifts=None, weights=None,
             gather_once: bool = False, fused: bool | None = None):
  """Runs `schedule`'s ticks (`fused` as in pipeline_loss_and_grads); without `train` only
  forwards and the head's loss: (loss sums [R], gradients, counts [stages, KINDS]).

  Loss sums come back as a vector over the replicas whose rows they are ([1] for one
  pipeline). `replicas` > 1: params carry a leading [R] dim, the `replica` axis is manual.
  """
  _, attention_fn = transformer.default_inputs(cfg, batch["inputs"], None, attention_fn)
  mbs = microbatches_by_replica(batch, replicas, schedule.microbatches)  # [R, M, Bm, T]
  plan = _Plan.of(cfg, schedule, layout, mesh, train=train, replicas=replicas,
                  routed=shifts is not None, scaled=weights is not None,
                  rows_per_microbatch=mbs["inputs"].shape[2], gather_once=gather_once,
                  fused=fused)
  vl = VocabLayers(cfg, layout, vocab_algorithm, mesh, schedule.head_stage)
  chunk = Chunk(cfg, attention_fn)
  R = replicas
  offsets = (routing.offsets(jnp.asarray(shifts, jnp.int32), R) if plan.routed
             else jnp.zeros((0, 0), jnp.int32))  # a fixed route needs none
  weights = jnp.ones((R,), jnp.float32) if weights is None else jnp.asarray(weights, jnp.float32)

  def per_stage(params, mbs, offsets, weights):
    return _Stage(plan, chunk, vl, params, mbs, offsets, weights).run()

  specs = param_specs(layout, params, R > 1, plan.gathered)
  mbs_spec = P(routing.AXIS if R > 1 and not plan.routed else None, None,
               plan.rows or None)  # [R, M, Bm, T]
  fn = jax.shard_map(per_stage, mesh=mesh, in_specs=(specs, mbs_spec, P(), P()),
                     out_specs=(P(), specs if train else None, P(AXIS)),
                     axis_names={AXIS} | ({routing.AXIS} if R > 1 else set()) | set(plan.rows),
                     # Per-stage branches mix stage-varying and uniform values everywhere;
                     # the executor's collectives are explicit, none is differentiated.
                     check_vma=False)
  return fn(params, mbs, offsets, weights)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What the executor fixes before it traces a stage: the mode, the axes it splits by
  hand, the tick tables and the branches of the tick's switch."""
  cfg: transformer.TransformerConfig
  layout: Layout
  ticks: schedules.Ticks
  train: bool
  R: int  # replicas (the `replica` axis manual when > 1)
  routed: bool  # microbatches change replica between chunks (`shifts`)
  scaled: bool  # per-replica loss weights
  # With the sequence split over a `context` axis, attention (a ring) runs collectives
  # inside a chunk; a collective inside a branch that differs between stages (one stage's
  # forward, its neighbour's backward) never gathers all its participants on XLA (a crash
  # on XLA:CPU), so then every stage runs the forward and the backward each tick and keeps
  # the one its schedule says ("uniform ticks": correct, at up to twice a tick's compute).
  uniform_ticks: bool
  data: str | None  # the data axis, when split by hand
  gathered: Any  # each parameter's fsdp dim when the weights are gathered once, else None
  rows: tuple[str, ...]  # the manual axes a microbatch's rows divide over
  extra: tuple[str, ...]  # arrival tables beside act_recv / grad_recv that the ticks use
  tables: dict  # per-stage tables: LANE_FIELDS, the arrivals, "branch"
  tick_tables: dict  # TICK_FIELDS
  lanes: tuple  # (lane, the kinds it runs), lanes that run something
  combos: tuple  # the switch's branches: one action kind per lane
  head_stage: int
  chunk_of: Any  # [virtual, stages]: the chunk each stage runs in each virtual row
  moves: tuple  # per virtual row: its (source, destination) stage pairs, None: stays
  split: bool  # backward split into input and weight passes
  vocab_passes: bool  # training with VP: the head in S and T passes
  in_turn: bool  # VP on XLA:CPU: the vocabulary conditionals and the sends run one at a time
  overlap: bool  # vocab_overlap: those passes on ticks of their own, beside the lanes

  @property
  def stages(self) -> int:
    return self.layout.stages

  @property
  def chunks(self) -> int:
    return self.layout.chunks

  @staticmethod
  def of(cfg, schedule: Schedule, layout: Layout, mesh, *, train: bool, replicas: int,
         routed: bool, scaled: bool, rows_per_microbatch: int, gather_once: bool,
         fused: bool | None) -> "_Plan":
    degrees = mesh_lib.degrees(mesh)
    # `data` is manual too where each microbatch's rows divide over it: each data shard
    # sums its own gradients over the ticks and they are all-reduced once, after the last
    # tick. Left automatic, XLA all-reduces the gradients of every backward and every head
    # (m times a step) inside the ticks' branches.
    data = DATA_AXIS if degrees.data > 1 and rows_per_microbatch % degrees.data == 0 else None
    # Gathered once, `fsdp` is manual like `data`: each device runs its own rows on the
    # whole stage's weights and sums its own gradients; left automatic, XLA gathers each
    # chunk's weights and reduces its gradients inside every tick that runs it.
    # XLA's SPMD partitioner aborts the process (a CHECK in spmd_partitioner_util.cc, no
    # error) partitioning a stage's program where `fsdp` is automatic beside `tensor`, or
    # beside `context` with vocabulary parallelism: gathered once (fsdp manual), it compiles.
    forced = degrees.fsdp > 1 and (degrees.tensor > 1 or (
        degrees.context > 1 and layout.vocab_parallel))
    gathered = (fsdp_dims(cfg, layout, mesh) if (gather_once or forced) and degrees.fsdp > 1
                else None)
    if gathered is not None and rows_per_microbatch % (
        degrees.fsdp * (degrees.data if data else 1)):
      why = ("gather_once" if gather_once else
             "a pipeline over fsdp with tensor or context (its weights gathered once)")
      raise ValueError(f"{why}: a microbatch's {rows_per_microbatch} rows do not divide "
                       f"over fsdp={degrees.fsdp}" + (f" x data={degrees.data}" if data else ""))
    ticks = schedule.executed if fused is None else (schedule.fused if fused else schedule.unfused)
    # Arrivals other than the usual ring direction (a V's way back up, its turn on a
    # stage): their permutes exist only where the schedule sends that way.
    extra = tuple(k for k in ("act_recv_back", "act_recv_self", "grad_recv_back",
                              "grad_recv_self")
                  if np.any(getattr(ticks, k) >= 0) and (train or k.startswith("act")))
    if routed and extra:
      raise ValueError(f"pipeline.schedule={schedule.name} sends between stages other than "
                       f"s -> s + 1 (a V); routed replicas take loop schedules only (gpipe, "
                       f"1f1b, interleaved_1f1b, zb_h1)")
    if (schedule.stages, schedule.virtual_stages) != (layout.stages, layout.virtual):
      raise ValueError(f"the schedule has {schedule.stages} stages x "
                       f"{schedule.virtual_stages} virtual, the layout {layout.stages} x "
                       f"{layout.virtual}: build both from the same mesh and "
                       f"pipeline.virtual_stages")
    overlap = train and schedule.vocab_overlap
    if overlap and not layout.vocab_parallel:
      raise ValueError("pipeline.vocab_overlap=True is invalid with "
                       "pipeline.vocab_parallel=False; it places vocabulary parallelism's S "
                       "and T passes")
    tables = {k: jnp.asarray(getattr(ticks, k)) for k in (
        *schedules.LANE_FIELDS, "act_recv", "grad_recv", *extra)}
    # The kinds each lane runs (a lane that never runs anything is left out), and the
    # combinations of one kind a lane (fused: a backward-type action and a forward) that
    # stages run in a tick: one switch branch each.
    lanes = tuple((lane, ticks.lane_kinds(lane)) for lane in range(ticks.lanes)
                  if ticks.lane_kinds(lane))
    kind = ticks.kind[:, [lane for lane, _ in lanes], :].transpose(0, 2, 1)  # [ticks, stages, lanes]
    combos, branch = np.unique(kind.reshape(-1, len(lanes)), axis=0, return_inverse=True)
    tables["branch"] = jnp.asarray(branch.reshape(kind.shape[:2]).astype(np.int32))
    chunk_of = np.asarray(schedule.chunk_of)
    p = layout.stages
    assert all(int(g) // p == v for v, row in enumerate(chunk_of) for g in row), chunk_of
    return _Plan(
        cfg=cfg, layout=layout, ticks=ticks, train=train, R=replicas, routed=routed,
        scaled=scaled, uniform_ticks=degrees.context > 1, data=data, gathered=gathered,
        rows=tuple(a for a in (data, FSDP_AXIS if gathered is not None else None) if a),
        extra=extra, tables=tables,
        tick_tables={k: jnp.asarray(getattr(ticks, k)) for k in schedules.TICK_FIELDS},
        lanes=lanes, combos=tuple(tuple(int(k) for k in combo) for combo in combos),
        head_stage=schedule.head_stage, chunk_of=jnp.asarray(chunk_of),
        # The layout keeps chunk v * p + s at [v, s] (a loop); a schedule that places
        # chunks otherwise (a V: chunk 2p - 1 - s on stage s) gets its chunks by one
        # ppermute per virtual row before the ticks, and the gradients sent back after
        # them: that row's weights and gradients cross the stage axis once a step each.
        moves=tuple(tuple((int(g) % p, s) for s, g in enumerate(row)) if moved else None
                    for row, moved in zip(chunk_of, _moved_rows(chunk_of))),
        split=schedule.split_backward,
        # Training with VP splits the head into S and T passes on consecutive ticks
        # (schedules.py), or with vocab_overlap on ticks of their own beside the lanes.
        vocab_passes=train and layout.vocab_parallel, overlap=overlap,
        in_turn=layout.vocab_parallel and mesh.devices.flat[0].platform == "cpu")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Carry:
  """What a stage's tick hands the next (None: a field its mode has no use for). A tick
  works on its own copy, assigning fields as it goes."""
  act_inbox: Any  # activations waiting for a forward, a slot each (+1: the trash slot)
  arrive_f: Any  # what the ring's forward permute brought from stage s - 1
  send_f: Any  # what goes on to stage s + 1: the last forward's output
  x0: Any  # the embedding of the microbatch that starts on this stage
  head_in: Any  # the last chunk's output: the head's input
  loss: Any  # [R] loss sums, by the replica whose rows they are
  counts: Any  # [KINDS]: idle ticks and actions run
  grad_inbox: Any = None  # training: output gradients waiting for a backward
  residuals: Any = None  # the forwards' residuals, a slot per microbatch in flight
  arrive_b: Any = None  # what the ring's backward permute brought from stage s + 1
  send_b: Any = None  # what goes back to stage s - 1: the last backward's input gradient
  dx0: Any = None  # the first chunk's input gradient: the embedding's output gradient
  layer_grads: Any = None
  vocab_grads: Any = None
  stash: Any = None  # split backward: what B hands W, beside the output gradient it keeps
  vocab_s: Any = None  # VP: what the S pass hands the next tick's T pass
  vocab_dh: Any = None  # vocab_overlap: the T pass's d loss / d h, for the next tick
  arrive_f_back: Any = None  # a V's way back: from stage s + 1
  arrive_b_back: Any = None  # and from stage s - 1
  turn: Any = None  # in_turn: how many of those ran this step (the next one waits for it)


class _Stage:
  """One stage's program inside the executor's shard_map: its parameters and microbatches,
  the tick the scan runs, and the sums it returns."""

  def __init__(self, plan: _Plan, chunk: Chunk, vl: "VocabLayers", params, mbs, offsets,
               weights):
    self.plan, self.chunk, self.vl = plan, chunk, vl
    self.mbs, self.weights = mbs, weights
    self.stage = jax.lax.axis_index(AXIS)
    replica = jax.lax.axis_index(routing.AXIS) if plan.R > 1 else 0
    self.transport = (transport.Routed(plan.stages, replica, offsets, plan.R) if plan.routed
                      else transport.Ring(plan.stages, replica))
    if plan.R > 1:
      params = jax.tree.map(lambda x: x[0], params)
    if plan.gathered is not None:
      params = jax.tree.map(lambda x, d: x if d < 0 else jax.lax.all_gather(
          x, FSDP_AXIS, axis=d, tiled=True), params, plan.gathered)
    layers = jax.tree.map(lambda x: x[:, 0], params["layers"])  # [virtual, chunk, ...]
    self.layers = move_rows(layers, plan.moves)
    self.vocab_params = {k: v for k, v in params.items() if k != "layers"}
    Bm, T = mbs["inputs"].shape[2:]
    self.act = jax.ShapeDtypeStruct((Bm, T, plan.cfg.d_model), jnp.dtype(plan.cfg.dtype))
    if plan.train:
      one = take(self.layers, 0)
      self.res_shapes = chunk.residual_shapes(one, self.act, self.microbatch(0, 0))
      self.chunk_shapes = jax.eval_shape(lambda: one)
      if plan.split:
        self.stash_shapes = chunk.stash_shapes(one, self.res_shapes, self.act,
                                               self.microbatch(0, 0))
    if plan.vocab_passes:
      self.vocab_s_shapes = jax.eval_shape(
          lambda y: vl.head_s(self.vocab_params, y, self.microbatch(0, plan.chunks - 1)),
          self.act)

  def microbatch(self, mb_index, g):
    return self.transport.rows(self.mbs, mb_index, g)

  # The loop.

  def run(self):
    """(loss sums [R], gradients or None, counts [1, KINDS]) after every tick."""
    plan = self.plan
    c, _ = jax.lax.scan(self.tick, self.initial_carry(), {**plan.tables, **plan.tick_tables})
    # Replicated head: only the last stage added loss; parallel: every stage holds the total.
    loss = c.loss if plan.layout.vocab_parallel else jax.lax.psum(c.loss, AXIS)
    if plan.rows:
      loss = jax.lax.psum(loss, plan.rows)
    if plan.R > 1:  # each replica's head added the losses of the rows it met
      loss = jax.lax.psum(loss, routing.AXIS)
    if not plan.train:
      return loss, None, c.counts[None]
    layer_grads = jax.tree.map(lambda x: x[:, None],
                               move_rows(c.layer_grads, plan.moves, back=True))
    vocab_grads = {k: (v if plan.layout.vocab_parallel and k in VOCAB_PARAMS
                       else jax.lax.psum(v, AXIS)) for k, v in c.vocab_grads.items()}
    grads = {**vocab_grads, "layers": layer_grads}
    if plan.data:
      grads = jax.lax.psum(grads, plan.data)
    if plan.gathered is not None:  # each device keeps its own shard of the sum
      grads = jax.tree.map(lambda g, d: jax.lax.psum(g, FSDP_AXIS) if d < 0 else
                           jax.lax.psum_scatter(g, FSDP_AXIS, scatter_dimension=d, tiled=True),
                           grads, plan.gathered)
    if plan.R > 1:
      grads = jax.tree.map(lambda x: x[None], grads)
    return loss, grads, c.counts[None]

  def initial_carry(self) -> _Carry:
    plan, act = self.plan, self.act
    extra = plan.extra

    def buffer(n, like, trash: bool = True):
      # +1: the trash slot, which a write that is not goes to (so it needs no branch)
      return jnp.zeros((n + trash, *like.shape), like.dtype)
    zero_act = jnp.zeros(act.shape, act.dtype)
    c = _Carry(act_inbox=buffer(plan.ticks.act_slots, act), arrive_f=zero_act,
               send_f=zero_act, x0=zero_act, head_in=zero_act,
               loss=jnp.zeros((plan.R,), jnp.float32), counts=jnp.zeros((KINDS,), jnp.int32))
    if plan.train:
      c.grad_inbox = buffer(plan.ticks.grad_slots, act)
      c.residuals = [buffer(plan.ticks.res_slots, r, trash=False) for r in self.res_shapes]
      c.arrive_b, c.send_b, c.dx0 = zero_act, zero_act, zero_act
      c.layer_grads = jax.tree.map(jnp.zeros_like, self.layers)
      c.vocab_grads = jax.tree.map(jnp.zeros_like, self.vocab_params)
      if plan.split:
        c.stash = [buffer(plan.ticks.grad_slots, s, trash=False) for s in self.stash_shapes]
    if plan.in_turn:
      c.turn = jnp.zeros((), jnp.int32)
    if plan.vocab_passes:
      c.vocab_s = _zeros_of(self.vocab_s_shapes)
    if plan.overlap:
      c.vocab_dh = {"dh": zero_act, "y": zero_act, "mb": jnp.zeros((), jnp.int32)}
    if "act_recv_back" in extra:
      c.arrive_f_back = zero_act
    if "grad_recv_back" in extra:
      c.arrive_b_back = zero_act
    return c

  def tick(self, c: _Carry, rows):
    plan, vl, vocab_params = self.plan, self.vl, self.vocab_params
    mine = {k: rows[k][..., self.stage] for k in plan.tables}  # a lane table gives [lanes]
    c = dataclasses.replace(c)
    self.arrive(c, mine)
    if plan.overlap:  # the passes beside the lanes: nothing this tick computes reads their
      # all-reduces' results, which reach the next tick (dy the one after the T pass's)
      self.head_dy_arrives(c, rows["vocab_dy_slot"])
      vocab_s = self.s_pass(c, rows["vocab_s_microbatch"])  # before the lanes rewrite head_in
      self.t_pass_alone(c, rows["vocab_t_microbatch"])
      c.vocab_s = vocab_s
    elif plan.vocab_passes:  # the T pass of the last tick's S pass, before the lanes read dy
      self.add_head(c, rows["vocab_t_microbatch"], rows["vocab_t_slot"],
                    functools.partial(vl.head_t, vocab_params), c.vocab_s)
    emb_mb = rows["embed_microbatch"]
    c.x0 = self.in_turn(c)(
        emb_mb >= 0,
        lambda x0: vl.embed(vocab_params, self.microbatch(emb_mb, 0)["inputs"], self.stage),
        lambda x0: x0, c.x0)
    at = self.compute(c, mine)
    c.counts = c.counts.at[IDLE].add(jnp.all(mine["kind"] == IDLE).astype(jnp.int32))
    if plan.vocab_passes and not plan.overlap:  # the S pass: its all-reduce goes to the next tick
      c.vocab_s = self.s_pass(c, rows["vocab_s_microbatch"])
    elif not plan.vocab_passes:
      self.add_head(c, rows["head_microbatch"], rows["head_slot"],
                    functools.partial(vl.head if plan.train else vl.loss, vocab_params),
                    c.head_in)
    c.arrive_f, c.arrive_f_back = self.send(c, c.send_f, at.get("forward"), +1,
                                            c.arrive_f_back is not None)
    if plan.train:
      emb_grad_mb = rows["embed_grad_microbatch"]
      _, embedding = _accumulate(emb_grad_mb >= 0, lambda dx0, acc: ({}, acc + vl.embed_grad(
          vocab_params, dx0, self.microbatch(emb_grad_mb, 0)["inputs"], self.stage)), c.dx0,
                                 c.vocab_grads["embedding"], self.in_turn(c))
      c.vocab_grads = dict(c.vocab_grads, embedding=embedding)
      c.arrive_b, c.arrive_b_back = self.send(c, c.send_b, at.get("backward"), -1,
                                              c.arrive_b_back is not None)
    return c, None

  # Messages between stages.

  def arrive(self, c: _Carry, mine):
    """Arrivals into the inboxes: from the ring neighbour, the other neighbour, and this
    stage's own last send (a V's turn: send_f / send_b still hold what the previous tick
    sent)."""
    def into(inbox, slots, arrivals):
      for table, value in arrivals:
        if table in mine:
          inbox = _put(inbox, _trash(mine[table], slots), value)
      return inbox
    t = self.plan.ticks
    c.act_inbox = into(c.act_inbox, t.act_slots, (
        ("act_recv", c.arrive_f), ("act_recv_back", c.arrive_f_back), ("act_recv_self", c.send_f)))
    if c.grad_inbox is not None:
      c.grad_inbox = into(c.grad_inbox, t.grad_slots, (
          ("grad_recv", c.arrive_b), ("grad_recv_back", c.arrive_b_back),
          ("grad_recv_self", c.send_b)))

  def send(self, c: _Carry, value, sent, step: int, both_ways: bool):
    """`value` to the stage `step` on (+1: activations, -1: gradients) and, where the
    schedule sends both ways, to the one `step` back: (arrival, other arrival or None), by
    the transport (`sent`: the lane's (kind, microbatch, chunk)). In turn with the
    vocabulary conditionals where those are (a conditional that always runs): its permutes
    share their channel with every other send's."""
    move = lambda value: self.transport.send(value, sent, step, both_ways)
    if c.turn is None:
      return move(value)
    nothing = lambda v: (jnp.zeros_like(v), jnp.zeros_like(v) if both_ways else None)
    return self.in_turn(c)(jnp.bool_(True), move, nothing, value)

  # The lanes' actions.

  def compute(self, c: _Carry, mine):
    """Every lane's action: reads, one switch over the action combinations the ticks
    hold, writes; returns the sends' (kind, microbatch, chunk). With a switch a lane, XLA
    copied every residual buffer twice a tick (one lane's reads and the next one's writes
    unordered); here all reads come first."""
    plan = self.plan
    lane_mine = [{k: mine[k][lane] for k in schedules.LANE_FIELDS} for lane, _ in plan.lanes]
    ops = [self.read(c, kinds, m) for (_, kinds), m in zip(plan.lanes, lane_mine)]
    if plan.uniform_ticks:  # every stage runs every action; the schedule's one is kept
      out = []
      for (_, kinds), m, o in zip(plan.lanes, lane_mine, ops):
        outcomes = [{**self.idle(kinds), **self.action(k, o)} for k in kinds]
        out.append(jax.tree.map(lambda none, *new, kind=m["kind"]: functools.reduce(
            lambda acc, kn: jnp.where(kind == kn[0], kn[1], acc), zip(kinds, new), none),
            self.idle(kinds), *outcomes))
    else:
      out = jax.lax.switch(mine["branch"], [self.run_combo(combo) for combo in plan.combos],
                           ops)
    at = {}
    for (_, kinds), m, o in zip(plan.lanes, lane_mine, out):
      self.write(c, kinds, m, o, at)
    return at

  def read(self, c: _Carry, kinds, mine):
    """A lane's operands: its microbatch and input, and the buffers its actions read
    whole, with their slots: an action slices its chunk's weights, residuals and stash
    inside its branch, so a tick copies only what runs (a slice taken out here is copied
    every tick: a residual slot is 10 MiB at d 256, 2 layers, 128 tokens). Nothing is
    passed through: a conditional that passes the loop's buffers through copies all of
    them every tick (109-190 MiB a tick at d 256)."""
    virtual = jnp.maximum(mine["virtual"], 0)
    g = self.plan.chunk_of[virtual, self.stage]
    ops = {"layers": self.layers, "virtual": virtual,
           "mb": self.microbatch(jnp.maximum(mine["microbatch"], 0), g)}
    if FORWARD in kinds:
      ops["x"] = jnp.where(g == 0, c.x0, take(c.act_inbox, mine["act_in"]))
    if _backwards(kinds):
      ops.update(residuals=c.residuals, res_slot=mine["res_slot"],
                 dy=take(c.grad_inbox, mine["grad_in"]))
    if BACKWARD_WEIGHT in kinds:
      ops.update(stash=c.stash, stash_slot=mine["grad_in"])
    return ops

  def action(self, kind, o):
    """The results of one action of `kind` on a lane's operands `o`."""
    chunk, params = self.chunk, take(o["layers"], o["virtual"])
    res = lambda: take(o["residuals"], o["res_slot"])
    if kind == FORWARD:
      if self.plan.train:
        y, kept = chunk.forward(params, o["x"], o["mb"])
        return {"y": y, "res": kept}
      return {"y": chunk.apply(params, o["x"], o["mb"])}
    if kind == BACKWARD:
      dparams, dx = chunk.backward(params, res(), o["dy"], o["mb"])
      return {"dparams": dparams, "dx": dx}
    if kind == BACKWARD_INPUT:
      dx, dparams, stash = chunk.backward_input(params, res(), o["dy"], o["mb"])
      return {"dx": dx, "dparams": dparams, "stash": stash}
    assert kind == BACKWARD_WEIGHT, kind
    return {"dparams": chunk.backward_weight(params, res(), o["dy"],
                                             take(o["stash"], o["stash_slot"]), o["mb"])}

  def idle(self, kinds):
    """A lane's results when it idles, shaped without tracing the actions again (their
    vjps dominate the executor's tracing time)."""
    shapes = {}
    if FORWARD in kinds:
      shapes.update(y=self.act, **({"res": self.res_shapes} if self.plan.train else {}))
    if any(k in kinds for k in _SENDS_GRAD):
      shapes["dx"] = self.act
    if BACKWARD_INPUT in kinds:
      shapes["stash"] = self.stash_shapes
    if _backwards(kinds):
      shapes["dparams"] = self.chunk_shapes
    return _zeros_of(shapes)

  def run_combo(self, combo):
    """The branch that runs one action per lane (`combo`, IDLE: none), lanes in order."""
    return lambda ops: [{**self.idle(kinds), **(self.action(k, o) if k != IDLE else {})}
                        for (_, kinds), k, o in zip(self.plan.lanes, combo, ops)]

  def write(self, c: _Carry, kinds, mine, out, at):
    """A lane's results into the loop's buffers and sends; `at` keeps (sent kind,
    microbatch, chunk) of the lane whose forward or input gradient goes out."""
    kind, virtual = mine["kind"], jnp.maximum(mine["virtual"], 0)
    g, mb_index = self.plan.chunk_of[virtual, self.stage], jnp.maximum(mine["microbatch"], 0)
    c.counts = c.counts.at[kind].add((kind != IDLE).astype(jnp.int32))
    if FORWARD in kinds:
      is_f = kind == FORWARD
      at["forward"] = (jnp.where(is_f, FORWARD, IDLE), mb_index, g)
      c.send_f = jnp.where(is_f, out["y"], c.send_f)
      c.head_in = jnp.where(is_f & (g == self.plan.chunks - 1), out["y"], c.head_in)
      if self.plan.train:
        c.residuals = _put_if(is_f, c.residuals, mine["res_slot"], out["res"])
    if any(k in kinds for k in _SENDS_GRAD):
      is_b = (kind == BACKWARD) | (kind == BACKWARD_INPUT)
      at["backward"] = (jnp.where(is_b, BACKWARD, IDLE), mb_index, g)
      c.send_b = jnp.where(is_b, out["dx"], c.send_b)
      c.dx0 = jnp.where(is_b & (g == 0), out["dx"], c.dx0)
    if _backwards(kinds):  # added by a two-way conditional of its own: XLA copies a
      # buffer that a switch of three or more branches carries twice a tick (8 MiB a tick
      # for a 2-layer chunk at d 256), and updates it in place in a two-way conditional
      add = lambda dparams, acc: ({}, jax.tree.map(
          lambda a, g: a.at[virtual].add(g), acc, dparams))
      _, c.layer_grads = _accumulate((kind != IDLE) & (kind != FORWARD), add,
                                     out["dparams"], c.layer_grads)
    if BACKWARD_INPUT in kinds:
      c.stash = _put_if(kind == BACKWARD_INPUT, c.stash, mine["grad_in"], out["stash"])

  # The head.

  def weighed(self, mb_index, grads, dy=None):
    """The head's gradients (and d y) of microbatch `mb_index`'s loss times its replica's
    weight (unscaled without weights)."""
    if not self.plan.scaled:
      return grads, dy
    w = self.weights[self.transport.origin(mb_index, self.plan.chunks - 1)]
    return (jax.tree.map(lambda d: d * w, grads),
            None if dy is None else (dy * w).astype(dy.dtype))

  def loss_row(self, mb_index, value):
    """A microbatch's loss sum, counted for the replica it started on."""
    return jnp.zeros((self.plan.R,), jnp.float32).at[
        self.transport.origin(mb_index, self.plan.chunks - 1)].add(value)

  def to_head_inbox(self, c: _Carry, slot, dy):
    """d y written to the head stage's gradient-inbox `slot` (-1: nothing written)."""
    c.grad_inbox = _put(c.grad_inbox, _trash(jnp.where(self.stage == self.plan.head_stage,
                                                       slot, -1), self.plan.ticks.grad_slots), dy)

  def add_head(self, c: _Carry, head_mb, slot, fn, x):
    """Adds the head's results for microbatch `head_mb` (-1: none): fn(x, mb, stage) is its
    loss sum or, in training, (loss sum, d loss / d y, head gradients), d y then written
    to the head stage's gradient-inbox `slot`."""
    train = self.plan.train

    def head(x, acc):
      mb = self.microbatch(head_mb, self.plan.chunks - 1)
      if not train:
        return {"loss": self.loss_row(head_mb, fn(x, mb, self.stage))}, acc
      value, dy, dhp = fn(x, mb, self.stage)
      dhp, dy = self.weighed(head_mb, dhp, dy)
      return {"loss": self.loss_row(head_mb, value), "dy": dy}, _plus(acc, dhp)
    out, vocab_grads = _accumulate(head_mb >= 0, head, x,
                                   {} if c.vocab_grads is None else c.vocab_grads,
                                   self.in_turn(c))
    c.loss = c.loss + out["loss"]
    if train:
      c.vocab_grads = vocab_grads
      self.to_head_inbox(c, jnp.where(head_mb >= 0, slot, -1), out["dy"])

  def head_dy_arrives(self, c: _Carry, slot):
    """vocab_overlap: the last tick's T pass's d loss / d h, through the final norm's
    backward, into the head stage's gradient-inbox `slot` (-1: none arrives)."""
    def arrive(pending, acc):
      dy, dnorm = self.vl.head_dy(self.vocab_params, pending["y"], pending["dh"], self.stage)
      dnorm, dy = self.weighed(pending["mb"], dnorm, dy)
      return {"dy": dy}, _plus(acc, dnorm)
    out, c.vocab_grads = _accumulate(slot >= 0, arrive, c.vocab_dh, c.vocab_grads,
                                     self.in_turn(c))
    self.to_head_inbox(c, slot, out["dy"])

  def t_pass_alone(self, c: _Carry, t_mb):
    """vocab_overlap: the T pass of microbatch `t_mb` (-1: none) on the carried S pass:
    loss and output-weight gradient added, d loss / d h carried to the next tick."""
    def t_pass(carried, acc):
      value, dh, dw = self.vl.head_t_pass(self.vocab_params, carried,
                                          self.microbatch(t_mb, self.plan.chunks - 1))
      dw, _ = self.weighed(t_mb, dw)
      return {"loss": self.loss_row(t_mb, value), "dh": dh}, _plus(acc, dw)
    out, c.vocab_grads = _accumulate(t_mb >= 0, t_pass, c.vocab_s, c.vocab_grads,
                                     self.in_turn(c))
    c.loss = c.loss + out["loss"]
    c.vocab_dh = {"dh": out["dh"].astype(self.act.dtype), "y": c.vocab_s["y"], "mb": t_mb}

  def s_pass(self, c: _Carry, s_mb):
    """The S pass of microbatch `s_mb` (-1: none) on the head's last output: what the next
    tick's T pass reads."""
    return self.in_turn(c)(
        s_mb >= 0, lambda y: self.vl.head_s(self.vocab_params, y,
                                               self.microbatch(s_mb, self.plan.chunks - 1)),
        lambda y: _zeros_of(self.vocab_s_shapes), c.head_in)

  def in_turn(self, c: _Carry):
    """A lax.cond that, on XLA:CPU, starts once the last one in_turn gave is done.

    With VP these conditionals hold collectives, and shard_map gives every collective the
    same channel. XLA:CPU starts a device's independent conditionals at once, so devices
    could meet in different ones' all-reduces: wrong sums, or a rendezvous abort (seen in
    CI, a 1F1B VP run). A count threaded through them orders them: each predicate reads
    the last one's, which only its end gives.
    """
    def cond(pred, fn, skip, *operands):
      if c.turn is None:
        return jax.lax.cond(pred, fn, skip, *operands)
      counted = lambda f: lambda turn, *xs: (f(*xs), turn + 1)
      pred = pred & (c.turn >= 0)  # pred itself, but only known once the last one is done
      out, c.turn = jax.lax.cond(pred, counted(fn), counted(skip), c.turn, *operands)
      return out
    return cond


def _plus(acc, grads):
  """The vocabulary layers' gradient sums `acc` with `grads` (some of them) added."""
  return {k: v + grads[k] if k in grads else v for k, v in acc.items()}


def _moved_rows(chunk_of) -> list[bool]:
  """Whether each virtual row of a schedule's `chunk_of` sits off the layout's loop (chunk
  v * p + s on stage s), so the executor moves it."""
  p = chunk_of.shape[1]
  return [not np.array_equal(row, np.arange(v * p, (v + 1) * p))
          for v, row in enumerate(chunk_of)]


def rows_moved(schedule: schedules.Schedule) -> int:
  """How many virtual rows of chunks a step moves across `stage`: their weights there
  before the ticks, their gradients back after them (a V's second row: one chunk's
  weights each way a step on every stage)."""
  return sum(_moved_rows(np.asarray(schedule.chunk_of)))


def move_rows(layers, moves, back: bool = False):
  """Each virtual row of `layers` ([virtual, ...] on every stage) moved across `stage` by
  its (source, destination) pairs (None: stays); `back` moves it home."""
  rows = []
  for v, pairs in enumerate(moves):
    row = jax.tree.map(lambda x: x[v], layers)
    if pairs is not None:
      perm = [(d, s) for s, d in pairs] if back else pairs
      row = jax.tree.map(lambda x: jax.lax.ppermute(x, AXIS, perm), row)
    rows.append(row)
  if all(m is None for m in moves):
    return layers
  return jax.tree.map(lambda *xs: jnp.stack(xs), *rows)


def _put(tree, i, value):
  return jax.tree.map(lambda x, v: jax.lax.dynamic_update_index_in_dim(x, v, i, 0), tree, value)


def _put_if(pred, tree, i, value):
  """`value` into slot i of `tree` where `pred`, else `tree` as it is: a two-way
  conditional updates the loop's buffer in place, with no spare slot to write to when
  nothing is (a 10 MiB residual slot at d 256, 2 layers, 128 tokens)."""
  return jax.lax.cond(pred, lambda t, v: _put(t, i, v), lambda t, v: t, tree, value)


def _zeros_of(shapes):
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _backwards(kinds) -> bool:
  """Whether a lane running `kinds` runs any backward-type action."""
  return any(k != FORWARD for k in kinds)


def _accumulate(pred, fn, x, acc, cond=jax.lax.cond):
  """fn(x, acc) -> (results, acc + what fn adds) where pred, else (zeros, acc): the sum is
  made inside the conditional, so a tick that adds nothing adds no zeros (issue 28: the
  vocabulary layers' zero gradients added every tick were 64 MiB a tick at d 256)."""
  skip = lambda x, acc: (_zeros_of(jax.eval_shape(fn, x, acc)[0]), acc)
  return cond(pred, fn, skip, x, acc)


def _trash(slot, size: int):
  """Slot -1 (nothing to write) goes to the extra last entry, so writes need no branch."""
  return jnp.where(slot < 0, size, slot)
