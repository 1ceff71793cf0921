"""The pipeline's view of the model: chunks of the stacked layers placed on stages, the
vocabulary layers padded for vocabulary parallelism, the mesh axes the executor names, and
the microbatches it runs."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxsys import mesh as mesh_lib
from jaxsys.models import transformer
from jaxsys.parallel import routing, schedules, vocab

AXIS = mesh_lib.STAGE
TENSOR_AXIS = mesh_lib.TENSOR  # automatic in the executor; VP takes it by hand around its layers
DATA_AXIS = mesh_lib.DATA  # the batch axis the executor splits by hand (`executor._Plan`)
FSDP_AXIS = mesh_lib.FSDP  # automatic, or by hand where the weights are gathered once a step
SCHEDULES = ("none", *schedules.SCHEDULES)
VOCAB_PARAMS = ("embedding", "unembedding")

Batch = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Layout:
  """How the canonical parameters are viewed for a pipeline of `stages` x `virtual` chunks.

  `tensor`: the size of the mesh's `tensor` axis, over which vocabulary parallelism also
  splits the vocabulary (stages x tensor shards); 1 splits it over `stage` alone.
  """
  stages: int
  virtual: int
  vocab_size: int
  vocab_parallel: bool
  tensor: int = 1

  @property
  def chunks(self) -> int:
    return self.stages * self.virtual

  @property
  def vocab_axes(self) -> tuple[str, ...]:
    """The mesh axes VP splits the vocabulary over, the first major (`vocab.py`)."""
    return (AXIS, TENSOR_AXIS) if self.tensor > 1 else (AXIS,)

  @property
  def padded_vocab(self) -> int:
    return (vocab.padded_vocab(self.vocab_size, self.stages * self.tensor) if self.vocab_parallel
            else self.vocab_size)

  def leaf_to_stages(self, name: str, x):
    """One canonical leaf (named by its last key) in the pipeline view."""
    if name == "layers":
      return x.reshape(self.virtual, self.stages, x.shape[0] // self.chunks, *x.shape[1:])
    pad = self.padded_vocab - self.vocab_size
    if name == "embedding" and pad:
      return jnp.pad(x, ((0, pad), (0, 0)))
    if name == "unembedding" and pad:
      return jnp.pad(x, ((0, 0), (0, pad)))
    return x

  def leaf_from_stages(self, name: str, x):
    """The inverse of `leaf_to_stages`: the canonical leaf, vocabulary padding dropped."""
    if name == "layers":
      return x.reshape(x.shape[0] * x.shape[1] * x.shape[2], *x.shape[3:])
    if name == "embedding":
      return x[:self.vocab_size]
    if name == "unembedding":
      return x[:, :self.vocab_size]
    return x

  def logical_axes(self, axes: dict[str, Any]) -> dict[str, Any]:
    """The parameters' logical axes in the pipeline view (`stage` names the stage dim)."""
    out = dict(axes)
    out["layers"] = {k: (None, "stage", *a) for k, a in axes["layers"].items()}
    return out

  def rules(self, rules):
    """Logical rules of the view: with vocabulary parallelism the vocab dim splits over
    `vocab_axes` (stage, or stage x tensor)."""
    return ((("vocab", self.vocab_axes),) if self.vocab_parallel else ()) + tuple(rules)


def leaf_kind(path) -> str:
  """'layers' for a stacked-layer leaf, else the parameter's own name."""
  keys = [getattr(k, "key", None) for k in path]
  return "layers" if "layers" in keys else str(keys[-1])


def to_stages(layout: Layout, params):
  """Canonical parameters (or any tree of the same keys, such as Adam's moments) -> the view."""
  return jax.tree_util.tree_map_with_path(lambda p, x: layout.leaf_to_stages(leaf_kind(p), x), params)


def from_stages(layout: Layout, params):
  return jax.tree_util.tree_map_with_path(lambda p, x: layout.leaf_from_stages(leaf_kind(p), x), params)


def check_layout(stages: int, virtual: int, n_layers: int) -> None:
  if n_layers % (stages * virtual):
    raise ValueError(f"model.n_layers={n_layers} does not split into {stages} stages x "
                     f"pipeline.virtual_stages={virtual} chunks; use n_layers a multiple of "
                     f"{stages * virtual} or another stage axis / virtual_stages")


def split_microbatches(batch: Batch, n: int) -> Batch:
  """[B, ...] -> [n, B/n, ...], microbatch i taking rows i, i+n, ... so each stays evenly sharded."""
  return jax.tree.map(lambda x: x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1), batch)


def take(tree, i):
  """Entry i (traced or not) of every leaf's leading dim, e.g. microbatch i of [M, ...]."""
  return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def microbatches_by_replica(batch: Batch, replicas: int, n: int) -> Batch:
  """[B, ...] -> [replicas, n, B/(replicas n), ...]: each replica's contiguous rows, split."""
  by_replica = jax.tree.map(lambda x: x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:]),
                            batch)
  return jax.vmap(lambda b: split_microbatches(b, n))(by_replica)


def param_specs(layout: Layout, params, replicas: bool = False, gathered=None):
  """shard_map specs over `stage` (and a leading `replica` dim): layers on their stage dim,
  vocab layers when parallel (their split over `tensor` too, an automatic axis here, is
  taken by `VocabLayers`); with `gathered` (`fsdp_dims`), each leaf's `fsdp` dim too."""
  lead = 1 if replicas else 0

  def spec(path, x, d=-1):
    kind = leaf_kind(path)
    dims = [routing.AXIS] * lead + [None] * (x.ndim - lead)
    if kind == "layers":
      dims[lead + 1] = AXIS
    elif layout.vocab_parallel and kind in VOCAB_PARAMS:
      dims[lead + (kind == "unembedding")] = AXIS
    if d >= 0:
      dims[lead + d] = FSDP_AXIS
    return P(*dims)
  if gathered is None:
    return jax.tree_util.tree_map_with_path(spec, params)
  return jax.tree_util.tree_map_with_path(spec, params, gathered)


def fsdp_dims(cfg: transformer.TransformerConfig, layout: Layout, mesh):
  """Each stage-view parameter's dim split over `fsdp` on `mesh` (-1: none), by the same
  rules and mapping that place the run's parameters."""
  rules = layout.rules(mesh_lib.DEFAULT_RULES)

  def dim(axes):
    spec = mesh_lib.logical_to_partition_spec(axes, mesh, rules)
    return next((i for i, entry in enumerate(spec) if entry == FSDP_AXIS), -1)
  return jax.tree.map(dim, layout.logical_axes(transformer.param_axes(cfg)),
                      is_leaf=lambda x: isinstance(x, tuple))
