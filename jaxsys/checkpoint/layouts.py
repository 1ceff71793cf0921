"""Checkpoint layouts: the form a run's state is saved in, its description, and the pure
transforms that turn one run's saved state into another run's.

A run trains a view of one canonical model (layers stacked `[L, ...]`, vocabulary
unpadded). A checkpoint holds the state in its *saved form*:

  - canonical, for a data/fsdp/tensor/context-parallel or pipelined run (the pipeline's
    stage view and its vocabulary padding are undone before a save: `pipeline.from_stages`);
  - replica-stacked `[R, ...]` for an outer-optimizer run: the R replicas differ between
    syncs, so they are kept, with the outer optimizer's state.

The saved form is described by a `Form` (replica count, outer optimizer) and each array
by `describe` (logical axes, canonical and saved shapes, the transforms behind them, the
mesh and partition spec it was saved under), which every checkpoint records in its meta.

A resume whose form differs converts with `convert`: replicas regrouped (`regroup`: R to
one model by `merge_replicas` "mean" or "replica0", one model to R copies, R to a
divisor or multiple of R), inner optimizer moments following their parameters through
`optax.tree_map_params`, and an outer state kept only where the outer optimizer and R are
unchanged (else it starts fresh at the converted parameters). Mesh changes need no
transform: orbax reads each saved piece straight into the new shardings.

A run's `View` (its saved form plus the pipeline's stage view) applies the registered
`TRANSFORMS`; training, evaluation and checkpoints convert state through it and nowhere
else. Adding a layout is one pair of pure functions (to the view, back to canonical), a
`View` field, and a test.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxsys import mesh as mesh_lib
from jaxsys.parallel import pipeline

MERGES = ("mean", "replica0")
VERSION = 1


@dataclasses.dataclass(frozen=True)
class Form:
  """How a checkpoint's state is stacked: `replicas` 0 for one model; the outer optimizer."""
  replicas: int = 0
  outer: str | None = None

  def __str__(self) -> str:
    return f"{self.replicas} replicas ({self.outer})" if self.replicas else "one model"


def form_of(meta: dict) -> Form:
  """The saved form a checkpoint's meta records (checkpoints older than `describe` too)."""
  if "layout" in meta:
    form = meta["layout"]["form"]
    return Form(form["replicas"], form["outer"])
  outer = meta.get("outer") or {}
  return Form(outer.get("replicas", 0), outer.get("name"))


# ---------------------------------------------------------------------------
# Transforms: pure functions over a parameter-shaped tree
# ---------------------------------------------------------------------------


