"""Pipeline and vocabulary parallelism measured on devices: bubbles, FLOPs, memory, balance.

The library of `experiments/bench_pipeline.py` and `colab/pipeline.ipynb`; `run` measures
the parts and `tables` prints them:

1. Schedules (every one of `schedules.SCHEDULES`: gpipe, 1f1b, eager_1f1b,
   interleaved_1f1b with 2 virtual stages, and the zero-bubble zb_h1 and zbv, the V with 2
   chunks a stage; --schedules picks them) on meshes
   stage=p, data=8/p, for every p in --stages and m in --microbatches: the schedule's
   bubble in ticks (idle stage-ticks / all stage-ticks of its table, every action one tick),
   its TIMED bubbles (`schedules.timed`: idle time / stages x makespan, run asynchronously
   and in the executor's lock step, in the ticks it runs (`schedule.executed`: fused or
   the table's; both lock steps are in the JSON), with backward / forward, and the
   zero-bubble input- and weight-gradient passes' / forward, = the chunk programs' FLOP
   ratios below; not wall time), and layer FLOPs executed per device over useful layer
   FLOPs. The executed action counts (`pipeline_loss_and_grads(..., with_counts=True)`)
   only re-count the ticks, so they serve the FLOPs and a check, not a bubble. XLA's
   `cost_analysis` counts a while loop's body ONCE (whatever the trip count) and a
   conditional as its costliest branch, so the whole pipelined program's number says
   nothing about executed work (it is recorded as `xla_whole_program_flops`). Instead the
   chunk forward and backward (the executor's own `chunk.Chunk`) are compiled on their own for
   their per-call FLOPs and multiplied by the executed counts; useful = the cost analysis
   of the unpipelined forward + backward of all layers on the same per-device rows, divided
   by p. Each device gets one row per microbatch (a microbatch is 8/p rows split over
   data). MaxText's GPipe computes through the bubble; its ratio would be (m + p - 1) / m.
2. Memory at p=4 (stage=4, data=2), fixed microbatch size: compiled temp bytes per device of
   loss + gradients per schedule, the residual buffer the executor keeps for the backward
   (res_slots of the ticks it runs, schedule.executed, x one slot's residual bytes), and for
   the zero-bubble schedules the
   output gradients and stashes held from B to W.
3. Vocabulary layers at p=4 (stage=4, data=2): per-device parameter + AdamW bytes of the
   stage-view train state on each stage's devices (abstract: jax.eval_shape, each leaf's
   slice there from its sharding, nothing allocated) with vocabulary parallelism (VP) and
   without, and the MPMD placement
   (embedding on stage 0, output layer on the last stage) computed from the same leaves;
   per-device FLOPs of one microbatch's vocabulary work (VP: `vocab.output_layer` under
   shard_map; replicated: norm + output layer + cross-entropy forward and backward, which
   only the last stage runs) beside one stage's transformer layers.
4. Step CPU work (part `cpu`, timed): process CPU seconds of one jitted loss-and-gradients
   step (median of --cpu_repeats after a warm-up) of gpipe, 1f1b, 1f1b with VP and
   interleaved v=2 at stage=4, data=2, m=8 (d 256, 8 layers, vocabulary 8,192, 16 rows of
   128 tokens), over the unpipelined step's on data=8, in the same process, each in the
   ticks the executor runs (--cpu_both_shapes: also in the other shape, fused or the
   table's). The simulated devices share the cores, so this is all devices' work, not a
   step's time on chips.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsys.bench import log, median_seconds
from jaxsys.configs import tiny_lm
from jaxsys import mesh as mesh_lib
from jaxsys.checkpoint import layouts
from jaxsys.data import packing
from jaxsys.models import transformer
from jaxsys.optim.inner import make_optimizer
from jaxsys.train import config_check
from jaxsys.parallel import pipeline, schedules, vocab
from jaxsys.train import state as state_lib
from jaxsys.train import step as step_lib

SCHEDULES = schedules.SCHEDULES
# Virtual stages each schedule runs with here, and its name in the tables.
VIRTUAL = {"interleaved_1f1b": 2, "zbv": 2}
LABELS = {"gpipe": "GPipe", "1f1b": "1F1B", "eager_1f1b": "eager 1F1B",
          "interleaved_1f1b": "interleaved v=2", "zb_h1": "ZB-H1", "zbv": "ZBV"}
VOCAB_KINDS = ("embedding", "unembedding", "final_norm")


def flops(compiled) -> float:
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  return float(ca.get("flops", 0.0))


def small_model(*, d_model: int = 64, n_layers: int = 16, vocab_size: int = 256,
                n_heads: int = 4, n_kv_heads: int = 2, d_ff: int | None = None,
                ) -> transformer.TransformerConfig:
  return transformer.TransformerConfig(
      vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
      n_kv_heads=n_kv_heads, d_ff=d_ff or 2 * d_model, attention_impl="xla")


def make_mesh(stages: int):
  return mesh_lib.make_mesh(f"stage={stages},data={jax.device_count() // stages}")


def batch(rows: int, seq: int, vocab_size: int, seed: int = 0):
  b = packing.random_packed_batch(rows, seq, docs_per_row=2, vocab_size=vocab_size, seed=seed)
  return {k: jnp.asarray(v) for k, v in b.items()}


def _abstract_batch(rows: int, seq: int):
  i32 = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
  return {"inputs": i32, "targets": i32, "positions": i32, "segment_ids": i32,
          "loss_mask": jax.ShapeDtypeStruct((rows, seq), jnp.float32)}


def _abstract_layers(cfg, n_layers: int):
  cfg = dataclasses.replace(cfg, n_layers=n_layers)
  return jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.key(0)))["layers"]


@functools.lru_cache(maxsize=None)
def chunk_flops(cfg, layers_per_chunk: int, rows: int, seq: int) -> dict[str, float]:
  """Per-call FLOPs of the executor's chunk forward and backward (one device, `rows` rows).

  Compiled for ONE layer and multiplied by the chunk's layers: a chunk deeper than
  transformer.UNROLL_MAX_LAYERS is a `lax.scan`, whose body cost_analysis counts once.
  """
  mb = _abstract_batch(rows, seq)
  _, attention_fn = transformer.default_inputs(cfg, mb["inputs"], None, None)
  chunk = pipeline.chunk.Chunk(cfg, attention_fn)  # the executor's own forward/backward
  x = jax.ShapeDtypeStruct((rows, seq, cfg.d_model), jnp.dtype(cfg.dtype))
  # The residual bytes of one slot are those of the whole chunk (scanned or not).
  res_bytes = sum(int(np.prod(r.shape)) * r.dtype.itemsize
                  for r in chunk.residual_shapes(_abstract_layers(cfg, layers_per_chunk), x, mb))
  params = _abstract_layers(cfg, 1)
  res = chunk.residual_shapes(params, x, mb)
  fwd = jax.jit(chunk.forward).lower(params, x, mb).compile()
  out = {"forward": flops(fwd) * layers_per_chunk, "residual_bytes": res_bytes,
         "activation_bytes": int(np.prod(x.shape)) * x.dtype.itemsize}
  # The whole backward, and the zero-bubble split: B (input gradient and the cotangent
  # chain) and W (weight gradients from B's stash); together the backward's work once.
  stash = chunk.stash_shapes(params, res, x, mb)
  out["stash_bytes"] = layers_per_chunk * sum(int(np.prod(s.shape)) * s.dtype.itemsize
                                              for s in stash)
  for name, args in (("backward", (params, res, x, mb)), ("backward_input", (params, res, x, mb)),
                     ("backward_weight", (params, res, x, stash, mb))):
    program = jax.jit(getattr(chunk, name)).lower(*args).compile()
    out[name] = flops(program) * layers_per_chunk
  return out


@functools.lru_cache(maxsize=None)
def unpipelined_layer_flops(cfg, rows: int, seq: int) -> tuple[float, float]:
  """(forward, forward + backward) FLOPs of all layers, unpipelined, on one device's rows
  (whole batch, plain autodiff; one layer compiled, times n_layers, as in `chunk_flops`)."""
  mb = _abstract_batch(rows, seq)
  _, attention_fn = transformer.default_inputs(cfg, mb["inputs"], None, None)
  params = _abstract_layers(cfg, 1)
  x = jax.ShapeDtypeStruct((rows, seq, cfg.d_model), jnp.dtype(cfg.dtype))

  def loss(params, x, mb):
    y = transformer.apply_layers(cfg, params, x, mb["positions"], mb["segment_ids"], attention_fn)
    return jnp.sum(y)
  fwd = flops(jax.jit(loss).lower(params, x, mb).compile())
  both = flops(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x, mb).compile())
  return cfg.n_layers * fwd, cfg.n_layers * both


def _pipelined_fn(cfg, schedule, layout, mesh, with_counts=True):
  return jax.jit(lambda p, b: pipeline.pipeline_loss_and_grads(
      cfg, schedule, layout, p, b, mesh=mesh, with_counts=with_counts))


def grid(stages_list, microbatches_list, skip=(), names=SCHEDULES
         ) -> list[tuple[str, int, int, int]]:
  """(schedule, p, m, v) of the schedule table, in the order they run."""
  out = []
  for p in stages_list:
    for m in microbatches_list:
      if (p, m) in skip:
        continue
      for name in names:
        v = VIRTUAL.get(name, 1)
        if name != "gpipe" and m < p:
          continue
        if name == "interleaved_1f1b" and m % p:
          continue
        out.append((name, p, m, v))
  return out


def schedule_rows(cfg, stages_list, microbatches_list, *, seq: int, skip=(),
                  names=SCHEDULES) -> list[dict]:
  """Table 1: tick and timed bubbles, executed over useful layer FLOPs per device."""
  rows_out = []
  configs = grid(stages_list, microbatches_list, skip, names)
  chunk_cache, useful_cache = {}, {}
  params = transformer.init_params(cfg, jax.random.key(0))
  for i, (name, p, m, v) in enumerate(configs):
    if cfg.n_layers % (p * v):
      raise ValueError(f"--n_layers={cfg.n_layers} does not split into {p} x {v} chunks")
    t0 = time.perf_counter()
    mesh = make_mesh(p)
    data = dict(mesh.shape)["data"]
    schedule = pipeline.make_schedule(name, stages=p, microbatches=m, virtual_stages=v)
    layout = pipeline.Layout(stages=p, virtual=v, vocab_size=cfg.vocab_size, vocab_parallel=False)
    staged = pipeline.to_stages(layout, params)
    b = batch(m * data, seq, cfg.vocab_size, seed=m)
    compiled = _pipelined_fn(cfg, schedule, layout, mesh).lower(staged, b).compile()
    _, _, counts = compiled(staged, b)
    counts = np.asarray(counts)  # [p, KINDS]: idle, forward, backward, B, W ticks per stage
    key = cfg.n_layers // (p * v)
    if key not in chunk_cache:
      chunk_cache[key] = chunk_flops(cfg, key, 1, seq)
    cf = chunk_cache[key]
    if m not in useful_cache:
      useful_cache[m] = unpipelined_layer_flops(cfg, m, seq)
    backward = (counts[:, pipeline.BACKWARD] * cf["backward"]
                + counts[:, pipeline.BACKWARD_INPUT] * cf["backward_input"]
                + counts[:, pipeline.BACKWARD_WEIGHT] * cf["backward_weight"])
    executed = counts[:, 1] * cf["forward"] + backward
    useful_fwd, useful = (x / p for x in useful_cache[m])
    # The ticks the executor runs (fused or the table's), their idle ticks and buffers.
    ticks_run = schedule.executed
    theory_idle = ticks_run.counts()[:, pipeline.IDLE]
    # Backward (and its B and W halves) over forward from the chunk programs' FLOPs (a
    # FLOP ratio, not timed).
    ratio = cf["backward"] / cf["forward"]
    split = (cf["backward_input"] / cf["forward"], cf["backward_weight"] / cf["forward"])
    timing = schedules.timed(schedule, schedules.Costs(
        forward=1.0, backward=ratio, backward_input=split[0], backward_weight=split[1]))
    # The paper's comparison: B = W = F, 1F1B's backward B + W.
    even = schedules.timed(schedule, schedules.Costs(1.0, 2.0, backward_input=1.0,
                                                     backward_weight=1.0))
    row = dict(
        schedule=name, stages=p, microbatches=m, virtual=v, data=data, ticks=schedule.ticks,
        bubble_theory=schedule.bubble_fraction,
        backward_forward_flop_ratio=ratio,
        input_forward_flop_ratio=split[0], weight_forward_flop_ratio=split[1],
        executed="fused" if ticks_run is schedule.fused else "table",
        executed_ticks=ticks_run.ticks, fused_ticks=schedule.fused.ticks,
        makespan_async=timing.asynchronous, makespan_lockstep=timing.lockstep,
        makespan_lockstep_fused=timing.lockstep_fused,
        makespan_lockstep_unfused=timing.lockstep_unfused,
        bubble_async=timing.asynchronous_bubble, bubble_lockstep=timing.lockstep_bubble,
        makespan_async_even=even.asynchronous, bubble_async_even=even.asynchronous_bubble,
        idle_ticks_per_stage_measured=counts[:, 0].tolist(),
        idle_ticks_per_stage_theory=theory_idle.tolist(),
        forward_ticks_per_stage=counts[:, 1].tolist(),
        backward_ticks_per_stage=counts[:, pipeline.BACKWARD].tolist(),
        input_ticks_per_stage=counts[:, pipeline.BACKWARD_INPUT].tolist(),
        weight_ticks_per_stage=counts[:, pipeline.BACKWARD_WEIGHT].tolist(),
        chunk_forward_flops=cf["forward"], chunk_backward_flops=cf["backward"],
        chunk_input_flops=cf["backward_input"], chunk_weight_flops=cf["backward_weight"],
        executed_layer_flops_per_device=float(executed.max()),
        useful_layer_flops_per_device=float(useful),
        flops_ratio=float(executed.max() / useful),
        forward_flops_ratio=float((counts[:, 1] * cf["forward"]).max() / useful_fwd),
        backward_flops_ratio=float(backward.max() / (useful - useful_fwd)),
        maxtext_gpipe_ratio=(m + p - 1) / m,
        xla_whole_program_flops=flops(compiled),
        max_in_flight=schedule.max_in_flight, res_slots=ticks_run.res_slots,
        peak_activations=schedule.peak_activations, grad_slots=ticks_run.grad_slots,
        seconds=time.perf_counter() - t0)
    rows_out.append(row)
    log(f"schedules {i + 1}/{len(configs)}: {name} p={p} m={m} bubble "
        f"{row['bubble_theory']:.4f} timed {row['bubble_async']:.4f} / "
        f"{row['bubble_lockstep']:.4f} (B/F {ratio:.2f}) FLOPs x"
        f"{row['flops_ratio']:.3f} ({row['seconds']:.1f}s)")
  return rows_out


def memory_rows(cfg, stages: int, microbatches_list, *, seq: int, rows: int,
                names=SCHEDULES) -> list[dict]:
  """Table 2: compiled temp bytes per device and residual-buffer bytes, fixed microbatch size."""
  out = []
  mesh = make_mesh(stages)
  data = dict(mesh.shape)["data"]
  params = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.key(0)))
  for m in microbatches_list:
    for name in names:
      t0 = time.perf_counter()
      v = VIRTUAL.get(name, 1)
      schedule = pipeline.make_schedule(name, stages=stages, microbatches=m, virtual_stages=v)
      layout = pipeline.Layout(stages=stages, virtual=v, vocab_size=cfg.vocab_size,
                               vocab_parallel=False)
      staged = jax.eval_shape(functools.partial(pipeline.to_stages, layout), params)
      b = _abstract_batch(m * rows * data, seq)
      compiled = _pipelined_fn(cfg, schedule, layout, mesh, False).lower(staged, b).compile()
      mem = compiled.memory_analysis()
      cf = chunk_flops(cfg, cfg.n_layers // (stages * v), rows, seq)
      slot = cf["residual_bytes"]
      ticks_run = schedule.executed  # the buffers the executor allocates
      out.append(dict(schedule=name, stages=stages, microbatches=m, virtual=v,
                      rows_per_device_per_microbatch=rows, seq=seq,
                      temp_bytes=int(mem.temp_size_in_bytes),
                      argument_bytes=int(mem.argument_size_in_bytes),
                      output_bytes=int(mem.output_size_in_bytes),
                      res_slots=ticks_run.res_slots, residual_slot_bytes=slot,
                      residual_bytes=ticks_run.res_slots * slot,
                      peak_activations=schedule.peak_activations,
                      # Output gradients held (zero-bubble: from B until W).
                      grad_slots=ticks_run.grad_slots,
                      grad_bytes=ticks_run.grad_slots * cf["activation_bytes"],
                      # What B hands W (zero-bubble), one per held output gradient.
                      stash_bytes=(ticks_run.grad_slots * cf["stash_bytes"]
                                   if schedule.split_backward else 0),
                      seconds=time.perf_counter() - t0))
      log(f"memory {name} p={stages} m={m}: temp {out[-1]['temp_bytes'] / 2**20:.2f} MiB, "
          f"residuals {out[-1]['residual_bytes'] / 2**20:.2f} MiB")
  return out


def _leaf_kind(path) -> str:
  keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
  if "layers" in keys:
    return "layers"
  for k in reversed(keys):
    if k in VOCAB_KINDS:
      return k
  return "other"


def state_bytes_by_kind(cfg, layout, mesh, optimizer, device=None) -> dict[str, int]:
  """Bytes of the stage-view train state (parameters + optimizer) on `device` (default: the
  mesh's first), by leaf kind: the slice of each leaf its sharding puts there."""
  device = mesh.devices.flat[0] if device is None else device
  view = layouts.View(stages=layout)
  abstract = jax.eval_shape(view.to_view, state_lib.abstract_train_state(cfg, optimizer))
  shardings = state_lib.state_shardings(abstract, cfg, optimizer, mesh,
                                        view.rules(mesh_lib.DEFAULT_RULES),
                                        view.param_axes(transformer.param_axes(cfg)))
  out = {k: 0 for k in ("layers", *VOCAB_KINDS, "other")}
  leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
  for (path, leaf), sh in zip(leaves, jax.tree.leaves(shardings)):
    index = sh.devices_indices_map(leaf.shape)[device]
    shape = [len(range(*i.indices(n))) for i, n in zip(index, leaf.shape)]
    out[_leaf_kind(path)] += int(np.prod(shape, dtype=np.int64)) * leaf.dtype.itemsize
  return out


def stage_devices(mesh) -> list:
  """One device of each stage of `mesh`, in stage order."""
  return [np.take(mesh.devices, s, axis=mesh.axis_names.index("stage")).flat[0]
          for s in range(mesh.shape["stage"])]


def head_flops_replicated(cfg, tokens: int) -> float:
  """Norm + output layer + cross-entropy, forward and backward, one device (the last stage)."""
  y = jax.ShapeDtypeStruct((1, tokens, cfg.d_model), jnp.float32)
  norm = jax.ShapeDtypeStruct((cfg.d_model,), jnp.float32)
  w = jax.ShapeDtypeStruct((cfg.d_model, cfg.vocab_size), jnp.float32)
  tgt = jax.ShapeDtypeStruct((1, tokens), jnp.int32)

  def loss(norm, w, y, tgt):
    logits = transformer.unembed(cfg, y, norm, None, w)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.sum(lse - jnp.take_along_axis(logits, tgt[..., None], -1)[..., 0])
  return flops(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(norm, w, y, tgt).compile())


def head_flops_vp(cfg, stages: int, tokens: int) -> float:
  """`vocab.output_layer` (forward and backward, Algorithm 2) per device under shard_map."""
  mesh = jax.make_mesh((stages,), ("stage",), devices=jax.devices()[:stages])
  vs = vocab.padded_vocab(cfg.vocab_size, stages)
  rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "stage"))
  h = jax.ShapeDtypeStruct((1, tokens, cfg.d_model), jnp.float32, sharding=rep)
  w = jax.ShapeDtypeStruct((cfg.d_model, vs), jnp.float32, sharding=split)
  tgt = jax.ShapeDtypeStruct((1, tokens), jnp.int32, sharding=rep)
  mask = jax.ShapeDtypeStruct((1, tokens), jnp.float32, sharding=rep)
  fn = jax.shard_map(functools.partial(vocab.output_layer, vocab_size=cfg.vocab_size, axis="stage"),
                     mesh=mesh, in_specs=(P(), P(None, "stage"), P(), P()),
                     out_specs=(P(), P(), P(None, "stage")), check_vma=False)
  return flops(jax.jit(fn).lower(h, w, tgt, mask).compile())


