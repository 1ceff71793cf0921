"""Orbax checkpoints of a training run: state, data-loader position and run metadata.

Each step directory holds three items: `state` (the TrainState pytree, saved
asynchronously and restored straight into the shardings of the current mesh),
`data` (the loader position, JSON) and `meta` (the model config, JSON, checked
before anything is restored so a checkpoint of another model is refused).
`reader.read_params` reads only the parameters, for evaluation and `init_from`.
Once a step has committed, process 0 seals it (`integrity.seal`: every file's CRC-32);
`restore_step` verifies a step before anything of it is read.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from jaxsys import storage
from jaxsys.checkpoint import integrity


class CorruptCheckpoint(ValueError):
  """A step's files fail their checksums (a ValueError: the binaries print one line)."""


def corrupt_step(step: int, directory: str, problem: str) -> str:
  """How every corrupt-step error starts: the step, its directory, what fails."""
  return f"checkpoint step {step} in {directory} is corrupt: {problem}"


# How the state's arrays are stored: uncompressed, in OCDBT data files of 64 MiB. orbax's
# default zstd saves ~7% of float32 bytes but holds a save to 16% of this machine's disk
# bandwidth at 100M parameters (77% without it): experiments/bench_checkpoint.py.
STATE_OPTIONS = {"use_compression": False, "ocdbt_target_data_file_size": 64 << 20}


