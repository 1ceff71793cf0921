"""train_and_evaluate: the training loop around the pure step (data, checkpoints, metrics).

Its phases, one function each: `_set_up` (mesh, loaders, model, optimizer and their
jitted steps), `_restore_or_init` (the workdir's latest checkpoint, or a fresh state,
optionally from `init_from`) and `_Loop.run` (the steps, with log, eval and save hooks,
until `total_steps` or a stop agreed by every process on SIGTERM).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import signal
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxsys import flops as flops_lib
from jaxsys import mesh as mesh_lib
from jaxsys import metrics as metrics_lib
from jaxsys import preemption
from jaxsys.checkpoint import hf, layouts
from jaxsys.checkpoint.lock import WorkdirLock
from jaxsys.checkpoint.manager import Checkpointer, check_entries, check_same_model, snapshot_dir
from jaxsys.checkpoint.reader import read_params
from jaxsys.config import RunConfig
from jaxsys.data.documents import DocumentLoader, make_document_loader
from jaxsys.data.loader import Loader, make_loader
from jaxsys.models import transformer
from jaxsys.optim.inner import make_schedule
from jaxsys.train import comm_device
from jaxsys.train import config_check
from jaxsys.train import grads
from jaxsys.train import hdp_step
from jaxsys.train import profile as profile_lib
from jaxsys.train import setup as setup_lib
from jaxsys.train import step as step_lib


class NonFiniteLossError(FloatingPointError):
  """The loss or gradient norm became NaN or Inf; the run stops without saving."""


class _Stop:
  """`stop(step)`, asked after every step: save and stop now? The same answer on every process.

  One process: a SIGTERM handler sets a flag; before the first step of this process was
  launched there is nothing new to save, so SIGTERM then stops at once
  (`preemption.Preempted`: the binary exits 75, "preempted before the first step"). Several:
  jax.distributed's preemption service owns SIGTERM (it must stay enabled, as it is by
  default); a notice on any process makes all of them stop at the step after the furthest
  one any has reached, so no process enters the save (a collective) while another still
  runs a step's.
  """

  def __init__(self, sync: Callable[[int], bool] | None = None):
    self._sync = sync
    self.began = False  # a step of this process launched: SIGTERM now saves it
    self.requested = False

  def stepped(self) -> None:
    if not self.began:
      self.began = True
      preemption.training_started()

  def __call__(self, step: int) -> bool:
    return self._sync(step) if self._sync is not None else self.requested

  def on_sigterm(self, signum, frame) -> None:
    del signum, frame
    if not self.began:
      preemption.stop_now()  # raises Preempted
    logging.warning("SIGTERM received: saving a checkpoint and stopping.")
    self.requested = True


@contextlib.contextmanager
def _stop_requests() -> Iterator[_Stop]:
  """A `_Stop` for the run, its SIGTERM handler in place until the run has closed (a
  SIGTERM during the last save or the close then changes nothing)."""
  if jax.process_count() > 1:
    yield _Stop(multihost_utils.reached_preemption_sync_point)
    return
  stop = _Stop()
  try:
    previous = signal.signal(signal.SIGTERM, stop.on_sigterm)
  except ValueError:  # not the main thread (e.g. some notebook runners): no handler
    yield stop
    return
  try:
    yield stop
  finally:
    signal.signal(signal.SIGTERM, previous)


def _batch_block(sharding: NamedSharding, batch_size: int) -> tuple[int, int]:
  """(index, count): the global batch is `count` contiguous row blocks and this process's
  devices hold block `index`.

  The loader reads exactly that block, so assembling the global batch moves no row
  between hosts and the step needs no reordering. Processes whose devices hold the same
  rows (a pipeline whose stages span hosts: the batch is replicated over `stage`) read
  the same block.
  """
  # Any length works for the rows; the mesh size divides over whatever splits the sequence.
  shape = (batch_size, sharding.mesh.size)
  rows = [index[0] for index in sharding.addressable_devices_indices_map(shape).values()]
  lo = min(r.start or 0 for r in rows)
  hi = max(batch_size if r.stop is None else r.stop for r in rows)
  size = hi - lo
  covered = set()
  for r in rows:
    covered.update(range(r.start or 0, batch_size if r.stop is None else r.stop))
  if len(covered) != size or batch_size % size or lo % size or batch_size // size > jax.process_count():
    raise ValueError(f"mesh {mesh_lib.describe(sharding.mesh)} gives process {jax.process_index()} "
                     f"batch rows [{lo}, {hi}) of {batch_size}, not one of {jax.process_count()} "
                     "equal blocks or fewer; the batch axes must order the devices by process")
  return lo // size, batch_size // size


@jax.jit
def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _check_finite_params(params, step: int, ckpt: Checkpointer) -> None:
  """A checkpoint must never hold NaN/Inf: the last good one stays the latest."""
  if not bool(_all_finite(params)):
    raise NonFiniteLossError(
        f"parameters are not finite at step {step}: stopping without saving; "
        f"the last good checkpoint is step {ckpt.latest_step()} in {ckpt.directory}")


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
      seconds = (now - self.t0 - self.paused) / self.steps
      tps = self.tokens_per_step / seconds
      out = {"tokens_per_s": tps, "mfu": tps * self.flops_per_token / self.peak,
             "step_time_s": seconds}
    self.t0, self.steps, self.paused = now, 0, 0.0
    return out


def _throughput_meter(run: RunConfig) -> _Throughput:
  # The logged MFU counts causal attention, T(T+1)/2 pairs a row (the documents' own
  # masks are not subtracted); PaLM's full T x T square is logged beside it once.
  model_cfg, seq_len = run.model, run.data.seq_len
  flops_per_token = transformer.train_flops_per_token(
      model_cfg, seq_len, pairs_per_row=flops_lib.attention_pairs(seq_len))
  palm = transformer.train_flops_per_token(model_cfg, seq_len)
  peak = metrics_lib.peak_flops(model_cfg.dtype)
  logging.info("model: %.2fM parameters, %.2f MFLOP per training token with causal attention "
               "(%.2f with the full T x T, PaLM's convention: x%.3f the MFU logged); MFU is "
               "against %.1f GFLOP/s, the %s", transformer.param_count(model_cfg) / 1e6,
               flops_per_token / 1e6, palm / 1e6, palm / flops_per_token, peak.flops / 1e9,
               peak.source)
  return _Throughput(run.data.batch_size * seq_len, flops_per_token, peak.flops)


def _to_host(tree):
  """`tree` on the host; a replica run's per-replica metrics, spread over processes, are
  gathered by one collective (at a logged step only)."""
  local = lambda x: x.is_fully_addressable or x.is_fully_replicated
  if all(local(x) for x in jax.tree.leaves(tree)):
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)


def _check_finite_metrics(fetched: list[tuple[int, dict]], ckpt: Checkpointer) -> None:
  for s, m in fetched:
    if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
      raise NonFiniteLossError(
          f"loss={m['loss']} grad_norm={m['grad_norm']} at step {s}: stopping without saving; "
          f"the last good checkpoint is step {ckpt.latest_step()} in {ckpt.directory}")


class Validation:
  """The val batches a run's evals score, and scoring parameters on them.

  The training loop, compare_outer's final eval and the PTQ table all score through
  it, so their numbers agree: same loader, batch size, eval step and batch count.
  `tokenizer` None takes the data config's (a BPE one from its cache in `workdir`).
  """

  def __init__(self, run: RunConfig, mesh, *, tokenizer=None, workdir: str | None = None):
    self.model_cfg, self.steps = run.model, run.eval_steps
    self.batch_sh = mesh_lib.batch_sharding(mesh)
    batch = run.data.batch_size // run.optimizer.grad_accum_steps
    block, blocks = _batch_block(self.batch_sh, batch)
    self.loader = make_loader(run.data, "val", batch_size=batch, seed=run.seed,
                              shuffle=False, repeat=False, tokenizer=tokenizer,
                              process_index=block, process_count=blocks, workdir=workdir)
    self.start = self.loader.get_state()
    self.token_bytes = self.loader.tokenizer.token_bytes()

  def run(self, eval_fn, params, steps: int | None = None) -> dict[str, float]:
    """val_loss and val_bpb from `eval_fn(params, batch)`'s sums over the first `steps` batches
    (default: run.eval_steps)."""
    per_batch = self.batch_sums(eval_fn, params, steps)
    return step_lib.summarize_eval({k: float(sum(b[k] for b in per_batch))
                                    for k in per_batch[0]})

  def batch_sums(self, eval_fn, params, steps: int | None = None) -> list[dict[str, float]]:
    """`eval_fn(params, batch)`'s sums of each of the first `steps` batches, in order (the
    same batches for any params: paired comparisons resample them)."""
    self.loader.set_state(self.start)
    out, pending = [], None
    for _, batch in zip(range(self.steps if steps is None else steps), self.loader):
      sums = eval_fn(params, step_lib.global_batch(batch, self.batch_sh))
      # At most two batches in flight, as in training: a deep queue of collective programs
      # can starve one of XLA:CPU's simulated devices past its rendezvous timeout.
      if pending is not None:
        out.append({k: float(v) for k, v in jax.device_get(pending).items()})
      pending = sums
    if pending is None:
      raise ValueError("the val split gave no batch; lower data.batch_size or data.seq_len")
    out.append({k: float(v) for k, v in jax.device_get(pending).items()})
    return out

  def score(self, params, steps: int | None = None) -> dict[str, float]:
    """`run` with the model's eval step, `params` (any tree the model runs: float or quantized,
    numpy or arrays) replicated over the mesh."""
    return self.run(*self._model_eval(params), steps)

  def score_batches(self, params, steps: int | None = None) -> list[dict[str, float]]:
    """`batch_sums` with the model's eval step (as `score`)."""
    return self.batch_sums(*self._model_eval(params), steps)

  def _model_eval(self, params):
    replicated = NamedSharding(self.batch_sh.mesh, PartitionSpec())
    eval_fn = step_lib.jit_eval_step(self.model_cfg, replicated, self.batch_sh, self.token_bytes)
    return eval_fn, jax.device_put(params, replicated)


