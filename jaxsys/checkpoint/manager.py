"""Orbax checkpoints of a training run: state, data-loader position and run metadata.

Each step directory holds three items: `state` (the TrainState pytree, saved
asynchronously and restored straight into the shardings of the current mesh),
`data` (the loader position, JSON) and `meta` (the model config, JSON, checked
before anything is restored so a checkpoint of another model is refused).
`reader.read_params` reads only the parameters, for evaluation and `init_from`.
A step commits with its checksums: process 0 writes the manifest (`integrity.seal`:
every file's CRC-32) into orbax's temporary directory, in orbax's background commit,
just before the rename that commits the step; meta records the step and the loader
position (`integrity.record`). Then the manifest's sha256 is appended to the ledger
beside the steps (`ledger`: `<directory>/ledger.jsonl`, hash-chained, fsynced), and only
then is the step renamed into place. A step is verified, against its checksums and the
ledger, before anything of it is read.
"""
from __future__ import annotations

import asyncio
import errno
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
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.metadata import checkpoint as orbax_metadata
from orbax.checkpoint._src.path import async_path, atomicity

from jaxsys import storage
from jaxsys.checkpoint import integrity, ledger


class CorruptCheckpoint(ValueError):
  """A step's files fail their checksums (a ValueError: the binaries print one line)."""


def corrupt_step(step: int, directory: str, problem: str) -> str:
  """How every corrupt-step error starts: the step, its directory, what fails."""
  return f"checkpoint step {step} in {directory} is corrupt: {problem}"


def check_step(directory: str, step: int, problem: str | None, *, doing: str = "restoring",
               hint: str = "") -> None:
  """Raises CorruptCheckpoint for `step`'s `problem` (`ledger.problem`) unless it is None
  or one of ledger.WARNINGS: a legacy step passes with a warning that it is `doing`
  unverified (never sealed after the fact: its files may have changed since its save), a
  step the ledger cannot vouch for (no ledger, or older than it) with a warning that says
  so (one line: only the step restored is checked here)."""
  if problem == integrity.LEGACY:
    logging.warning("checkpoint step %d in %s: %s; %s it unverified", step, directory, problem,
                    doing)
  elif problem in ledger.WARNINGS:
    logging.warning("checkpoint step %d in %s: %s; %s it", step, directory, problem, doing)
  elif problem is not None:
    raise CorruptCheckpoint(corrupt_step(step, directory, problem) + hint)


class BadCheckpointDir(ValueError):
  """An entry of the checkpoint directory that no save or restore could use (a broken
  link, a file where a step directory belongs): one line, at start-up."""


def check_entries(directory: str) -> None:
  """Refuses, naming it, what would make a later save or restore fail without saying
  where: `directory`, or an entry of it named after a step (`10`, `10.corrupt`, orbax's
  `10.orbax-checkpoint-tmp-*`), that is a dangling or looping symlink or not a directory
  (`ln -s /nonexistent checkpoints/10` failed the save of step 10 with errno 20)."""
  paths = [directory] if os.path.lexists(directory) else []
  if os.path.isdir(directory):
    paths += [os.path.join(directory, n) for n in sorted(os.listdir(directory))
              if n.isdigit() or (n.split(".", 1)[0].isdigit() and (
                  n.endswith(".corrupt") or ".orbax-checkpoint-tmp" in n))]
  for path in paths:
    if os.path.isdir(path):
      continue
    valid = (f"every entry of {os.path.dirname(path)} named after a step must be a checkpoint "
             "directory" if path != directory else "it must be a directory (or absent)")
    if os.path.islink(path):
      try:
        os.stat(path)
        why = "is not a directory"
      except OSError as e:
        why = "loops (too many levels of symbolic links)" if e.errno == errno.ELOOP else (
            "does not exist")
      raise BadCheckpointDir(f"{path} is a symbolic link to {os.readlink(path)!r}, which {why}; "
                             f"{valid}: remove the link (or restore what it points to), then "
                             "run again")
    raise BadCheckpointDir(f"{path} is a file, not a directory; {valid}: move it away, then "
                           "run again")


# How the state's arrays are stored: uncompressed, in OCDBT data files of 64 MiB. orbax's
# default zstd saves ~7% of float32 bytes but holds a save to 16% of this machine's disk
# bandwidth at 100M parameters (77% without it): experiments/bench_checkpoint.py.
STATE_OPTIONS = {"use_compression": False, "ocdbt_target_data_file_size": 64 << 20}

