"""Training with Hybrid Data Parallelism: whole documents, each on as many devices as it needs.

A step takes a global batch of whole documents (jaxsys.data.documents), plans it
(`hdp.plan`: micro-steps, each device a cell of `tokens_per_device` tokens) and runs every
micro-step as one compiled program over a view of the same devices, `data = N/c,
context = c` for c the step's largest ring (`hdp_layout.pack_step`): ring attention over
`context` where c > 1, the plain kernels where c = 1. So a run compiles at most
log2(N) + 1 micro-step programs. The summed token loss, token count and gradients
accumulate over the micro-steps in the parameters' (replicated) sharding; one optimizer
update divides by the whole batch's token count, so the step equals a single-device step
over the same documents, however they were split.

The pool must be a data-only mesh: the views regroup its devices, and the parameters are
replicated on every device, so each view reads them where they are.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsys.kernels import sharded
from jaxsys.models import transformer
from jaxsys.parallel import hdp, hdp_layout
from jaxsys.train import replicas as replicas_lib
from jaxsys.train import step as step_lib
from jaxsys.train.state import TrainState


def micro_step_sums(params, batch, acc, *, model_cfg: transformer.TransformerConfig, ring: bool):
  """acc + (summed token loss, token count, its gradients) of one packed micro-step."""
  attention_fn = step_lib.ring_attention_fn(batch["positions"]) if ring else None

  def loss_sum(p):
    losses = step_lib.token_losses(model_cfg, p, batch, attention_fn=attention_fn)
    return jnp.sum(losses), jnp.sum(batch["loss_mask"])

  (total, count), grads = jax.value_and_grad(loss_sum, has_aux=True)(params)
  return jax.tree.map(jnp.add, acc, (total, count, grads))


class HDPStep:
  """(state, document batch) -> (state, metrics): plan, micro-steps, one update."""

  def __init__(self, model_cfg, optimizer, mesh: Mesh, state_sh: TrainState,
               tokens_per_device: int):
    others = {a: n for a, n in mesh.shape.items() if a != "data" and n > 1}
    if others:
      raise ValueError(f"HDP needs a data-only mesh (it regroups the devices into "
                       f"data=N/c,context=c views); this one also has {others}")
    self.model_cfg, self.optimizer = model_cfg, optimizer
    self.devices = mesh.devices.reshape(-1)
    self.tokens_per_device = tokens_per_device
    self.params_sh = state_sh.params
    self.steps_run = self.micro_steps_run = 0
    self._programs: dict[int, tuple[Callable, NamedSharding]] = {}
    rep = NamedSharding(mesh, P())
    self._acc_sh = (rep, rep, self.params_sh)
    self._zeros = jax.jit(lambda p: (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, p)),
                          out_shardings=self._acc_sh)
    update = functools.partial(step_lib.apply_gradients, optimizer=optimizer)
    self._update = jax.jit(lambda s, acc: update(s, total=acc[0], count=acc[1], grads=acc[2]),
                           out_shardings=(state_sh, rep), donate_argnums=0)

  @property
  def num_devices(self) -> int:
    return self.devices.size

  def program(self, c: int) -> tuple[Callable, NamedSharding]:
    """The jitted micro-step of views with context c, and its batch sharding (cached)."""
    if c not in self._programs:
      view = Mesh(self.devices.reshape(self.num_devices // c, c), ("data", "context"))
      batch_sh = NamedSharding(view, P("data", "context"))
      fn = functools.partial(micro_step_sums, model_cfg=self.model_cfg, ring=c > 1)
      # Parameters and sums keep the pool's shardings (the same devices), so every program
      # sees one input layout and compiles once, whichever view ran before it.
      jitted = jax.jit(sharded.under_mesh(fn, view),
                       in_shardings=(self.params_sh, batch_sh, self._acc_sh),
                       out_shardings=self._acc_sh, donate_argnums=2,
                       compiler_options=step_lib.compiler_options(self.model_cfg, view))
      self._programs[c] = (jitted, batch_sh)
    return self._programs[c]

  def compile_all(self, params) -> None:
    """Compiles (by running once on padding) every view's program, so later steps time
    only compute: a benchmark's warm-up. Training compiles views as it meets them."""
    c = 1
    while c <= self.num_devices:
      fn, batch_sh = self.program(c)
      _, fields = hdp_layout.pack_step([], [], num_devices=self.num_devices,
                                       tokens_per_device=self.tokens_per_device, view=c)
      arrays = {k: jax.device_put(v, batch_sh) for k, v in fields.items()}
      jax.block_until_ready(fn(params, arrays, self._zeros(params)))
      c *= 2

  def plan(self, lengths) -> hdp.Plan:
    return hdp.plan([int(n) for n in lengths], num_devices=self.num_devices,
                    tokens_per_device=self.tokens_per_device)

  def fit(self, docs, micro_steps: int) -> tuple[list[int], hdp.Plan]:
    """(kept, plan of those docs): in order, each document the plan still fits into at
    most `micro_steps` micro-steps is kept, the others skipped (the first always fits)."""
    lengths = [len(d) - 1 for d in docs]
    steps = self.plan(lengths)
    if len(steps) <= micro_steps:
      return list(range(len(docs))), steps
    kept, steps = [], []
    for i, n in enumerate(lengths):
      trial = self.plan([lengths[j] for j in kept] + [n])
      if len(trial) <= micro_steps or not kept:
        kept, steps = kept + [i], trial
    # The plan indexes the kept documents; callers pass docs[kept] alongside it.
    return kept, steps

  def __call__(self, state: TrainState, batch: dict[str, Any]):
    docs = batch["tokens"]
    steps = batch.get("plan") or self.plan([len(d) - 1 for d in docs])
    return self.run(state, docs, steps)

  def run(self, state: TrainState, docs, steps: hdp.Plan):
    """One update over `docs` laid out by the plan `steps`: micro-steps, then the update."""
    packed = (hdp_layout.pack_step(micro, docs, num_devices=self.num_devices,
                                   tokens_per_device=self.tokens_per_device) for micro in steps)
    return self.run_packed(state, packed)

  def run_packed(self, state: TrainState, micro_batches):
    """One update over micro-steps given as (c, fields [N/c, c * tokens_per_device]) in
    any layout the ring masks right (positions and segment ids per token), e.g. a static
    mesh's packed rows."""
    acc, count = self._zeros(state.params), 0
    for c, fields in micro_batches:
      count += 1
      fn, batch_sh = self.program(c)
      arrays = {k: jax.make_array_from_callback(v.shape, batch_sh, lambda idx, v=v: v[idx])
                for k, v in fields.items()}
      acc = fn(state.params, arrays, acc)
    state, metrics = self._update(state, acc)
    self.steps_run += 1
    self.micro_steps_run += count
    return state, {**metrics, "micro_steps": jnp.asarray(count)}


