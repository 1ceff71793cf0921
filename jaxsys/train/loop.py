"""train_and_evaluate: the training loop around the pure step (data, checkpoints, metrics)."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import NamedSharding

from jaxsys import mesh as mesh_lib
from jaxsys import metrics as metrics_lib
from jaxsys.checkpoint import manager as manager_lib
from jaxsys.checkpoint.manager import Checkpointer, check_same_model
from jaxsys.data.loader import make_loader
from jaxsys.models import transformer
from jaxsys.optim.inner import make_schedule
from jaxsys.train import replicas as replicas_lib
from jaxsys.train import step as step_lib

# Model fields that change parameter shapes or types; the others (attention_impl,
# remat, compute dtype) may differ between a run and its resumption.
SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                "tie_embeddings", "param_dtype")


class NonFiniteLossError(FloatingPointError):
  """The loss or gradient norm became NaN or Inf; the run stops without saving."""


@contextlib.contextmanager
def _sigterm_flag() -> Iterator[list[bool]]:
  """Turns SIGTERM into a flag the loop polls, so it can save and exit cleanly."""
  flag = [False]

  def handler(signum, frame):
    logging.warning("SIGTERM received: saving a checkpoint and stopping.")
    flag[0] = True

  try:
    previous = signal.signal(signal.SIGTERM, handler)
  except ValueError:  # not the main thread (e.g. some notebook runners): no handler
    yield flag
    return
  try:
    yield flag
  finally:
    signal.signal(signal.SIGTERM, previous)


def _check_batch_layout(config, mesh) -> None:
  batch, accum = config.data.batch_size, config.optimizer.grad_accum_steps
  shards = math.prod(mesh.shape[a] for a in ("replica", "data", "fsdp") if a in mesh.shape)
  if accum < 1 or batch % accum or (batch // accum) % shards:
    raise ValueError(
        f"data.batch_size={batch} must split into optimizer.grad_accum_steps={accum} microbatches "
        f"whose size divides over the {shards} batch shards of mesh {mesh_lib.describe(mesh)}")
  if batch % jax.process_count():
    raise ValueError(f"data.batch_size={batch} must divide over {jax.process_count()} processes")


@jax.jit
def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _check_finite_params(params, step: int, ckpt: Checkpointer) -> None:
  """A checkpoint must never hold NaN/Inf: the last good one stays the latest."""
  if not bool(_all_finite(params)):
    raise NonFiniteLossError(
        f"parameters are not finite at step {step}: stopping without saving; "
        f"the last good checkpoint is step {ckpt.latest_step()} in {ckpt.directory}")


def _global_batch(local: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


class _Throughput:
  """Tokens/s and MFU over training time only: compilation, eval and saving are excluded."""

  def __init__(self, tokens_per_step: int, flops_per_token: float, peak_flops: float):
    self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak_flops
    self.t0, self.steps, self.paused = None, 0, 0.0

  def step_done(self, metrics) -> None:
    if self.t0 is None:  # the first step compiles: time from its end
      jax.block_until_ready(metrics)
      self.t0 = time.perf_counter()
    else:
      self.steps += 1

  @contextlib.contextmanager
  def paused_timer(self):
    t = time.perf_counter()
    yield
    self.paused += time.perf_counter() - t

  def rates(self) -> dict[str, float]:
    """Rates since the last call (empty before any timed step)."""
    now = time.perf_counter()
    out = {}
    if self.steps:
      tps = self.steps * self.tokens_per_step / (now - self.t0 - self.paused)
      out = {"tokens_per_s": tps, "mfu": tps * self.flops_per_token / self.peak}
    self.t0, self.steps, self.paused = now, 0, 0.0
    return out


def _check_finite_metrics(fetched: list[tuple[int, dict]], ckpt: Checkpointer) -> None:
  for s, m in fetched:
    if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
      raise NonFiniteLossError(
          f"loss={m['loss']} grad_norm={m['grad_norm']} at step {s}: stopping without saving; "
          f"the last good checkpoint is step {ckpt.latest_step()} in {ckpt.directory}")


def read_latest_params(path: str, model_cfg, model_meta: dict) -> tuple[int, Any, int] | None:
  """(step, params, replicas) of the latest checkpoint of the run at `path`, as numpy; None if none.

  `path` is a run's workdir or its checkpoints dir. A checkpoint in the replica view
  gives params with a leading axis of `replicas`; otherwise `replicas` is 0.
  """
  path = os.path.abspath(path)
  directory = os.path.join(path, "checkpoints")
  directory = directory if os.path.isdir(directory) else path
  found = manager_lib.latest_meta(directory) if os.path.isdir(directory) else None
  if found is None:
    return None
  step, meta = found
  check_same_model(meta["model"], model_meta, directory, SHAPE_FIELDS)
  params = jax.eval_shape(lambda: transformer.init_params(model_cfg, jax.random.key(0)))
  replicas = (meta.get("outer") or {}).get("replicas") or 0
  if replicas:
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct((replicas, *x.shape), x.dtype), params)
  return step, manager_lib.read_params(directory, step, params), replicas


def _init_from_params(init_from: str, model_cfg, model_meta: dict):
  """The latest parameters of the run at `init_from` (its workdir or checkpoints dir), as numpy.

  A checkpoint in the replica view gives replica 0's parameters (the ones its evals scored).
  """
  found = read_latest_params(init_from, model_cfg, model_meta)
  if found is None:
    raise ValueError(f"init_from={init_from!r} holds no checkpoint; it must be a run's workdir "
                     "or its checkpoints dir, or '' to start from random parameters")
  step, params, replicas = found
  logging.info("init_from: parameters of step %d in %s", step, os.path.abspath(init_from))
  return jax.tree.map(lambda x: x[0], params) if replicas else params


def evaluate(eval_fn, params, loader, start_state: dict, steps: int, sharding) -> dict[str, float]:
  """val_loss and val_bpb over the first `steps` batches of `loader` (rewound to `start_state`)."""
  loader.set_state(start_state)
  sums = None
  for _, batch in zip(range(steps), loader):
    out = eval_fn(params, _global_batch(batch, sharding))
    sums = out if sums is None else jax.tree.map(lambda a, b: a + b, sums, out)
  if sums is None:
    raise ValueError("the val split gave no batch; lower data.batch_size or data.seq_len")
  return step_lib.summarize_eval({k: float(v) for k, v in jax.device_get(sums).items()})


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Trains `config` in `workdir`, resuming from its latest checkpoint; returns final metrics."""
  workdir = os.path.abspath(workdir)
  mesh = mesh_lib.make_mesh(config.mesh)
  _check_batch_layout(config, mesh)
  model_cfg = transformer.TransformerConfig.from_config(config.model)
  logging.info("mesh: %s", mesh_lib.describe(mesh))

  loader_kw = dict(process_index=jax.process_index(), process_count=jax.process_count(),
                   workdir=workdir)
  train_loader = make_loader(config.data, "train", batch_size=config.data.batch_size,
                             seed=config.seed, **loader_kw)
  tokenizer = train_loader.tokenizer
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise ValueError(f"model.vocab_size={model_cfg.vocab_size} is smaller than the "
                     f"{config.data.tokenizer} tokenizer's {tokenizer.vocab_size} tokens")
  eval_batch = config.data.batch_size // config.optimizer.grad_accum_steps
  val_loader = make_loader(config.data, "val", batch_size=eval_batch, seed=config.seed,
                           shuffle=False, repeat=False, tokenizer=tokenizer, **loader_kw)
  val_start = val_loader.get_state()

  schedule = make_schedule(config.optimizer, config.total_steps)
  outer = replicas_lib.make_outer_optimizer(config.optimizer)
  if outer is None:  # plain data parallel
    setup = step_lib.make_train_setup(config, model_cfg, mesh)
    param_sh, eval_params, sync_every = setup.state_sh.params, (lambda p: p), 0
    comm_bytes = lambda s: s * replicas_lib.dp_bytes_per_step(setup.abstract.params, mesh)
  else:
    setup = replicas_lib.make_replica_setup(config, model_cfg, mesh, outer)
    param_sh, eval_params, sync_every = setup.param_sh, setup.eval_params, outer.sync_every
    comm_bytes = lambda s: (s // sync_every) * setup.bytes_per_sync
    logging.info("outer optimizer %s over %d replicas, sync every %d steps, %d bytes sent per "
                 "replica per sync", outer.name, setup.replicas, sync_every, setup.bytes_per_sync)
  abstract, state_sh, batch_sh, train_fn = (setup.abstract, setup.state_sh, setup.batch_sh,
                                            setup.train_fn)
  eval_fn = step_lib.jit_eval_step(model_cfg, param_sh, batch_sh, tokenizer.token_bytes())

  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.keep_checkpoints)
  model_meta = dataclasses.asdict(model_cfg)
  outer_meta = None if outer is None else {"view": "replica", "name": outer.name,
                                             "replicas": setup.replicas,
                                             "sync_every": outer.sync_every}
  latest = ckpt.latest_step()
  if latest is not None:
    saved_meta = ckpt.read_meta(latest)
    check_same_model(saved_meta["model"], model_meta, ckpt.directory, SHAPE_FIELDS)
    if saved_meta.get("outer") != outer_meta:
      raise ValueError(f"checkpoint in {ckpt.directory} was written with outer optimizer "
                       f"{saved_meta.get('outer')} but the config asks for {outer_meta}; "
                       "use another --workdir or a matching --config")
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, state_sh)
    state, data_state = ckpt.restore(latest, target)
    train_loader.set_state(data_state)
    logging.info("resumed from %s at step %d", ckpt.directory, latest)
  else:
    state = setup.init_state(config.seed)
    if config.get("init_from"):  # fresh start from another run's parameters; a resume never is
      params = jax.device_put(_init_from_params(config.init_from, model_cfg, model_meta), param_sh)
      if outer is None:
        start = lambda s, p: s.replace(params=p, opt_state=setup.optimizer.init(p))
      else:
        start = lambda s, p: replicas_lib.start_from_params(s.step, s.rng, p, setup.optimizer,
                                                            outer, setup.replicas)
      state = jax.jit(start, out_shardings=state_sh, donate_argnums=0)(state, params)
  meta = {"model": model_meta, "config": config.to_dict()}
  if outer_meta is not None:
    meta["outer"] = outer_meta

  flops_per_token = transformer.train_flops_per_token(model_cfg, config.data.seq_len)
  peak = metrics_lib.peak_flops(model_cfg.dtype)
  logging.info("model: %.2fM parameters, %.1f MFLOP per training token; measured matmul peak "
               "%.1f GFLOP/s", transformer.param_count(model_cfg) / 1e6, flops_per_token / 1e6,
               peak / 1e9)
  meter = _Throughput(config.data.batch_size * config.data.seq_len, flops_per_token, peak)

  writer = metrics_lib.MetricWriter(workdir)
  step = saved_step = int(jax.device_get(state.step))
  progress = metrics_lib.Progress(config.total_steps, step)
  result: dict[str, Any] = {"workdir": workdir, "checkpoints": ckpt.directory,
                            "metrics": writer.path, "tensorboard": writer.tb_dir}
  pending: list[tuple[int, dict]] = []  # step metrics still on device
  # A sync deferred into the next inner step's program (CO2); run on its own before eval/save.
  sync_due = False
  fused = getattr(setup, "sync_train_fn", None)

  def flush_sync() -> None:
    nonlocal state, sync_due
    if sync_due:
      state, sync_due = setup.sync_fn(state), False

  def log() -> None:
    """Fetches pending metrics (a non-finite loss stops the run here) and writes a row."""
    fetched = jax.device_get(pending)
    pending.clear()
    _check_finite_metrics(fetched, ckpt)
    m = fetched[-1][1]
    row = {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
           "lr": float(schedule(step - 1)), "comm_bytes": float(comm_bytes(step)),
           **meter.rates()}
    writer.write(step, row)
    progress.update(step, **{k: row[k] for k in ("loss", "tokens_per_s", "mfu") if k in row})

  def save() -> None:
    nonlocal saved_step
    if pending:  # never save without checking the losses that led here
      log()
    flush_sync()
    _check_finite_params(state.params, step, ckpt)
    ckpt.save(step, state, data=train_loader.get_state(), meta=meta, force=True)
    saved_step = step

  batches = iter(train_loader)
  try:
    with _sigterm_flag() as sigterm:
      while step < config.total_steps and not sigterm[0]:
        batch = _global_batch(next(batches), batch_sh)
        if sync_due:
          state, m = fused(state, batch)
          sync_due = False
        else:
          state, m = train_fn(state, batch)
        step += 1
        if sync_every and step % sync_every == 0:
          if fused is None:
            state = setup.sync_fn(state)
          else:
            sync_due = True
        pending.append((step, m))
        if len(pending) > 1:
          # At most two steps in flight. A deep queue of collective programs can deadlock
          # XLA:CPU's simulated devices (threads blocked in a later step's rendezvous starve
          # a device still in an earlier one); on accelerators one step ahead is enough.
          jax.block_until_ready(pending[-2][1])
        meter.step_done(m)
        last = step == config.total_steps
        if step % config.log_every == 0 or last:
          log()
        else:
          progress.update(step)
        with meter.paused_timer():
          if config.eval_every and (step % config.eval_every == 0 or last):
            flush_sync()
            ev = evaluate(eval_fn, eval_params(state.params), val_loader, val_start,
                          config.eval_steps, batch_sh)
            ev["comm_bytes"] = float(comm_bytes(step))
            writer.write(step, ev)
            result.update(ev)
            logging.info("step %d: val_loss=%.4f val_bpb=%.4f", step, ev["val_loss"],
                         ev["val_bpb"])
          if last or step % config.checkpoint_every == 0:
            save()
      if sigterm[0]:
        if saved_step != step:
          save()
        result["preempted"] = True
  finally:
    progress.close()
    writer.close()
    ckpt.close()
  result["step"] = step
  return result