def stack_replicas(tree, replicas: int):
  """One model -> `replicas` identical copies on a leading axis."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (replicas, *x.shape)), tree)


def merge_replicas(tree, how: str = "mean"):
  """[R, ...] -> one model: the replicas' mean, or replica 0's."""
  if how not in MERGES:
    raise ValueError(f"checkpoint.merge_replicas={how!r}; valid: {', '.join(MERGES)}")
  if how == "replica0":
    return jax.tree.map(lambda x: x[0], tree)
  return jax.tree.map(lambda x: _mean_of_rows(x) if jnp.issubdtype(x.dtype, jnp.floating)
                      else x[0], tree)


def _mean_of_rows(x):
  """x.mean(0) in float32, as a sum of slices: XLA:CPU runs a reduce over the leading axis
  ~15x slower than the adds (4 s against 0.2 s to merge the 2 replicas of a 100M
  model and its Adam moments, 2.4 GB, on 8 simulated devices)."""
  total = x[0].astype(jnp.float32)
  for row in range(1, x.shape[0]):
    total = total + x[row]
  return (total / x.shape[0]).astype(x.dtype)


def check_regroup(saved: int, target: int) -> None:
  """Refuses a replica count a checkpoint of `saved` replicas cannot become (0: one model)."""
  if saved and target and saved % target and target % saved:
    fits = sorted({d for d in range(1, saved + 1) if saved % d == 0} | {2 * saved})
    raise ValueError(
        f"the checkpoint holds {saved} replicas and the config's mesh has replica={target}: "
        f"replicas can merge into a divisor of {saved} or be copied into a multiple of it "
        f"(replica in {', '.join(map(str, fits))}, ...), or into one model (no replica axis)")


def regroup(tree, saved: int, target: int, how: str = "mean"):
  """Leaves of `saved` replicas (0: one model, no leading axis) -> `target` replicas.

  R -> one model merges (`merge_replicas`); one model -> R stacks copies; R -> R/k merges
  each group of k neighbouring replicas; R -> kR copies each replica k times.
  """
  check_regroup(saved, target)
  if saved == target:
    return tree
  if not saved:
    return stack_replicas(tree, target)
  if not target:
    return merge_replicas(tree, how)
  if target > saved:
    return jax.tree.map(lambda x: jnp.repeat(x, target // saved, axis=0), tree)
  grouped = jax.tree.map(lambda x: x.reshape(target, saved // target, *x.shape[1:]), tree)
  return jax.vmap(lambda t: merge_replicas(t, how))(grouped)


def stacked_target(tree, replicas: int, mesh):
  """Abstract leaves with shardings -> the same leaves stacked [replicas, ...] (0: unchanged):
  what to read a replica-stacked checkpoint into on `mesh`. The replica dim splits over a
  `replica` mesh axis whose size divides it; otherwise each device reads every replica's
  share of its own piece (never the whole array)."""
  if not replicas:
    return tree
  size = dict(mesh.shape).get(mesh_lib.REPLICA, 0)
  axis = mesh_lib.REPLICA if size and replicas % size == 0 else None

  def one(x):
    spec = tuple(x.sharding.spec)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis, *spec))
    return jax.ShapeDtypeStruct((replicas, *x.shape), x.dtype, sharding=sharding)
  return jax.tree.map(one, tree)


@dataclasses.dataclass(frozen=True)
class Transform:
  """A layout a run trains in: `to_view(canonical, arg)` and `to_canonical(view, arg)`, both
  pure, `arg` the layout's parameter (a replica count, a `pipeline.Layout`)."""
  to_view: Callable
  to_canonical: Callable
  what: str


TRANSFORMS = {
    "replicas": Transform(stack_replicas, lambda tree, replicas: merge_replicas(tree),
                          "a leading [replica] axis, one copy of the model per replica"),
    "stages": Transform(lambda tree, layout: pipeline.to_stages(layout, tree),
                        lambda tree, layout: pipeline.from_stages(layout, tree),
                        "layers [virtual, stage, layers/chunk, ...] and the vocabulary padded "
                        "to a multiple of stages x tensor (vocabulary parallelism)"),
}


# Canonical layers split over `stage` in contiguous blocks: for one chunk per stage that is
# the stage view's own placement, so saving a pipelined run moves no data between devices.
STAGED_CANONICAL_RULES = (("layers", pipeline.AXIS),)


