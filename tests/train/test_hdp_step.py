"""HDP training: a step over whole documents equals a single-device step over them."""
import dataclasses
import math

import chex
import jax
import numpy as np
from absl.testing import absltest, parameterized
import pytest

from jaxsys import mesh as mesh_lib
from jaxsys.parallel import hdp, hdp_layout
from jaxsys.train import hdp_step
from jaxsys.train import state as state_lib
from jaxsys.train import grads
from jaxsys.train import step as step_lib
from jaxsys.optim.inner import make_optimizer
from tests.train.test_step import MODEL, OPT

TOKENS_PER_DEVICE = 16
# Rings of 7, 4, 3 and 2 devices (views of 8, 4 and 2) and short documents beside them.
LENGTHS = [100, 61, 40, 17, 30, 9, 5, 15, 12, 3, 8, 16, 2]


def documents(seed: int) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, size=n + 1).astype(np.int32) for n in LENGTHS]


def single_device_batch(docs) -> dict[str, np.ndarray]:
  """One document per row, padded to the longest: what one device would run."""
  t = max(len(d) - 1 for d in docs)
  out = {k: np.zeros((len(docs), t), np.float32 if k == "loss_mask" else np.int32)
         for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask")}
  for r, d in enumerate(docs):
    n = len(d) - 1
    out["inputs"][r, :n], out["targets"][r, :n] = d[:-1], d[1:]
    out["segment_ids"][r, :n], out["positions"][r, :n], out["loss_mask"][r, :n] = 1, np.arange(n), 1
  return out


# eps=1, no warm-up, no clipping: the first step's update is a smooth function of the
# gradients (with eps ~ 0 it is ~ lr * sign(g), and a gradient off by a factor still agrees).
HDP_OPT = dataclasses.replace(OPT, eps=1.0, warmup_steps=0, grad_clip=1e9)


def init(mesh, model=MODEL):
  optimizer = make_optimizer(HDP_OPT, total_steps=10)
  abstract = state_lib.abstract_train_state(model, optimizer, seed=0)
  state_sh = state_lib.state_shardings(abstract, model, optimizer, mesh)
  state = jax.jit(lambda: state_lib.init_train_state(model, optimizer, 0), out_shardings=state_sh)()
  return optimizer, state_sh, state


class HDPStepTest(parameterized.TestCase):

  def test_plan_uses_rings_and_short_cells(self):
    steps = hdp.plan(LENGTHS, num_devices=8, tokens_per_device=TOKENS_PER_DEVICE)
    rings = {len(devs) for step in steps for _, devs in step}
    self.assertEqual(rings, {1, 2, 3, 4, 7})

  @parameterized.parameters(("lockstep", "data=8"), ("per_rank_wide", "data=8"),
                            ("lockstep", "data=2,fsdp=2,tensor=2"),
                            ("per_rank", "fsdp=2,tensor=2,data=2"))
  @pytest.mark.slow
  def test_hdp_step_equals_single_device_step(self, schedule, spec):
    mesh = mesh_lib.make_mesh(spec)
    optimizer, state_sh, state = init(mesh)
    args = (MODEL, optimizer, mesh, state_sh, TOKENS_PER_DEVICE)
    if schedule == "lockstep":
      run = hdp_step.HDPStep(*args)
    else:
      run = hdp_step.PerRankHDPStep(*args, widen=schedule == "per_rank_wide")
    # Slots of one data-parallel rank each: with tensor=2, 4 slots hold documents up to 64.
    lengths = [n for n in LENGTHS if n <= run.num_devices * TOKENS_PER_DEVICE]
    one = mesh_lib.make_mesh("data=1", jax.devices()[:1])
    _, ref_sh, ref = init(one)
    ref_fn = grads.jit_autodiff_step(MODEL, optimizer, ref_sh, mesh_lib.batch_sharding(one))
    # A second step (the update's state) once: every executor shares the update.
    for seed in range(2 if (schedule, spec) == ("lockstep", "data=8") else 1):
      docs = [d for d in documents(seed) if len(d) - 1 in lengths]
      state, metrics = run(state, {"tokens": docs})
      ref, ref_metrics = ref_fn(ref, jax.device_put(single_device_batch(docs),
                                                    mesh_lib.batch_sharding(one)))
      np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
      self.assertEqual(float(metrics["tokens"]), sum(lengths))
    self.assertGreater(int(metrics["micro_steps"]), 1)
    # comm_bytes' count: lock step all-reduces over the pool once a micro-step; per rank once
    # at the end, plus each ring's share of one over the pool (these plans have rings).
    if schedule == "lockstep":
      self.assertEqual(float(metrics["grad_reductions"]), int(metrics["micro_steps"]))
    else:
      self.assertGreater(float(metrics["grad_reductions"]), 1.0)
    chex.assert_trees_all_close(jax.device_get(state.params), jax.device_get(ref.params),
                                atol=2e-5)
    if schedule == "lockstep":
      self.assertLessEqual(len(run._programs), 4)  # one program per ring size: log2(8) + 1
    else:  # a ring program compiled per ring size and cell, loaded onto the other blocks
      expected = hdp_step.programs(run.plan(lengths), lengths, TOKENS_PER_DEVICE)
      self.assertEqual(set(run._rings), {block for block, _ in expected["ring"]})
      # A program that jax's persistent cache served (another test of this run compiled
      # it) runs where it was compiled for only, so the count allows for those.
      rings = run._ring_programs
      self.assertEqual(rings.compiles + rings.cache_loads + rings.relocations,
                       len(expected["ring"]))
      self.assertLessEqual(rings.compiles, len(expected["ring shape"]))
      self.assertGreaterEqual(rings.relocations, len(expected["ring"])
                              - len(expected["ring shape"]) - rings.cache_loads)
      self.assertEqual(sum(run._rings[block][0]._cache_size() for block in run._rings), 0)
      self.assertEqual(sum(fn._cache_size() for fn in run._locals.values()),
                       len(expected["local"]))

  def test_per_rank_step_equals_the_single_device_step(self):
    """The fast tier's check of per-rank HDP's gradients (the slow test above runs the
    others): a 1-layer model, documents on rings of 3 and 2 and short ones beside them, one
    step equal to the single-device step on the same documents."""
    model = dataclasses.replace(MODEL, n_layers=1)
    mesh = mesh_lib.make_mesh("data=8")
    optimizer, state_sh, state = init(mesh, model)
    run = hdp_step.PerRankHDPStep(model, optimizer, mesh, state_sh, TOKENS_PER_DEVICE)
    one = mesh_lib.make_mesh("data=1", jax.devices()[:1])
    _, ref_sh, ref = init(one, model)
    ref_fn = grads.jit_autodiff_step(model, optimizer, ref_sh, mesh_lib.batch_sharding(one))
    docs = [d for d in documents(1) if len(d) - 1 <= 40]
    state, metrics = run(state, {"tokens": docs})
    ref, ref_metrics = ref_fn(ref, jax.device_put(single_device_batch(docs),
                                                  mesh_lib.batch_sharding(one)))
    lengths = [len(d) - 1 for d in docs]
    planned = hdp_step.programs(run.plan(lengths), lengths, TOKENS_PER_DEVICE)["ring"]
    self.assertLessEqual({2, 3}, {len(block) for block, _ in planned})
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    chex.assert_trees_all_close(jax.device_get(state.params), jax.device_get(ref.params),
                                atol=2e-5)

  def test_a_ring_program_compiles_once_per_shape_and_equals_its_block_compiled(self):
    """One document's ring of 2 on every block of 2 slots: one compiled ring program,
    loaded onto the other blocks, each block's sums those of the program compiled for it."""
    mesh = mesh_lib.make_mesh("data=8")
    model = dataclasses.replace(MODEL, n_layers=1)  # quicker to compile
    optimizer, state_sh, state = init(mesh, model)
    run = hdp_step.PerRankHDPStep(model, optimizer, mesh, state_sh, TOKENS_PER_DEVICE)
    _, fields = hdp_layout.pack_step([(0, (0, 1))], documents(0)[4:5], num_devices=2,
                                     tokens_per_device=TOKENS_PER_DEVICE, view=2)
    blocks = [(0, 1), (2, 3), (4, 5), (6, 7)]
    params = run._gather(state.params)
    sums, _ = run._run_sums(params, {(block, TOKENS_PER_DEVICE): [fields] for block in blocks})
    self.assertEqual((run._ring_programs.compiles, run._ring_programs.relocations), (1, 3))
    fn, batch_sh, zeros, params_sh = run.ring_program(blocks[-1])
    on_block = hdp_step._on(params, params_sh)
    want = fn(on_block, hdp_step._put(fields, batch_sh), zeros(on_block))
    got = sums[blocks[-1]]
    self.assertEqual({s.device for s in jax.tree.leaves(got)[-1].addressable_shards},
                     set(batch_sh.mesh.devices.flat))
    chex.assert_trees_all_equal(jax.device_get(got), jax.device_get(want))
    chex.assert_trees_all_equal(jax.device_get(sums[blocks[0]]), jax.device_get(want))

  def test_fit_keeps_a_run_that_plans_into_k_steps_in_a_few_plans(self):
    """The documents from the first up to one that would not fit (in k micro-steps, or in
    the pool's tokens), maybe with later ones, in (1 + EXTRA_ROUNDS) log2(documents) plans
    or so."""
    mesh = mesh_lib.make_mesh("data=8")
    optimizer, state_sh, _ = init(mesh)
    run = hdp_step.HDPStep(MODEL, optimizer, mesh, state_sh, TOKENS_PER_DEVICE)
    docs, plan, calls = documents(0), run.plan, []
    run.plan = lambda lengths: calls.append(len(lengths)) or plan(lengths)
    full = len(plan(LENGTHS))
    for k in range(1, full + 1):
      calls.clear()
      kept, steps = run.fit(docs, k)
      self.assertLessEqual(len(steps), k)
      self.assertEqual(steps, plan([LENGTHS[i] for i in kept]))
      rounds = 1 + hdp.EXTRA_ROUNDS
      self.assertLessEqual(len(calls), 2 + rounds * math.ceil(math.log2(len(docs) + 1)))
      out = min(set(range(len(docs))) - set(kept), default=None)
      if out is not None:  # the run stops at a document that did not fit after it
        self.assertEqual(kept[:out], list(range(out)))
        tried = LENGTHS[:out + 1]
        self.assertTrue(sum(tried) > k * 8 * TOKENS_PER_DEVICE or len(plan(tried)) > k, k)
    self.assertEqual(run.fit(docs, full)[0], list(range(len(docs))))

  def test_per_rank_fit_is_one_schedule_within_k_micro_batches(self):
    mesh = mesh_lib.make_mesh("data=8")
    optimizer, state_sh, _ = init(mesh)
    run = hdp_step.PerRankHDPStep(MODEL, optimizer, mesh, state_sh, TOKENS_PER_DEVICE)
    docs = documents(0)
    full = run.micro_batches(run.plan(LENGTHS))
    for k in range(1, full + 1):
      kept, sched = run.fit(docs, k)
      self.assertEqual(kept[0], 0)
      self.assertLessEqual(run.micro_batches(sched), k)
      self.assertEqual(sched.sequences(), list(range(len(kept))))  # it indexes the kept
      self.assertLessEqual(sum(LENGTHS[i] for i in kept), k * 8 * TOKENS_PER_DEVICE)
    self.assertEqual(run.fit(docs, 2 * full)[0], list(range(len(docs))))

  def test_refuses_a_mesh_it_cannot_regroup(self):
    mesh = mesh_lib.make_mesh("data=4,context=2")
    optimizer, state_sh, _ = init(mesh)
    with self.assertRaisesRegex(ValueError, r"HDP regroups the batch axes .* \{'context': 2\}"):
      hdp_step.HDPStep(MODEL, optimizer, mesh, state_sh, TOKENS_PER_DEVICE)

  @pytest.mark.slow
  def test_tensor_splits_and_fsdp_shards_in_the_compiled_programs(self):
    """Per device, against data=4 over the same 4 slots: tensor=2 halves a micro-step's
    FLOPs; fsdp=2 halves its accumulated gradients and the update's optimizer state."""
    def cost(spec, devices):
      mesh = mesh_lib.make_mesh(spec, jax.devices()[:devices])
      optimizer, state_sh, state = init(mesh)
      run = hdp_step.HDPStep(MODEL, optimizer, mesh, state_sh, TOKENS_PER_DEVICE)
      fn, batch_sh = run.program(1)
      _, fields = hdp_layout.pack_step([], [], num_devices=run.num_devices,
                                       tokens_per_device=TOKENS_PER_DEVICE, view=1)
      batch = {k: jax.device_put(v, batch_sh) for k, v in fields.items()}
      acc = run._zeros(state.params)
      step = fn.lower(run._gather(state.params), batch, acc).compile()
      update = run._update.lower(state, acc).compile()
      return (step.cost_analysis()["flops"], step.memory_analysis().output_size_in_bytes,
              update.memory_analysis().argument_size_in_bytes)

    flops, grads, update = cost("data=4", 4)
    tensor_flops, _, _ = cost("data=4,tensor=2", 8)
    _, fsdp_grads, fsdp_update = cost("data=4,fsdp=2", 8)
    self.assertLess(tensor_flops, 0.6 * flops)
    self.assertLess(fsdp_grads, 0.55 * grads)
    self.assertLess(fsdp_update, 0.55 * update)

if __name__ == "__main__":
  absltest.main()