# orbax splits a replicated array's write over its replicas, each writing a slice: one
# slice program per shape and one dispatch per shard. Below a slice of this size that buys
# no bandwidth and costs the most: the test model on 8 devices compiled 72 slice programs
# and spent about 0.5 s of CPU a save slicing (an 8-step run saving every step: 8.9-9.9 s
# of user CPU, 7.3-7.4 s without).
MIN_REPLICA_SLICE_BYTES = 1 << 20


def _type_handlers() -> ocp.type_handlers.TypeHandlerRegistry:
  """orbax's default handlers, with arrays split over replicas only in slices of at least
  MIN_REPLICA_SLICE_BYTES."""
  registry = ocp.type_handlers.create_type_handler_registry(*(
      (ty, ocp.type_handlers.get_type_handler(ty)) for ty in ocp.type_handlers.supported_types()))
  registry.add(jax.Array, ocp.type_handlers.ArrayHandler(
      min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
      array_metadata_store=array_metadata_store.Store()), override=True)
  return registry


class _CommitWithChecksums(atomicity.AtomicRenameTemporaryPath):
  """orbax's commit of a step (its temporary directory renamed into place), with the
  step's manifest written into that directory last, just before the rename: no step
  directory of this version exists without it, even after a kill. Runs where orbax
  commits: its background thread for an asynchronous save, off the training loop."""

  async def finalize(self):
    # orbax uses this class for the items inside the step too (state, data, meta): those
    # commit as before; the step itself is the directory named by its number.
    if not self._final_path.name.isdigit():
      return await super().finalize()
    # As AtomicRenameTemporaryPath.finalize (orbax 0.12.8), the manifest before the rename.
    store = self._checkpoint_metadata_store
    if store:
      await asyncio.to_thread(store.wait_until_finished)
      await asyncio.to_thread(store.update,
                              file_path=orbax_metadata.step_metadata_file_path(self._tmp_path),
                              commit_timestamp_nsecs=time.time_ns())
      await asyncio.to_thread(store.wait_until_finished)
    await async_path.write_text(self._tmp_path / atomicity.COMMIT_SUCCESS_FILE,
                                f"Checkpoint commit was successful to {self._final_path}")
    await asyncio.to_thread(integrity.seal, os.fspath(self._tmp_path))
    # The ledger entry is durable (written and fsynced) before the rename: a committed step
    # always has its entry. A crash between the two leaves an entry for a step that never
    # committed: harmless (its temporary directory is removed at the next start, and a later
    # save of that step appends a newer entry, the one checked). The reverse order would
    # let a crash leave a committed step without its entry, which a resume could not tell
    # from a step whose entry was removed to hide a rewrite.
    await asyncio.to_thread(ledger.enter, os.fspath(self._tmp_path),
                            os.fspath(self._final_path.parent), int(self._final_path.name))
    await async_path.rename(self._tmp_path, self._final_path)