@dataclasses.dataclass(frozen=True)
class View:
  """How a run holds the canonical state: its saved `form` (one model, or replicas stacked
  `[R, ...]`) and, within each replica, the pipeline's stage view (`stages`; None: none).

  `to_view` and `to_saved` are the only conversions between what a run trains and what it
  saves, evaluates from or resumes: they apply the registered `TRANSFORMS` to the parameters
  and, by the same keys, to every optimizer leaf that mirrors them (Adam's moments, an outer
  optimizer's anchor); counts pass through.
  """
  form: Form = Form()
  stages: pipeline.Layout | None = None

  @property
  def replicas(self) -> int:
    return self.form.replicas

  @property
  def transforms(self) -> tuple[str, ...]:
    return ("replicas",) * bool(self.replicas) + ("stages",) * (self.stages is not None)

  def _map(self, transform: Callable, state):
    if self.stages is None:
      return state
    fn = lambda tree: transform(tree, self.stages)
    if self.replicas:
      fn = jax.vmap(fn)
    go = lambda tree: fn(tree) if jax.tree.leaves(tree) else tree
    return state.replace(params=go(state.params), opt_state=go(state.opt_state),
                         outer=go(state.outer))

  def to_view(self, state):
    """A state in the saved form -> the view the run trains (pure; jit it)."""
    return self._map(TRANSFORMS["stages"].to_view, state)

  def to_saved(self, state):
    """The inverse of `to_view`."""
    return self._map(TRANSFORMS["stages"].to_canonical, state)

  def param_axes(self, axes: dict) -> dict:
    """One replica's parameters' logical axes in the view."""
    return axes if self.stages is None else self.stages.logical_axes(axes)

  def rules(self, rules) -> tuple:
    """Logical-axis rules of the view (vocabulary parallelism splits vocab over `stage`)."""
    return tuple(rules) if self.stages is None else self.stages.rules(rules)

  def saved_rules(self, rules) -> tuple:
    """Rules of the saved form on this run's mesh: a pipelined run keeps its layers on the
    stages that train them."""
    return (STAGED_CANONICAL_RULES if self.stages is not None else ()) + tuple(rules)


def map_state(optimizer: optax.GradientTransformation, fn: Callable, params, opt_state,
              non_params: Callable | None = None):
  """(fn(params), opt_state with fn applied to each leaf that mirrors a parameter: moments
  follow their parameters). `fn` maps one array, whatever its path (a path-dependent
  view, the pipeline's, maps moments by their keys instead: `View`).
  `non_params` maps the other leaves (Adam's count), default unchanged."""
  return fn(params), optax.tree_map_params(optimizer, fn, opt_state,
                                           transform_non_params=non_params)


def convert(optimizer: optax.GradientTransformation, params, opt_state, saved: Form,
            target: Form, how: str = "mean"):
  """(params, opt_state) of `saved`'s replica count -> `target`'s: both regrouped the same
  way, except leaves that are not parameter-shaped (counts), which take replica 0's."""
  return map_state(optimizer, lambda t: regroup(t, saved.replicas, target.replicas, how),
                   params, opt_state,
                   lambda t: regroup(t, saved.replicas, target.replicas, "replica0"))


# ---------------------------------------------------------------------------
# The description each checkpoint records
# ---------------------------------------------------------------------------


def _logical_axes(path: str, by_param: dict[str, tuple]) -> tuple | None:
  """A parameter's logical axes; a moment (a path ending in a parameter's path) takes its
  parameter's."""
  for ppath, axes in by_param.items():
    if path.endswith(ppath):
      return axes
  return None


def describe(saved_target: Any, view: View, param_axes: dict, run: dict) -> dict:
  """JSON: the saved form, the run's own view (`run`: mesh, pipeline...) and, for every array
  of `saved_target` (abstract leaves with shardings), its logical axes, canonical and saved
  shapes, the transforms that make the one from the other, and its partition spec."""
  form = view.form
  by_param = {jax.tree_util.keystr(p): tuple(a) for p, a in
              jax.tree_util.tree_flatten_with_path(
                  param_axes, is_leaf=lambda x: isinstance(x, tuple))[0]}
  arrays = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(saved_target)[0]:
    key = jax.tree_util.keystr(path)
    axes = _logical_axes(key, by_param)
    stacked = form.replicas and key.startswith((".params", ".opt_state", ".outer"))
    shape = list(leaf.shape)
    arrays[key] = {
        "shape": shape,
        "canonical_shape": shape[1:] if stacked else shape,
        "logical_axes": (["replica"] if stacked else []) + list(axes) if axes else None,
        "transforms": ["replicas"] if stacked else [],
        "spec": str(getattr(getattr(leaf, "sharding", None), "spec", None)),
    }
  return {"version": VERSION, "form": dataclasses.asdict(form), "run": run,
          "transforms": {name: TRANSFORMS[name].what for name in view.transforms},
          "arrays": arrays}