class Checkpointer:
  """Keeps the last `keep` checkpoints of a run under `directory`.

  `state_options`: orbax `PyTreeCheckpointHandler` options for the state item, plus
  `ocdbt_target_data_file_size` (default STATE_OPTIONS). Any of them restores the others.
  """

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True,
               state_options: dict | None = None):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    state_options = dict(STATE_OPTIONS if state_options is None else state_options)
    self._file_bytes = state_options.pop("ocdbt_target_data_file_size", None)
    handler = ocp.PyTreeCheckpointHandler(**state_options)
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for args in (ocp.args.PyTreeSave, ocp.args.PyTreeRestore):
      registry.add("state", args, handler)
    for item in ("data", "meta"):
      for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
        registry.add(item, args, ocp.JsonCheckpointHandler)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          handler_registry=registry)
    self._unsealed: list[int] = []  # saves started, not yet seen committed
    # Sealing reads a whole step (about 1 s per GB): a thread of its own, off the loop,
    # that seals each step as soon as it commits.
    self._sealer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxsys-seal")
    self._sealing: list[concurrent.futures.Future] = []
    # The newest step whose save has ended, committed or failed: a seal waiting for a step
    # up to it that never appeared gives up.
    self._settled = -1
    self._last_started = -1

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _forget_committed(self, wait: bool = False) -> None:
    """Forgets the saves seen committed (their directories exist: orbax renames a step's
    temporary directory into place last). wait: until every seal started is written (its
    errors raised here)."""
    self._unsealed = [s for s in self._unsealed if not os.path.isdir(self.step_dir(s))]
    if wait:
      sealing, self._sealing = self._sealing, []
      for future in sealing:
        future.result()

  def _seal_when_committed(self, step: int) -> None:
    """(The sealer thread.) Seals `step` as soon as it commits; returns if its save ends
    without committing."""
    path = self.step_dir(step)
    while not os.path.isdir(path):
      if self._settled >= step:
        return
      time.sleep(0.01)
    try:
      integrity.seal(path)
    except FileNotFoundError:  # deleted meanwhile (max_to_keep): nothing to seal
      pass

  def problem(self, step: int) -> str | None:
    """None when `step` verifies against its checksums; else what fails (see integrity)."""
    return integrity.problem(self.step_dir(step))

  def restore_step(self, on_corrupt: str = "error") -> int | None:
    """The step to resume from: the latest, if it verifies (or has no checksums: restored
    unverified, with a warning). A corrupt latest step stops with one line naming the
    file and the newest earlier step that verifies, or, with on_corrupt="previous",
    resumes from that step with a warning."""
    steps = sorted(self.all_steps(), reverse=True)
    if not steps:
      return None
    bad = self.problem(steps[0])
    if bad is None:
      return steps[0]
    if bad == integrity.UNSEALED:
      logging.warning("checkpoint step %d in %s: %s; restoring it unverified", steps[0],
                      self.directory, bad)
      return steps[0]
    good = next((s for s in steps[1:] if self.problem(s) in (None, integrity.UNSEALED)), None)
    where = corrupt_step(steps[0], self.directory, bad)
    if good is None:
      raise CorruptCheckpoint(f"{where}; no earlier step verifies (steps there: "
                              f"{sorted(steps)}); use another --workdir to start afresh")
    if on_corrupt != "previous":
      raise CorruptCheckpoint(f"{where}; step {good} verifies: set "
                              "--config.checkpoint.on_corrupt=previous to resume from it")
    # The newer steps move aside (kept, never deleted), so this run can save them anew.
    if jax.process_index() == 0:
      for step in (s for s in steps if s > good):
        aside = f"{self.step_dir(step)}.corrupt"
        os.rename(self.step_dir(step), aside)
        logging.warning("moved step %d aside to %s", step, aside)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("jaxsys: corrupt steps moved aside")
    self._manager.reload()
    logging.warning("%s; resuming from step %d, which verifies", where, good)
    return good

  def remove_partial_saves(self) -> list[str]:
    """Deletes what saves that never committed left behind (orbax's
    `<step>.orbax-checkpoint-tmp*` directories: never a checkpoint); returns their paths.
    Only for the run that holds the workdir's lock: another run's save may be in flight."""
    removed = []
    for name in sorted(os.listdir(self.directory)):
      if ".orbax-checkpoint-tmp" in name:
        path = os.path.join(self.directory, name)
        logging.warning("removing %s: a save that never committed", path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  # The save that failed, as raised: orbax raises its error again on every later wait.
  _failure: storage.WriteError | None = None

  def save(self, step: int, state: Any, *, data: dict, meta: dict, force: bool = False) -> bool:
    """Starts an asynchronous save; returns whether one was started.

    A save that cannot be written (a full disk), this one or the previous one (written in
    the background until now), raises storage.WriteError: one line naming its step, the
    system's reason and the committed steps, which a failed save never touches."""
    args = ocp.args.Composite(
        state=ocp.args.PyTreeSave(state, ocdbt_target_data_file_size=self._file_bytes),
        data=ocp.args.JsonSave(data), meta=ocp.args.JsonSave(meta))
    self.wait(sealed=False)  # as orbax's save would, but naming the step that failed
    try:
      started = self._manager.save(step, args=args, force=force)
    except Exception as e:
      if storage.os_errno(e) is None:
        raise
      raise self._failed_save(step, e) from e
    if started:
      self._unsealed.append(step)
      self._last_started = step
      if jax.process_index() == 0:
        self._sealing.append(self._sealer.submit(self._seal_when_committed, step))
    # The saves before this one have finished by now; a synchronous one has too.
    self._forget_committed()
    return started

  def read_meta(self, step: int) -> dict:
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, step: int, abstract_state: Any, *, partial: bool = False) -> tuple[Any, dict]:
    """(state, data position) at `step`; `abstract_state` leaves carry the target shardings.
    Each process reads only the pieces its devices hold. partial: `abstract_state` may
    name a subset of the saved tree (e.g. a dict of some of its fields)."""
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        abstract_state)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
            target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=partial),
        data=ocp.args.JsonRestore()))
    path = self.step_dir(step)
    if jax.process_index() == 0 and not integrity.is_sealed(path):
      # Committed but never sealed (a run killed before the manifest) and read without
      # error: sealed now, so that a change to its files from now on is caught.
      integrity.seal(path)
      logging.info("checkpoint step %d in %s: sealed after restoring it", step, self.directory)
    return restored["state"], restored["data"]

  def wait(self, *, sealed: bool = True) -> None:
    """Blocks until the saves started have committed and, with `sealed`, their checksums
    are written. A save that failed raises storage.WriteError (see `save`)."""
    if self._failure is not None:
      raise self._failure
    try:
      self._manager.wait_until_finished()
    except Exception as e:
      if storage.os_errno(e) is None:
        raise
      uncommitted = [s for s in self._unsealed if not os.path.isdir(self.step_dir(s))]
      raise self._failed_save(max(uncommitted, default=None), e) from e
    finally:
      self._settled = self._last_started
    if sealed:
      try:
        self._forget_committed(wait=True)
      except OSError as e:
        raise storage.WriteError(f"writing checksums.json of a step in {self.directory}", e,
                                 after="its checkpoint is committed and restores unverified") from e

  def close(self) -> None:
    """`wait`, then stops orbax's threads. A failure while another exception propagates
    (close runs in a `finally`) is logged in one line instead: it never masks that one."""
    propagating = sys.exc_info()[1]
    try:
      if self._failure is None:  # a failed save is raised once, where it was found
        self.wait()
    except Exception as e:
      if propagating is None:
        raise
      logging.error("closing the checkpoints in %s: %s", self.directory, e)
    finally:
      self._settled = self._last_started  # no seal waits for a save that failed
      self._sealer.shutdown()
      try:
        self._manager.close()
      except Exception:
        if self._failure is None:  # else orbax raises the failed save's error again
          raise

  def _failed_save(self, step: int | None, error: BaseException) -> storage.WriteError:
    """The one-line error of a save that failed to write. Its partial directory stays, for
    a later run to remove: tensorstore may still be writing the pieces that had not failed
    yet, and would recreate it."""
    self._unsealed = [s for s in self._unsealed if s != step]
    # From the directory: orbax already forgot the steps this save was to replace
    # (max_to_keep), though it deletes them only once a save has committed.
    kept = sorted(int(n) for n in os.listdir(self.directory) if n.isdigit() and int(n) != step)
    after = f"older checkpoints are intact: steps {kept}" if kept else "no earlier checkpoint"
    what = "a checkpoint" if step is None else f"checkpoint step {step}"
    self._failure = storage.WriteError(f"saving {what} to {self.directory}", error, after)
    return self._failure