@dataclasses.dataclass(frozen=True)
class _Parts:
  """What a run sets up before its first step."""
  run: RunConfig
  train_loader: Loader | DocumentLoader
  val: Validation
  setup: setup_lib.Setup
  eval_fn: Callable  # (eval parameters, batch) -> eval sums
  meta: dict  # saved with every checkpoint: model, config, layout and, with replicas, outer


def _loaders(run: RunConfig, mesh, workdir: str) -> tuple[Loader | DocumentLoader, Validation]:
  data = run.data
  if data.variable_length:  # whole documents, the same global batch on every process
    slots = hdp_step.slots(mesh)
    train = make_document_loader(data, "train", seed=run.seed, workdir=workdir,
                                 tokens_per_batch=hdp_step.loader_budget(
                                     hdp_step.micro_steps_per_step(run, slots)
                                     * slots * data.seq_len, data.max_len))
  else:
    block, blocks = _batch_block(mesh_lib.batch_sharding(mesh), data.batch_size)
    train = make_loader(data, "train", batch_size=data.batch_size, seed=run.seed,
                        process_index=block, process_count=blocks, workdir=workdir)
  if train.tokenizer.vocab_size > run.model.vocab_size:
    raise ValueError(f"model.vocab_size={run.model.vocab_size} is smaller than the "
                     f"{data.tokenizer} tokenizer's {train.tokenizer.vocab_size} tokens")
  return train, Validation(run, mesh, tokenizer=train.tokenizer, workdir=workdir)