@dataclasses.dataclass(frozen=True)
class HDPSetup(step_lib.TrainSetup):
  """`step.TrainSetup` whose train_fn is an `HDPStep` taking whole-document batches.

  A step fills `micro_steps` micro-steps: the loader offers more documents than fit, the
  step keeps, in order, each one its plan still fits and gives the rest back to `loader`
  (the next batch starts with them), so micro-steps are not left part empty by a token cut.
  """
  loader: Any = None
  micro_steps: int = 1

  def device_batch(self, batch):
    docs = batch["tokens"]
    kept, steps = self.train_fn.fit(docs, self.micro_steps)
    if len(kept) < len(docs):
      self.loader.give_back(sorted(set(range(len(docs))) - set(kept)))
    return {"tokens": [docs[i] for i in kept], "plan": steps}

  def comm_bytes(self, steps: int) -> float:
    """Gradient all-reduce bytes per device over `steps` steps: one per micro-step (this
    process's mean count so far); ring attention's K/V traffic is not counted."""
    per_micro = replicas_lib.dp_bytes_per_step(self.abstract.params, self.batch_sh.mesh)
    run = self.train_fn
    return steps * per_micro * (run.micro_steps_run / run.steps_run if run.steps_run else 1.0)


def micro_steps_per_step(config, num_devices: int) -> int:
  """Micro-steps a step fills: data.batch_size * data.seq_len tokens over the pool's
  slots per micro-step (num_devices * data.seq_len)."""
  return max(1, -(-config.data.batch_size // num_devices))


def loader_budget(slots: int, max_len: int) -> int:
  """Tokens the whole-document loader offers a step whose micro-steps hold `slots`: half
  as many again (at least one longest document more), so the step has documents to
  choose from to fill its micro-steps and gives the rest back. (On the stdlib, 8 devices,
  1024 tokens each, 8 micro-steps: 6.3% of slots stay empty with one document more, 4.2%
  with half as many again, 4.2% with twice.)"""
  return slots + max(max_len, slots // 2)


def make_hdp_setup(config, model_cfg: transformer.TransformerConfig, mesh, loader) -> HDPSetup:
  """The HDP step of `config` on the data-only `mesh`, data.seq_len tokens per device,
  taking its documents from (and giving the unused back to) `loader`."""
  base = step_lib.make_train_setup(config, model_cfg, mesh)
  train_fn = HDPStep(model_cfg, base.optimizer, mesh, base.state_sh, config.data.seq_len)
  return HDPSetup(**{**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                     "train_fn": train_fn}, loader=loader,
                  micro_steps=micro_steps_per_step(config, mesh.size))
