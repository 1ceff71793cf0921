"""The one way to read a run's saved parameters: for evaluation, quantization or `init_from`.

Reads only the `params` of a step's state (no optimizer state, no loader position), as
numpy arrays shaped by the model config the checkpoint's own meta records.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxsys.checkpoint import ledger
from jaxsys.checkpoint.manager import check_same_model, check_step
from jaxsys.models import transformer


@dataclasses.dataclass(frozen=True)
class SavedParams:
  """Parameters of one checkpoint and the metadata the run saved beside them."""
  directory: str
  step: int
  params: Any  # numpy; a leading [replicas] axis when the run trained replicas
  replicas: int  # 0 when the run did not train replicas
  model_cfg: transformer.TransformerConfig
  meta: dict  # "model", "config" and, for replica runs, "outer"

  def one(self) -> Any:
    """One model's parameters: replica 0's for a replica run (the model its evals scored)."""
    return jax.tree.map(lambda x: x[0], self.params) if self.replicas else self.params


def checkpoints_dir(path: str) -> str:
  """A run's checkpoints directory, given the run's workdir or that directory itself."""
  path = os.path.abspath(path)
  inner = os.path.join(path, "checkpoints")
  return inner if os.path.isdir(inner) else path


def _read_only(directory: str) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(create=False, read_only=True)
  return ocp.CheckpointManager(directory, options=options,
                               item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                                              "meta": ocp.JsonCheckpointHandler()})


def read_params(path: str, step: int | None = None, *, expect_model: dict | None = None,
                allow_model_change: tuple[str, ...] = (),
                field: tuple[str, ...] = ("params",)) -> SavedParams | None:
  """The parameters saved at `step` (default: the latest) of the run at `path`; None if it has none.

  `path` is a run's workdir or its checkpoints directory. With `expect_model` (a model
  config as a dict) a checkpoint of another model is refused before any array is read
  (see `manager.check_same_model`). Arrays that disagree with the meta's model config
  are refused in one line. `field`: the path in the saved state of the parameter-shaped
  tree to read, e.g. ("outer", "anchor"): an outer optimizer's global parameters.
  """
  directory = checkpoints_dir(path)
  if not os.path.isdir(directory):
    return None
  manager = _read_only(directory)
  try:
    steps = list(manager.all_steps())
    if not steps:
      return None
    step = max(steps) if step is None else step
    if step not in steps:
      raise ValueError(f"{directory}: no checkpoint at step {step}; steps there: {sorted(steps)}")
    check_step(directory, step, ledger.problem(directory, step, ledger.read(directory)),
               doing="reading")
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if expect_model is not None:
      check_same_model(meta["model"], expect_model, directory, allow_model_change)
    model_cfg = transformer.TransformerConfig(**meta["model"])
    replicas = (meta.get("outer") or {}).get("replicas") or 0
    abstract = _abstract_params(model_cfg, replicas)
    target = abstract
    for key in reversed(field):
      target = {key: target}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    params = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        target, restore_args=restore_args, partial_restore=True)))["state"]
    for key in field:
      params = params[key]
  finally:
    manager.close()
  _check_shapes(params, abstract, f"checkpoint step {step} in {directory}", meta["model"])
  return SavedParams(directory, step, params, replicas, model_cfg, meta)


def _abstract_params(model_cfg: transformer.TransformerConfig, replicas: int) -> Any:
  params = jax.eval_shape(lambda: transformer.init_params(model_cfg, jax.random.key(0)))
  if replicas:
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct((replicas, *x.shape), x.dtype), params)
  return params


def _check_shapes(params, abstract, where: str, model_meta: dict) -> None:
  """Orbax restores numpy arrays as saved, whatever the target says: compare them here."""
  def one(path, x, want):
    if tuple(x.shape) != tuple(want.shape):
      raise ValueError(f"{where} does not match the model in its meta ({model_meta}): params"
                       f"{jax.tree_util.keystr(path)} is {tuple(x.shape)} there but the meta's "
                       f"model gives {tuple(want.shape)}")
  jax.tree_util.tree_map_with_path(one, params, abstract)