def _set_up(run: RunConfig, workdir: str) -> _Parts:
  """Mesh, loaders, model, optimizers and their jitted steps; nothing restored or trained yet."""
  mesh = mesh_lib.make_mesh(run.mesh, comm_device.training_devices(run.outer.comm_device))
  logging.info("mesh: %s", mesh_lib.describe(mesh))
  train_loader, val = _loaders(run, mesh, workdir)
  setup = setup_lib.make_setup(run, mesh, train_loader)
  _log_setup(run, setup)
  meta = {"model": dataclasses.asdict(run.model), "config": run.to_dict()}
  if setup.outer is not None:
    meta["outer"] = {"view": "replica", "name": setup.outer.name, "replicas": setup.view.replicas,
                     "sync_every": setup.outer.sync_every}
  meta["layout"] = layouts.describe(setup.saved, setup.view,
                                    transformer.param_axes(run.model), setup.run_view)
  return _Parts(run, train_loader, val, setup, setup.eval_fn(val.token_bytes), meta)


def _log_setup(run: RunConfig, setup: setup_lib.Setup) -> None:
  """What the run composes, one line per strategy present."""
  comm = setup.comm
  logging.info("saved as %s; trained as %s; %d bytes sent per device per step", setup.view.form,
               " x ".join(setup.view.transforms) or "the canonical model",
               comm.grads_per_step + comm.pipeline_per_step)
  if run.parallel.hdp:
    logging.info("HDP: whole documents up to %d tokens, %d tokens per device per micro-step",
                 run.data.max_len, run.data.seq_len)
  if setup.schedule is not None:
    logging.info("pipeline: %s, routing %s", setup.schedule.summary(), setup.routing)
    if setup.schedule.executed.ticks <= 48:  # the chart of a longer one is too wide to read
      logging.info("pipeline ticks run (F forward, b backward, B/W its input/weight halves, "
                   ". idle):\n%s", setup.schedule.chart())
  if setup.outer is not None:
    logging.info("outer optimizer %s over %d replicas, sync every %d steps, %d bytes sent per "
                 "replica per round (at most %d at once)", setup.outer.name, setup.view.replicas,
                 setup.outer.sync_every, setup.outer.bytes_per_sync(comm.synced, setup.view.replicas),
                 setup.outer.peak_bytes_per_sync(comm.synced, setup.view.replicas))