def snapshot_dir(workdir: str, configured: str = "") -> str:
  """Where a run's RAM snapshots live: `configured`, else a directory on /dev/shm (the
  system temp dir without it) named by a hash of the workdir, so a restart finds it and
  two runs never share it."""
  if configured:
    return os.path.abspath(configured)
  ram = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
  digest = hashlib.sha1(os.path.abspath(workdir).encode()).hexdigest()[:16]
  return os.path.join(ram, "jaxsys-snapshots", digest)


# Model fields that change parameter shapes or types: a checkpoint of another value is
# another model. remat and attention_impl may differ (same function, other schedule).
SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                "tie_embeddings", "param_dtype")
# Fields that keep the shapes but change the function the parameters compute: a resume or
# init_from with another value only when the run names the field in `allow_model_change`.
NUMERIC_FIELDS = ("rope_theta", "norm_eps", "dtype")


def _differences(fields, saved: dict, current: dict) -> str:
  return ", ".join(f"model.{k}={saved.get(k)!r} there but {current.get(k)!r} in the config"
                   for k in fields)


def check_same_model(saved: dict, current: dict, directory: str,
                     allow: tuple[str, ...] = ()) -> None:
  """Refuses a checkpoint whose model differs from `current` in shape, or in numerics not allowed.

  `allow`: the run config's `allow_model_change`, names from NUMERIC_FIELDS (checked there).
  """
  diff = [k for k in SHAPE_FIELDS if saved.get(k) != current.get(k)]
  if diff:
    detail = _differences(diff, saved, current)
    raise ValueError(f"checkpoint in {directory} is of a different model: {detail}; "
                     "use another --workdir or a matching --config")
  diff = [k for k in NUMERIC_FIELDS if saved.get(k) != current.get(k) and k not in allow]
  if diff:
    detail = _differences(diff, saved, current)
    raise ValueError(f"checkpoint in {directory} computes another function: {detail}; set "
                     f"--config.allow_model_change={','.join(diff)} to continue with the config's "
                     "value, or use a matching --config")