def vocab_rows(vocabs, *, d_model, n_layers, d_ff, heads, stages, tokens) -> list[dict]:
  """Table 3: per-stage parameter + optimizer bytes and vocabulary FLOPs, VP vs replicated."""
  out = []
  mesh = make_mesh(stages)
  optimizer = make_optimizer(config_check.parse(tiny_lm.get_config()).optimizer, 1000)
  layer_cfg = transformer.TransformerConfig(vocab_size=256, d_model=d_model, n_layers=n_layers,
                                            n_heads=heads, n_kv_heads=heads, d_ff=d_ff,
                                            attention_impl="xla")
  stage_layer = chunk_flops(layer_cfg, n_layers // stages, 1, tokens)
  stage_layer_flops = stage_layer["forward"] + stage_layer["backward"]
  for V in vocabs:
    t0 = time.perf_counter()
    cfg = dataclasses.replace(layer_cfg, vocab_size=V)
    by, per_stage = {}, {}
    for vp in (True, False):
      layout = pipeline.Layout(stages=stages, virtual=1, vocab_size=V, vocab_parallel=vp)
      # Each stage's bytes read from where the shardings put the leaves on its devices.
      per_stage[vp] = [state_bytes_by_kind(cfg, layout, mesh, optimizer, device)
                       for device in stage_devices(mesh)]
      by[vp] = per_stage[vp][0]
    vocab_b = lambda d: sum(d[k] for k in VOCAB_KINDS)
    vp_stage = [b["layers"] + vocab_b(b) + b["other"] for b in per_stage[True]]
    spmd_stage = [b["layers"] + vocab_b(b) + b["other"] for b in per_stage[False]]
    rep = by[False]
    mpmd_stage = [rep["layers"] + rep["other"]] * stages
    mpmd_stage[0] += rep["embedding"]
    mpmd_stage[-1] += rep["unembedding"] + rep["final_norm"]
    head_rep = head_flops_replicated(cfg, tokens)
    head_vp = head_flops_vp(cfg, stages, tokens)
    vp_flops = [stage_layer_flops + head_vp] * stages
    mpmd_flops = [stage_layer_flops] * stages
    mpmd_flops[-1] += head_rep
    out.append(dict(
        vocab=V, stages=stages, d_model=d_model, n_layers=n_layers, d_ff=d_ff,
        tokens_per_microbatch=tokens,
        bytes_by_kind_vp=by[True], bytes_by_kind_replicated=rep,
        vocab_layer_bytes_vp=vocab_b(by[True]), vocab_layer_bytes_replicated=vocab_b(rep),
        stage_bytes_vp=vp_stage, stage_bytes_spmd_replicated=spmd_stage,
        stage_bytes_mpmd=mpmd_stage,
        vp_max_over_min=max(vp_stage) / min(vp_stage),
        mpmd_max_over_min=max(mpmd_stage) / min(mpmd_stage),
        stage_layer_flops=stage_layer_flops, head_flops_replicated=head_rep,
        head_flops_vp_per_device=head_vp, stage_flops_vp=vp_flops, stage_flops_mpmd=mpmd_flops,
        seconds=time.perf_counter() - t0))
    log(f"vocab {V}: VP stage bytes {vp_stage[0] / 2**20:.1f} MiB; MPMD "
        f"{[round(b / 2**20, 1) for b in mpmd_stage]} MiB ({out[-1]['seconds']:.1f}s)")
  return out


def cpu_rows(*, d_model: int = 256, n_layers: int = 8, vocab_size: int = 8192, seq: int = 128,
             rows: int = 16, stages: int = 4, microbatches: int = 8, repeats: int = 5,
             extra: tuple[str, ...] = (), both_shapes: bool = False) -> list[dict]:
  """Table 4: process CPU seconds of a pipelined step over the unpipelined one's (`extra`:
  more schedules after the four, e.g. eager_1f1b, zb_h1, zbv), in the ticks the executor runs
  (`schedule.executed`) and with `both_shapes` also in the other shape (fused or the
  table's ticks)."""
  cfg = dataclasses.replace(small_model(d_model=d_model, n_layers=n_layers,
                                        vocab_size=vocab_size, n_kv_heads=4), d_ff=4 * d_model)
  params = transformer.init_params(cfg, jax.random.key(0))
  batch = {k: jnp.asarray(v) for k, v in packing.random_packed_batch(
      rows, seq, docs_per_row=2, vocab_size=vocab_size, seed=0).items()}

  cpu_seconds = lambda fn, *args: median_seconds(fn, *args, repeats=repeats,
                                                  clock=time.process_time)
  flat = mesh_lib.make_mesh(f"data={jax.device_count()}")
  step = jax.jit(jax.value_and_grad(lambda p, b: jnp.sum(step_lib.token_losses(cfg, p, b))))
  base = cpu_seconds(step, params, jax.device_put(batch, mesh_lib.batch_sharding(flat)))
  out = [dict(schedule=f"unpipelined, data={jax.device_count()}", seconds=base, ratio=1.0)]
  mesh = make_mesh(stages)
  for name, v, vp in (("gpipe", 1, False), ("1f1b", 1, False), ("1f1b", 1, True),
                      ("interleaved_1f1b", 2, False),
                      *((n, VIRTUAL.get(n, 1), False) for n in extra)):
    layout = pipeline.Layout(stages=stages, virtual=v, vocab_size=vocab_size, vocab_parallel=vp)
    schedule = pipeline.make_schedule(name, stages=stages, microbatches=microbatches,
                                      virtual_stages=v)
    default = schedule.executed is schedule.fused
    for fused in (default, not default)[:1 + both_shapes]:
      fn = jax.jit(lambda p, b: pipeline.pipeline_loss_and_grads(
          cfg, schedule, layout, p, b, mesh=mesh, fused=fused))
      seconds = cpu_seconds(fn, pipeline.to_stages(layout, params), batch)
      ticks = schedule.fused if fused else schedule.unfused
      out.append(dict(schedule=name + (" + VP" if vp else "") + ("" if fused == default else
                                                                 " (other shape)"),
                      shape="fused" if fused else "table", ticks=ticks.ticks, seconds=seconds,
                      ratio=seconds / base))
      log(f"cpu {out[-1]['schedule']}, {out[-1]['shape']} ticks: {seconds:.3f} s, "
          f"{seconds / base:.2f}x")
  return out


# ---------------------------------------------------------------------------
# Tables and chart
# ---------------------------------------------------------------------------


def _mib(b: float) -> str:
  return f"{b / 2**20:,.2f}"


def schedule_table(rows) -> str:
  """One row per (p, m): each schedule's bubble, ticks / timed async / timed lock step (at
  the chunks' backward / forward FLOP ratio); FLOPs ratios; in flight."""
  lines = ["| p | m | B/F FLOPs | " + "".join(f"bubble {LABELS[n]} | " for n in SCHEDULES)
           + "executed / useful layer FLOPs (fwd, bwd) | MaxText GPipe (m+p-1)/m | max in "
           "flight " + " / ".join(LABELS[n] for n in SCHEDULES) + " |",
           "|---:|---:|---:|" + "---:|" * len(SCHEDULES) + "---|---:|---|"]
  keys = sorted({(r["stages"], r["microbatches"]) for r in rows})
  for p, m in keys:
    by = {r["schedule"]: r for r in rows if (r["stages"], r["microbatches"]) == (p, m)}
    cell = lambda n: (f"{by[n]['bubble_theory']:.4f} / {by[n]['bubble_async']:.4f} / "
                      f"{by[n]['bubble_lockstep']:.4f}" if n in by else "-")
    span = lambda k: (f"{min(r[k] for r in by.values()):.3f}" if len({round(r[k], 3) for r in
                      by.values()}) == 1 else f"{min(r[k] for r in by.values()):.3f}-"
                      f"{max(r[k] for r in by.values()):.3f}")
    inflight = " / ".join(str(by[n]["max_in_flight"]) if n in by else "-" for n in SCHEDULES)
    lines.append(f"| {p} | {m} | {span('backward_forward_flop_ratio')} | "
                 + "".join(f"{cell(n)} | " for n in SCHEDULES) +
                 f"{span('flops_ratio')} ({span('forward_flops_ratio')}, "
                 f"{span('backward_flops_ratio')}) | {(m + p - 1) / m:.3f} | {inflight} |")
  return "\n".join(lines)


def memory_table(rows) -> str:
  lines = ["| m | schedule | temp MiB / device | x GPipe | residual slots | residual MiB "
           "| x GPipe | peak activations (stages' worth) | output-gradient slots | + stash MiB |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  gp = {r["microbatches"]: r for r in rows if r["schedule"] == "gpipe"}
  for r in rows:
    g = gp.get(r["microbatches"])
    ratio = lambda k: f"{r[k] / g[k]:.3f}" if g else "-"
    lines.append(f"| {r['microbatches']} | {r['schedule']} | {_mib(r['temp_bytes'])} | "
                 f"{ratio('temp_bytes')} | {r['res_slots']} | {_mib(r['residual_bytes'])} | "
                 f"{ratio('residual_bytes')} | {r.get('peak_activations', 0):g} | "
                 f"{r.get('grad_slots', 0)} | {_mib(r.get('stash_bytes', 0))} |")
  return "\n".join(lines)


def vocab_table(rows) -> str:
  lines = ["| vocab | vocab layers MiB / device: VP / replicated | stage MiB, VP (max/min) | "
           "stage MiB, MPMD first / middle / last (max/min) | output layer GFLOP / device: VP / "
           "last stage without VP | one stage's layers GFLOP | stage GFLOP max/min: VP / MPMD |",
           "|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    mp = r["stage_bytes_mpmd"]
    fv, fm = r["stage_flops_vp"], r["stage_flops_mpmd"]
    lines.append(
        f"| {r['vocab']:,} | {_mib(r['vocab_layer_bytes_vp'])} / "
        f"{_mib(r['vocab_layer_bytes_replicated'])} | {_mib(max(r['stage_bytes_vp']))} "
        f"({r['vp_max_over_min']:.3f}) | {_mib(mp[0])} / {_mib(mp[1])} / {_mib(mp[-1])} "
        f"({r['mpmd_max_over_min']:.2f}) | {r['head_flops_vp_per_device'] / 1e9:.1f} / "
        f"{r['head_flops_replicated'] / 1e9:.1f} | {r['stage_layer_flops'] / 1e9:.1f} | "
        f"{max(fv) / min(fv):.2f} / {max(fm) / min(fm):.2f} |")
  return "\n".join(lines)


def draw_schedules(schedules_list, path: str | None = None, axes=None):
  """Tick-by-stage charts: color = microbatch, solid = forward, hatched light = backward (or
  its input-gradient half), dotted light = weight gradient.

  The x axis is time in units of one stage's full forward: an interleaved chunk-tick
  (1/v of a stage's layers) is drawn 1/v wide, so the charts compare in time.
  """
  import matplotlib
  if path:
    matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.patches import Patch

  if axes is None:
    width = max(s.ticks / s.virtual_stages for s in schedules_list) * 0.4 + 1.5
    fig, axes = plt.subplots(len(schedules_list), 1, figsize=(width, 1.3 * sum(
        s.stages for s in schedules_list) / 2 + 0.6 * len(schedules_list)), squeeze=False)
    axes = axes[:, 0]
  else:
    fig = axes[0].figure
  cmap = plt.get_cmap("tab10" if max(s.microbatches for s in schedules_list) <= 10 else "tab20")
  tmax = max(s.ticks / s.virtual_stages for s in schedules_list)
  for ax, s in zip(axes, schedules_list):
    table = s.unfused
    for t in range(s.ticks):
      for st in range(s.stages):
        k = int(table.kind[t, 0, st])
        if k == pipeline.IDLE:
          continue
        mb, v = int(table.microbatch[t, 0, st]), int(table.virtual[t, 0, st])
        color = cmap(mb % cmap.N)
        fwd = k == pipeline.FORWARD
        w = 1 / s.virtual_stages
        hatch = {pipeline.FORWARD: None, pipeline.BACKWARD_WEIGHT: "..."}.get(k, "///")
        ax.add_patch(plt.Rectangle((t * w, st), w, 1, facecolor=color, alpha=1.0 if fwd else 0.45,
                                   hatch=hatch, edgecolor="white", lw=0.6))
        label = f"{mb}" + (chr(ord("a") + v) if s.virtual_stages > 1 else "")
        ax.text((t + 0.5) * w, st + 0.5, label, ha="center", va="center", fontsize=6)
    ax.set_xlim(0, tmax)
    ax.set_ylim(s.stages, 0)
    ax.set_yticks(np.arange(s.stages) + 0.5, [f"stage {i}" for i in range(s.stages)], fontsize=7)
    ax.set_xlabel("time (one stage's forward of a microbatch = 1)", fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    name = s.name + (f" (v={s.virtual_stages})" if s.virtual_stages > 1 else "")
    ticks = (f"{s.ticks} ticks" if s.virtual_stages == 1
             else f"{s.ticks} ticks of 1/{s.virtual_stages}")
    ax.set_title(f"{name}: p={s.stages}, m={s.microbatches}, {ticks}, bubble "
                 f"{s.bubble_fraction:.3f}, max in flight {s.max_in_flight}", fontsize=8)
  axes[0].legend(handles=[Patch(facecolor="grey", label="forward"),
                          Patch(facecolor="grey", alpha=0.45, hatch="///",
                                label="backward (zero-bubble: its input gradient)"),
                          Patch(facecolor="grey", alpha=0.45, hatch="...",
                                label="weight gradient")],
                 loc="upper right", fontsize=7, ncol=3)
  fig.tight_layout()
  if path:
    fig.savefig(path, dpi=130)
  return fig


def run(parts, *, stages_list, microbatches_list, skip=(), names=SCHEDULES, mem_names=SCHEDULES,
        d_model=64, n_layers=16, seq=32,
        mem_stages=4, mem_microbatches=(4, 8, 16), mem_seq=256, mem_rows=1,
        vocabs=(), vocab_kw=None, cpu_kw=None, out_path=None, chart_path=None
        ) -> dict[str, Any]:
  """Every table of `parts`; writes the JSON to `out_path` and returns it."""
  t0 = time.perf_counter()
  cfg = small_model(d_model=d_model, n_layers=n_layers)
  result: dict[str, Any] = dict(
      devices=jax.device_count(), backend=jax.default_backend(), jax_version=jax.__version__,
      model=dataclasses.asdict(cfg), seq=seq, argv=sys.argv,
      notes="bubble_theory = idle stage-ticks / all stage-ticks; bubble_async / "
            "bubble_lockstep = schedules.timed at the chunks' backward / forward FLOP ratio; "
            "FLOPs from XLA cost_analysis (while bodies counted once, so per-call chunk FLOPs x "
            "executed counts); bytes per device.")
  if chart_path:
    draw_schedules([pipeline.make_schedule(n, stages=4, microbatches=8,
                                           virtual_stages=VIRTUAL.get(n, 1))
                    for n in SCHEDULES], chart_path)
    result["chart"] = chart_path
  if "schedules" in parts:
    result["schedules"] = schedule_rows(cfg, stages_list, microbatches_list, seq=seq, skip=skip,
                                        names=names)
  if "memory" in parts:
    result["memory"] = memory_rows(cfg, mem_stages, mem_microbatches, seq=mem_seq, rows=mem_rows,
                                   names=mem_names)
  if "vocab" in parts:
    result["vocab"] = vocab_rows(vocabs, **(vocab_kw or {}))
  if "cpu" in parts:
    result["cpu"] = cpu_rows(**(cpu_kw or {}))
  result["seconds"] = time.perf_counter() - t0
  if out_path:
    with open(out_path, "w") as f:
      json.dump(result, f, indent=1)
  return result


def tables(result) -> str:
  parts = []
  if "schedules" in result:
    parts.append(schedule_table(result["schedules"]))
  if "memory" in result:
    parts.append(memory_table(result["memory"]))
  if "vocab" in result:
    parts.append(vocab_table(result["vocab"]))
  if "cpu" in result:
    parts.append("| step | ticks | CPU s | x unpipelined |\n|---|---|---:|---:|\n" + "\n".join(
        f"| {r['schedule']} | {r.get('shape', '-')} {r.get('ticks', '')} | {r['seconds']:.3f} | "
        f"{r['ratio']:.2f} |" for r in result["cpu"]))
  return "\n\n".join(parts)
