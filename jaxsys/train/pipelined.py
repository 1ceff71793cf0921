"""A pipelined run's train step, eval step and state: the stage view of the parameters,
stepped and evaluated by the pipeline executor, saved in the canonical `[layers, ...]` form.

The state holds parameters and optimizer moments in `pipeline.to_stages` form (layers
`[virtual, stage, layers/chunk, ...]` split over `stage`, vocabulary padded and split over
`stage` with vocabulary parallelism), so a step moves no weights. `to_saved` and
`from_saved` convert the whole state at checkpoint time, which is why a run resumes
under any schedule, any stage count, or none.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxsys import mesh as mesh_lib
from jaxsys.kernels import sharded
from jaxsys.models import transformer
from jaxsys.optim import outer as outer_lib
from jaxsys.optim.inner import make_optimizer
from jaxsys.parallel import pipeline
from jaxsys.train import state as state_lib
from jaxsys.train import step as step_lib
from jaxsys.train.state import TrainState

def pipelined_train_step(state: TrainState, batch: step_lib.Batch, *,
                         model_cfg: transformer.TransformerConfig,
                         optimizer: optax.GradientTransformation, schedule: pipeline.Schedule,
                         layout: pipeline.Layout, mesh, vocab_algorithm: int = 2):
  """`step.train_step` with the gradients from `pipeline_loss_and_grads`."""
  total, grads = pipeline.pipeline_loss_and_grads(model_cfg, schedule, layout, state.params, batch,
                                                  mesh=mesh, vocab_algorithm=vocab_algorithm)
  return step_lib.apply_gradients(state, optimizer, total, jnp.sum(batch["loss_mask"]), grads)


def _map_state(layout_fn, layout: pipeline.Layout, state: TrainState) -> TrainState:
  # Parameters and every optimizer leaf of the same keys (Adam's moments) change view;
  # counts and the step have no such keys and pass through.
  return state.replace(params=layout_fn(layout, state.params),
                       opt_state=layout_fn(layout, state.opt_state))


@dataclasses.dataclass(frozen=True)
class PipelineSetup(step_lib.TrainSetup):
  """`step.TrainSetup` over the stage view, with the conversions to and from the canonical form."""
  layout: pipeline.Layout = None
  schedule: pipeline.Schedule = None
  canonical: TrainState = None  # abstract canonical state
  canonical_sh: TrainState = None  # its shardings on this mesh (layers split over `stage`)
  batch_size: int = 0
  seq_len: int = 0

  @property
  def param_sh(self):
    return self.canonical_sh.params

  @functools.cached_property
  def _to_canonical(self):
    return jax.jit(functools.partial(_map_state, pipeline.from_stages, self.layout),
                   out_shardings=self.canonical_sh)

  @functools.cached_property
  def _from_canonical(self):
    return jax.jit(functools.partial(_map_state, pipeline.to_stages, self.layout),
                   out_shardings=self.state_sh)

  def jit_eval_step(self, token_bytes):
    """Eval sums of the stage-view parameters, by the schedule's forwards: no weight moves."""
    table = jnp.asarray(token_bytes, jnp.float32)

    def eval_step(params, batch):
      loss_sum = pipeline.pipeline_loss(self.model_cfg, self.schedule, self.layout, params, batch,
                                        mesh=self.batch_sh.mesh)
      return step_lib.eval_sums_of_loss(loss_sum, batch, table)
    mesh = self.batch_sh.mesh
    return jax.jit(sharded.under_mesh(eval_step, mesh),
                   in_shardings=(self.state_sh.params, self.batch_sh),
                   out_shardings=NamedSharding(mesh, PartitionSpec()),
                   compiler_options=step_lib.compiler_options(self.model_cfg, mesh))

  def bytes_per_step(self) -> int:
    """Bytes one device sends per step: the ring all-reduce of its stage's gradients over the
    batch axes, plus the activation and the gradient it passes to its neighbours every tick
    (the executor sends both each tick, idle or not). Vocabulary collectives are not counted."""
    mesh = self.batch_sh.mesh
    stage_share = lambda sh: mesh.shape[pipeline.AXIS] if pipeline.AXIS in str(sh.spec) else 1
    grads = sum(math.prod(x.shape) * x.dtype.itemsize // stage_share(sh)
                for x, sh in zip(jax.tree.leaves(self.abstract.params),
                                 jax.tree.leaves(self.state_sh.params)))
    shards = math.prod(mesh.shape.get(a, 1) for a in ("replica", "data", "fsdp"))
    rows = self.batch_size // self.schedule.microbatches // shards
    activation = rows * self.seq_len * self.model_cfg.d_model * jnp.dtype(self.model_cfg.dtype).itemsize
    return outer_lib.ring_allreduce_bytes(grads, shards) + 2 * self.schedule.ticks * activation

  def saved_target(self) -> TrainState:
    return state_lib.with_shardings(self.canonical, self.canonical_sh)

  def to_saved(self, state: TrainState) -> TrainState:
    return self._to_canonical(state)

  def from_saved(self, state: TrainState) -> TrainState:
    return self._from_canonical(state)

  def init_state(self, seed: int) -> TrainState:
    """The canonical fresh state of `seed`, in the stage view: the same numbers as unpipelined."""
    init = lambda: _map_state(pipeline.to_stages, self.layout,
                              state_lib.init_train_state(self.model_cfg, self.optimizer, seed))
    return jax.jit(init, out_shardings=self.state_sh)()

  def start_from(self, state: TrainState, params) -> TrainState:
    def start(s, p):
      p = pipeline.to_stages(self.layout, p)
      return s.replace(params=p, opt_state=self.optimizer.init(p))
    return jax.jit(start, out_shardings=self.state_sh, donate_argnums=0)(state, params)


