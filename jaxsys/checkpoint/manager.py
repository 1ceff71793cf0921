"""Orbax checkpoints of a training run: state, data-loader position and run metadata.

Each step directory holds three items: `state` (the TrainState pytree, saved
asynchronously and restored straight into the shardings of the current mesh),
`data` (the loader position, JSON) and `meta` (the model config, JSON, checked
before anything is restored so a checkpoint of another model is refused).
"""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpointer:
  """Keeps the last `keep` checkpoints of a run under `directory`."""

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "data", "meta"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, *, data: dict, meta: dict, force: bool = False) -> bool:
    """Starts an asynchronous save; returns whether one was started."""
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data),
                              meta=ocp.args.JsonSave(meta))
    return self._manager.save(step, args=args, force=force)

  def read_meta(self, step: int) -> dict:
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """(state, data position) at `step`; `abstract_state` leaves carry the target shardings."""
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        abstract_state)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
    return restored["state"], restored["data"]

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def check_same_model(saved: dict, current: dict, directory: str, fields) -> None:
  """Refuses to resume a checkpoint whose model differs in any of `fields` (those that set shapes)."""
  diff = [k for k in fields if saved.get(k) != current.get(k)]
  if diff:
    detail = ", ".join(f"model.{k}={saved.get(k)!r} there but {current.get(k)!r} in the config"
                       for k in diff)
    raise ValueError(f"checkpoint in {directory} is of a different model: {detail}; "
                     "use another --workdir or a matching --config")


def _read_only(directory: str) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(create=False, read_only=True)
  return ocp.CheckpointManager(directory, options=options,
                               item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                                              "meta": ocp.JsonCheckpointHandler()})


def latest_meta(directory: str) -> tuple[int, dict] | None:
  """(latest step, its meta) of the checkpoints under `directory`, read-only; None if none."""
  manager = _read_only(directory)
  try:
    step = manager.latest_step()
    if step is None:
      return None
    return step, manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  finally:
    manager.close()


def read_params(directory: str, step: int, abstract_params: Any) -> Any:
  """Only the `params` of the state saved at `step`, as numpy arrays shaped like `abstract_params`."""
  manager = _read_only(directory)
  try:
    target = {"params": abstract_params}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    return manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        target, restore_args=restore_args, partial_restore=True)))["state"]["params"]
  finally:
    manager.close()