def _restore_or_init(parts: _Parts, ckpts: list[Checkpointer]):
  """The newest step of `ckpts` (the workdir's checkpoints, then its RAM snapshots: the
  first wins a tie) with its loader position, else a fresh state."""
  steps = [(c.restore_step(parts.run.checkpoint.on_corrupt), c) for c in ckpts]
  latest, ckpt = max(((s, c) for s, c in steps if s is not None), key=lambda sc: sc[0],
                     default=(None, None))
  if latest is None:
    return _fresh_state(parts)
  return _restore_at(parts, ckpt, latest)


def _restore_at(parts: _Parts, ckpt: Checkpointer, latest: int):
  """The state and loader position at step `latest` of `ckpt`, in this run's view."""
  saved = ckpt.read_meta(latest)
  check_same_model(saved["model"], parts.meta["model"], ckpt.directory,
                   parts.run.model_changes)
  source = layouts.form_of(saved)
  preemption.pause_point("restore")
  if source == parts.setup.view.form:  # any mesh: orbax reads the pieces into this run's shardings
    state, data_state = ckpt.restore(latest, parts.setup.saved)
  else:
    state, data_state = _restore_converted(parts, ckpt, latest, source)
  parts.train_loader.set_state(data_state)
  logging.info("resumed from %s at step %d", ckpt.directory, latest)
  return parts.setup.from_saved(state)


def restore(config, workdir: str, step: int | None = None):
  """(setup, state): the run `config` would resume `workdir` with, in its own mesh and view,
  without training (for notebooks and tools). `step` None: the newest that verifies. The
  state is converted from whatever layout the checkpoint was saved in (`checkpoint.layouts`).
  """
  run = config_check.check_config(config, workdir)
  parts = _set_up(run, os.path.abspath(workdir))
  ckpt = Checkpointer(os.path.join(os.path.abspath(workdir), "checkpoints"))
  try:
    if step is None:
      step = ckpt.restore_step(run.checkpoint.on_corrupt)
    if step is None:
      raise ValueError(f"workdir {workdir} holds no checkpoint")
    state = _restore_at(parts, ckpt, step)
  finally:
    ckpt.close()
  return parts.setup, state