class Checkpointer:
  """Keeps the last `keep` checkpoints of a run under `directory`.

  `state_options`: orbax `PyTreeCheckpointHandler` options for the state item, plus
  `ocdbt_target_data_file_size` (default STATE_OPTIONS). Any of them restores the others.
  """

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True,
               state_options: dict | None = None):
    self.directory = os.path.abspath(directory)
    check_entries(self.directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save,
                                           temporary_path_class=_CommitWithChecksums)
    state_options = dict(STATE_OPTIONS if state_options is None else state_options)
    self._file_bytes = state_options.pop("ocdbt_target_data_file_size", None)
    handler = ocp.PyTreeCheckpointHandler(**state_options, type_handler_registry=_type_handlers())
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for args in (ocp.args.PyTreeSave, ocp.args.PyTreeRestore):
      registry.add("state", args, handler)
    for item in ("data", "meta"):
      for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
        registry.add(item, args, ocp.JsonCheckpointHandler)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          handler_registry=registry)
    self._pending: list[int] = []  # saves started, not yet seen committed
    self._verified: set[int] = set()  # steps checked here: restore reads them unchecked

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def problem(self, step: int) -> str | None:
    """None when `step` verifies against its checksums and the ledger; else what fails
    (see integrity and ledger). A ledger whose chain does not verify raises
    ledger.CorruptLedger."""
    return ledger.problem(self.directory, step, ledger.read(self.directory))

  def restore_step(self, on_corrupt: str = "error") -> int | None:
    """The step to resume from: the latest, if it verifies against its checksums and the
    ledger (or was saved by a version before checksums or before the ledger: restored
    with a one-line warning). A ledger whose chain is broken stops with one line naming
    the entry (ledger.CorruptLedger). A corrupt latest step stops
    with one line naming the file and the newest earlier step that verifies, or, with
    on_corrupt="previous", resumes from that step with a warning."""
    # A ledger whose chain is broken refuses the run whatever on_corrupt says: it cannot
    # tell a good step from a rewritten one (and a run appending to it would bury the break).
    entries = ledger.read(self.directory)
    steps = sorted(self.all_steps(), reverse=True)
    if not steps:
      return None
    problems = {}

    def usable(step):
      problems[step] = ledger.problem(self.directory, step, entries)
      return problems[step] is None or problems[step] in ledger.WARNINGS
    good = next((s for s in steps if usable(s)), None)
    if good == steps[0]:
      self._accept(good, problems[good])
      return good
    where = corrupt_step(steps[0], self.directory, problems[steps[0]])
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
    self._accept(good, problems[good])
    return good

  def _accept(self, step: int, problem: str | None, hint: str = "") -> None:
    """`check_step`, then remembers `step` as checked: `restore` reads it unchecked."""
    check_step(self.directory, step, problem, hint=hint)
    self._verified.add(step)

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
    # The step and the loader position, twice: a position changed after the save fails
    # verification (integrity._record_problem) even with the manifest recomputed.
    meta = {**meta, integrity.RECORD: integrity.record(step, data, ledger=ledger.NAME)}
    args = ocp.args.Composite(
        state=ocp.args.PyTreeSave(state, ocdbt_target_data_file_size=self._file_bytes),
        data=ocp.args.JsonSave(data), meta=ocp.args.JsonSave(meta))
    self.wait()  # as orbax's save would, but naming the step that failed
    try:
      started = self._manager.save(step, args=args, force=force)
    except Exception as e:
      if storage.os_errno(e) is None:
        raise
      raise self._failed_save(step, e) from e
    if started:
      self._pending.append(step)
      self._verified.discard(step)
    return started

  def read_meta(self, step: int) -> dict:
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, step: int, abstract_state: Any, *, partial: bool = False) -> tuple[Any, dict]:
    """(state, data position) at `step`; `abstract_state` leaves carry the target shardings.
    Each process reads only the pieces its devices hold. partial: `abstract_state` may
    name a subset of the saved tree (e.g. a dict of some of its fields). A step that
    `restore_step` did not choose is verified first."""
    if step not in self._verified:
      self._accept(step, self.problem(step),
                   hint=f"; restore another step (steps there: {sorted(self.all_steps())})")
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        abstract_state)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
            target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=partial),
        data=ocp.args.JsonRestore()))
    return restored["state"], restored["data"]

  def wait(self) -> None:
    """Blocks until the saves started have committed, each with its checksums. A save
    that failed raises storage.WriteError (see `save`)."""
    if self._failure is not None:
      raise self._failure
    try:
      self._manager.wait_until_finished()
    except Exception as e:
      if storage.os_errno(e) is None:
        raise
      uncommitted = [s for s in self._pending if not os.path.isdir(self.step_dir(s))]
      raise self._failed_save(max(uncommitted, default=None), e) from e
    self._pending = []

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
      try:
        self._manager.close()
      except Exception:
        if self._failure is None:  # else orbax raises the failed save's error again
          raise

  def _failed_save(self, step: int | None, error: BaseException) -> storage.WriteError:
    """The one-line error of a save that failed to write. Its partial directory stays, for
    a later run to remove: tensorstore may still be writing the pieces that had not failed
    yet, and would recreate it."""
    self._pending = [s for s in self._pending if s != step]
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
                "tie_embeddings", "qkv_bias", "qk_norm", "param_dtype")
# Fields that keep the shapes but change the function the parameters compute: a resume or
# init_from with another value only when the run names the field in `allow_model_change`.
NUMERIC_FIELDS = ("rope_theta", "rope_scaling", "sliding_window", "norm_eps", "dtype")
# Fields added after checkpoints were first written, with what their absence means.
ADDED_LATER = {"rope_scaling": "", "qkv_bias": False, "qk_norm": False, "sliding_window": 0}


def _differences(fields, saved: dict, current: dict) -> str:
  return ", ".join(f"model.{k}={saved.get(k)!r} there but {current.get(k)!r} in the config"
                   for k in fields)


def check_same_model(saved: dict, current: dict, directory: str,
                     allow: tuple[str, ...] = ()) -> None:
  """Refuses a checkpoint whose model differs from `current` in shape, or in numerics not allowed.

  `allow`: the run config's `allow_model_change`, names from NUMERIC_FIELDS (checked there).
  """
  saved = {**ADDED_LATER, **saved}
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