def make_layout(config, model_cfg: transformer.TransformerConfig, mesh) -> pipeline.Layout:
  stages = dict(mesh.shape).get(pipeline.AXIS, 1)
  virtual = config.pipeline.virtual_stages
  pipeline.check_layout(stages, virtual, model_cfg.n_layers)
  return pipeline.Layout(stages=stages, virtual=virtual, vocab_size=model_cfg.vocab_size,
                         vocab_parallel=bool(config.pipeline.vocab_parallel))


def stage_state_shardings(abstract: TrainState, model_cfg, optimizer, layout: pipeline.Layout,
                          mesh) -> TrainState:
  """Shardings of the stage-view state: the view's logical axes through the view's rules."""
  return state_lib.state_shardings(abstract, model_cfg, optimizer, mesh,
                                   layout.rules(mesh_lib.DEFAULT_RULES),
                                   layout.logical_axes(transformer.param_axes(model_cfg)))


# Canonical layers split over `stage` in contiguous blocks: for one chunk per stage that is
# the stage view's own placement, so saving moves no data between devices.
CANONICAL_RULES = (("layers", pipeline.AXIS),) + tuple(mesh_lib.DEFAULT_RULES)


def make_pipeline_setup(config, model_cfg: transformer.TransformerConfig, mesh) -> PipelineSetup:
  """The pipelined train step of `config` on `mesh` and its state views."""
  layout = make_layout(config, model_cfg, mesh)
  schedule = pipeline.make_schedule(config.pipeline.schedule, stages=layout.stages,
                                    microbatches=config.pipeline.microbatches,
                                    virtual_stages=layout.virtual)
  optimizer = make_optimizer(config.optimizer, config.total_steps)
  canonical = state_lib.abstract_train_state(model_cfg, optimizer, config.seed)
  canonical_sh = state_lib.state_shardings(canonical, model_cfg, optimizer, mesh, CANONICAL_RULES)
  abstract = jax.eval_shape(functools.partial(_map_state, pipeline.to_stages, layout), canonical)
  state_sh = stage_state_shardings(abstract, model_cfg, optimizer, layout, mesh)
  batch_sh = mesh_lib.batch_sharding(mesh)
  fn = functools.partial(pipelined_train_step, model_cfg=model_cfg, optimizer=optimizer,
                         schedule=schedule, layout=layout, mesh=mesh,
                         vocab_algorithm=config.pipeline.vocab_algorithm)
  replicated = NamedSharding(mesh, PartitionSpec())
  train_fn = jax.jit(sharded.under_mesh(fn, mesh), in_shardings=(state_sh, batch_sh),
                     out_shardings=(state_sh, replicated), donate_argnums=0,
                     compiler_options=step_lib.compiler_options(model_cfg, mesh))
  return PipelineSetup(model_cfg, optimizer, abstract, state_sh, batch_sh, train_fn,
                       layout=layout, schedule=schedule, canonical=canonical,
                       canonical_sh=canonical_sh, batch_size=config.data.batch_size,
                       seq_len=config.data.seq_len)