def _restore_converted(parts: _Parts, ckpt: Checkpointer, step: int, source: layouts.Form):
  """A checkpoint saved in another form (replicas <-> one model, another replica count or
  outer optimizer): its parameters and inner optimizer state, read into this mesh, then
  regrouped (`layouts.convert`); a fresh outer state. The saved outer state is not read."""
  setup = parts.setup
  target = setup.view.form
  how = parts.run.checkpoint.merge_replicas
  try:
    layouts.check_regroup(source.replicas, target.replicas)
  except ValueError as e:
    raise ValueError(f"cannot resume step {step} in {ckpt.directory}: {e}") from None
  one = setup.one
  mesh = setup.mesh
  read = {"step": one.step, **{k: layouts.stacked_target(getattr(one, k), source.replicas, mesh)
                               for k in ("params", "opt_state")}}
  got, data_state = ckpt.restore(step, read, partial=True)

  def convert(got):
    params, opt_state = layouts.convert(setup.optimizer, got["params"], got["opt_state"],
                                        source, target, how)
    return setup.assemble(got["step"], params, opt_state)
  state = jax.jit(convert, out_shardings=jax.tree.map(lambda x: x.sharding,
                                                      setup.saved))(got)
  logging.warning("checkpoint step %d was saved as %s, this run trains %s: %s", step, source,
                  target, "replicas merged by " + how if source.replicas > target.replicas
                  else "parameters and inner optimizer state copied, outer state fresh")
  return state, data_state


def _fresh_state(parts: _Parts):
  """A state from run.seed; with run.init_from, at that run's latest parameters
  (replica 0's for a replica run: the ones its evals scored). A resume never is."""
  setup, run = parts.setup, parts.run
  state = setup.init_state(run.seed)
  if not run.init_from:
    return state
  hf_dir = hf.parse_spec(run.init_from)
  if hf_dir is not None:  # check_config already took the run's model config from it
    _, params = hf.load(hf_dir, run.model, shardings=setup.param_sh)
    logging.info("init_from: Hugging Face checkpoint %s", hf_dir)
    return setup.start_from(state, params)
  saved = read_params(run.init_from, expect_model=parts.meta["model"],
                      allow_model_change=run.model_changes)
  if saved is None:
    raise ValueError(f"init_from={run.init_from!r} holds no checkpoint; it must be a run's "
                     "workdir or its checkpoints dir, or '' to start from random parameters")
  logging.info("init_from: parameters of step %d in %s", saved.step, saved.directory)
  params = jax.device_put(saved.one(), setup.param_sh)
  return setup.start_from(state, params)


class _Loop:
  """The step loop's state: the train state, its step, metrics still on device, hooks."""

  def __init__(self, parts: _Parts, state, ckpt: Checkpointer, workdir: str,
               snapshots: Checkpointer | None = None):
    self.parts, self.config, self.state, self.ckpt = parts, parts.run, state, ckpt
    self.snapshots = snapshots
    self.snapshot_every = self.config.checkpoint.snapshot_every
    self.step = self.saved_step = int(jax.device_get(state.step))
    self.schedule = make_schedule(self.config.optimizer, self.config.total_steps)
    self.meter = _throughput_meter(self.config)
    self.writer = metrics_lib.MetricWriter(workdir, resume_step=self.step)
    self.progress = metrics_lib.Progress(self.config.total_steps, self.step)
    self.pending: list[tuple[int, dict]] = []  # step metrics still on device
    # HDP's gradient all-reduces (`grad_reductions`, with replicas their mean) over the
    # steps logged: their sum and count, for comm_bytes.
    self.reductions = [0.0, 0]
    # A sync deferred to the next step (CO2): fused into its program, or launched on the
    # communication twins just before it; run on its own before an eval or a save.
    self.sync_due = False
    self.fused = None if parts.setup.off_device_sync else parts.setup.sync_train_fn
    self.last_eval: dict[str, float] = {}
    self.profiler = profile_lib.Profiler(profile_lib.parse_steps(self.config.profile.steps),
                                         os.path.join(workdir, "profile"))

  def run(self, stop: _Stop) -> bool:
    """Steps to run.total_steps; True when `stop` ended the run early, after saving."""
    batches = iter(self.parts.train_loader)
    preemption.pause_point("first_step")
    while self.step < self.config.total_steps:
      with self.profiler.step(self.step + 1, lambda: self.state):
        self._train_step(next(batches))
      stop.stepped()  # compiled and launched: SIGTERM from here saves this step
      self._hooks()
      if self.step < self.config.total_steps and stop(self.step):
        if self.saved_step != self.step:
          self._save()
        return True
    return False

  def close(self) -> None:
    self.profiler.stop()
    self.progress.close()
    self.writer.close()

  def _train_step(self, batch) -> None:
    """One step (with a deferred sync fused in), keeping at most two steps in flight."""
    setup = self.parts.setup
    batch = setup.batch_fn(batch)
    if self.sync_due and self.fused is not None:
      self.state, m = self.fused(self.state, batch)
      self.sync_due = False
    else:
      self._flush_sync()  # on twins: launched here, after the due step's row was logged
      self.state, m = setup.train_fn(self.state, batch)
    self.step += 1
    if setup.outer is not None and setup.outer.due(self.step):
      if self.fused is None and setup.off_device_sync is None:
        self.state = setup.sync_fn(self.state)
      else:
        self.sync_due = True
    self.pending.append((self.step, m))
    if len(self.pending) > 1:
      # At most two steps in flight. A deep queue of collective programs can deadlock
      # XLA:CPU's simulated devices (threads blocked in a later step's rendezvous starve
      # a device still in an earlier one); on accelerators one step ahead is enough.
      jax.block_until_ready(self.pending[-2][1])
    self.meter.step_done(m)

  def _hooks(self) -> None:
    run, step = self.config, self.step
    last = step == run.total_steps
    if step % run.log_every == 0 or last:
      self._log()
    else:
      self.progress.update(step)
    evaluate = run.eval_every and (step % run.eval_every == 0 or last)
    save = last or (run.checkpoint_every and step % run.checkpoint_every == 0)
    if evaluate or save:
      self._flush_sync()  # a deferred sync is training: on the step clock, not the paused one
    with self.meter.paused_timer():
      if evaluate:
        self._evaluate()
      if save:
        self._save()
      elif self.snapshots and step % self.snapshot_every == 0:
        self._save(self.snapshots)

  def _flush_sync(self) -> None:
    if self.sync_due:
      setup = self.parts.setup
      self.state = (setup.off_device_sync or setup.sync_fn)(self.state)
      self.sync_due = False

  def _log(self) -> None:
    """Fetches pending metrics (a non-finite loss stops the run here) and writes a row."""
    steps, metrics = zip(*self.pending)
    for m in metrics:  # a host value: never fetched
      if "grad_reductions" in m:
        self.reductions[0] += float(m.pop("grad_reductions"))
        self.reductions[1] += 1
    fetched = [(s, grads.replica_totals(m)) for s, m in zip(steps, _to_host(list(metrics)))]
    self.pending.clear()
    _check_finite_metrics(fetched, self.ckpt)
    m = fetched[-1][1]
    # `time` (unix seconds, the step's end): loss against wall-clock, the network lab's
    # step windows.
    row = {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
           "lr": float(self.schedule(self.step - 1)), "time": time.time(),
           **self._comm_bytes(), **self.meter.rates()}
    self.writer.write(self.step, row)
    self.progress.update(self.step,
                         **{k: row[k] for k in ("loss", "tokens_per_s", "mfu") if k in row})

  def _comm_bytes(self) -> dict[str, float]:
    """Bytes one device has sent so far, every collective; with an outer optimizer also
    its syncs' alone (what crosses the replicas' slow links)."""
    comm = self.parts.setup.comm
    total, steps = self.reductions
    out = {"comm_bytes": float(comm.after(self.step, total / steps if steps else 1.0))}
    if comm.outer is not None:
      out["outer_bytes"] = float(comm.outer_after(self.step))
    return out

  def _evaluate(self) -> None:
    self._flush_sync()
    parts = self.parts
    ev = parts.val.run(parts.eval_fn, parts.setup.eval_params(self.state.params))
    ev.update(self._comm_bytes(), time=time.time())
    self.writer.write(self.step, ev)
    self.last_eval = ev
    logging.info("step %d: val_loss=%.4f val_bpb=%.4f", self.step, ev["val_loss"], ev["val_bpb"])

  def _save(self, ckpt: Checkpointer | None = None) -> None:
    """A checkpoint of this step into `ckpt` (default: the workdir's)."""
    if self.pending:  # never save without checking the losses that led here
      self._log()
    self._flush_sync()
    if self.parts.setup.off_device_sync is not None:  # the average in flight, into the state
      self.state = self.parts.setup.off_device_sync.land(self.state)
    _check_finite_params(self.state.params, self.step, self.ckpt)
    saved = self.parts.setup.to_saved(self.state)
    (ckpt or self.ckpt).save(self.step, saved, data=self.parts.train_loader.get_state(),
                             meta=self.parts.meta, force=True)
    if ckpt is None:  # a snapshot in RAM does not survive the machine: SIGTERM still saves
      self.saved_step = self.step


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Checks `config` (an ml_collections config, configs/tiny_lm.py's fields) and `train`s it."""
  return train(config_check.check_config(config, workdir), workdir)


def train(run: RunConfig, workdir: str) -> dict[str, Any]:
  """Trains `run` in `workdir`, resuming from its latest checkpoint; returns final metrics.

  `result["preempted"]` is True when SIGTERM stopped the run before `total_steps` (its
  state saved at `result["step"]`, where the next run with this workdir resumes).
  """
  workdir = os.path.abspath(workdir)
  # One run per workdir (process 0 holds the lock for all of its processes).
  lock = WorkdirLock(workdir) if jax.process_index() == 0 else contextlib.nullcontext()
  snapshot_every = run.checkpoint.snapshot_every
  if snapshot_every and jax.process_count() > 1:
    raise ValueError(f"checkpoint.snapshot_every={snapshot_every} needs one process (a RAM "
                     f"directory is local to its host), but this run has {jax.process_count()}; "
                     "set it to 0")
  with _stop_requests() as stop, lock:
    check_entries(os.path.join(workdir, "checkpoints"))  # before the set-up's seconds
    preemption.pause_point("set_up")
    parts = _set_up(run, workdir)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=run.keep_checkpoints)
    # The newest snapshot only, in RAM: it survives the process, not the machine.
    snapshots = (Checkpointer(snapshot_dir(workdir, run.checkpoint.snapshot_dir), keep=1)
                 if snapshot_every else None)
    ckpts = [c for c in (ckpt, snapshots) if c is not None]
    try:
      if jax.process_index() == 0:
        for c in ckpts:
          c.remove_partial_saves()
      loop = _Loop(parts, _restore_or_init(parts, ckpts), ckpt, workdir, snapshots)
      try:
        preempted = loop.run(stop)
      finally:
        loop.close()
    finally:
      for c in ckpts:
        c.close()
    if snapshots is not None:  # the run saved its last step to disk: the RAM copy is spent
      shutil.rmtree(snapshots.directory, ignore_errors=True)
  return {"workdir": workdir, "checkpoints": ckpt.directory, "metrics": loop.writer.path,
          "tensorboard": loop.writer.tb_dir, **loop.last_eval, "step": loop.step,
          "preempted": preempted, "profile": loop.profiler.written}
