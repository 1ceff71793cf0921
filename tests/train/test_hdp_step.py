"""HDP training: a step over whole documents equals a single-device step over them."""
import dataclasses

import chex
import jax
import numpy as np
from absl.testing import absltest, parameterized
import pytest

from jaxsys import mesh as mesh_lib
from jaxsys.parallel import hdp, hdp_layout
from jaxsys.train import hdp_step, replicas
from jaxsys.train import state as state_lib
from jaxsys.train import grads
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


def make(mesh, optimizer, state_sh, model=MODEL, widen=False):
  return hdp_step.make_step(model, optimizer, mesh, state_sh, TOKENS_PER_DEVICE, widen=widen)


class HDPStepTest(parameterized.TestCase):

  def test_plan_uses_rings_and_short_cells(self):
    steps = hdp.plan(LENGTHS, num_devices=8, tokens_per_device=TOKENS_PER_DEVICE)
    rings = {len(devs) for step in steps for _, devs in step}
    self.assertEqual(rings, {1, 2, 3, 4, 7})

  @parameterized.parameters(("wide", "data=8"), ("tight", "fsdp=2,tensor=2,data=2"))
  @pytest.mark.slow
  def test_hdp_step_equals_single_device_step(self, rings, spec):
    mesh = mesh_lib.make_mesh(spec)
    optimizer, state_sh, state = init(mesh)
    run = make(mesh, optimizer, state_sh, widen=rings == "wide")
    # Slots of one data-parallel rank each: with tensor=2, 4 slots hold documents up to 64.
    lengths = [n for n in LENGTHS if n <= run.num_devices * TOKENS_PER_DEVICE]
    one = mesh_lib.make_mesh("data=1", jax.devices()[:1])
    _, ref_sh, ref = init(one)
    ref_fn = grads.jit_autodiff_step(MODEL, optimizer, ref_sh, mesh_lib.batch_sharding(one))
    # A second step once: the update's state carried over.
    for seed in range(2 if rings == "wide" else 1):
      docs = [d for d in documents(seed) if len(d) - 1 in lengths]
      state, metrics = run(state, {"tokens": docs})
      ref, ref_metrics = ref_fn(ref, jax.device_put(single_device_batch(docs),
                                                    mesh_lib.batch_sharding(one)))
      np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
      self.assertEqual(float(metrics["tokens"]), sum(lengths))
    self.assertGreater(int(metrics["micro_steps"]), 1)
    # comm_bytes' count: one all-reduce over the pool at the end, plus each ring's share
    # of one over the pool (these plans have rings).
    self.assertGreater(float(metrics["grad_reductions"]), 1.0)
    chex.assert_trees_all_close(jax.device_get(state.params), jax.device_get(ref.params),
                                atol=2e-5)
    # A ring program compiled per ring size and cell, loaded onto the other blocks.
    expected = hdp_step.compiled_programs(run.plan(lengths), lengths, TOKENS_PER_DEVICE)
    self.assertEqual({slots for slots, _ in run._runs}, {block for block, _ in expected["ring"]})
    # A program that jax's persistent cache served (another test of this run compiled
    # it) runs where it was compiled for only, so the count allows for those.
    programs = run._run_programs
    self.assertEqual(programs.compiles + programs.cache_loads + programs.relocations,
                     len(expected["ring"]))
    self.assertLessEqual(programs.compiles, len(expected["ring shape"]))
    self.assertGreaterEqual(programs.relocations, len(expected["ring"])
                            - len(expected["ring shape"]) - programs.cache_loads)
    self.assertEqual(sum(run._runs[key][0]._cache_size() for key in run._runs), 0)
    self.assertEqual(sum(fn._cache_size() for fn in run._locals.values()),
                     len(expected["local"]))

  def test_per_rank_step_equals_the_single_device_step(self):
    """The fast tier's check of per-rank HDP's gradients (the slow test above runs the
    others): a 1-layer model, documents on rings of 3 and 2 and short ones beside them, one
    step equal to the single-device step on the same documents."""
    model = dataclasses.replace(MODEL, n_layers=1)
    mesh = mesh_lib.make_mesh("data=8")
    optimizer, state_sh, state = init(mesh, model)
    run = make(mesh, optimizer, state_sh, model)
    one = mesh_lib.make_mesh("data=1", jax.devices()[:1])
    _, ref_sh, ref = init(one, model)
    ref_fn = grads.jit_autodiff_step(model, optimizer, ref_sh, mesh_lib.batch_sharding(one))
    # Two ring programs (of 3 and of 2 slots) and two local ones: each a compile.
    docs = [d for d in documents(1) if len(d) - 1 in (40, 30, 12, 9, 5, 3)]
    state, metrics = run(state, {"tokens": docs})
    ref, ref_metrics = ref_fn(ref, jax.device_put(single_device_batch(docs),
                                                  mesh_lib.batch_sharding(one)))
    lengths = [len(d) - 1 for d in docs]
    planned = hdp_step.compiled_programs(run.plan(lengths), lengths, TOKENS_PER_DEVICE)["ring"]
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
    run = make(mesh, optimizer, state_sh, model)
    _, fields = hdp_layout.pack_step([(0, (0, 1))], documents(0)[4:5], num_devices=2,
                                     tokens_per_device=TOKENS_PER_DEVICE, view=2)
    blocks = [(0, 1), (2, 3), (4, 5), (6, 7)]
    params = run._gather(state.params)
    sums = {}
    for block in blocks:  # as run_programs runs a run's program
      fn, batch_sh, zeros, params_sh = run.program(block)
      on_block = replicas.on_devices(params, params_sh)
      sums[block] = run._run_programs(fn, batch_sh.mesh, on_block,
                                      hdp_step._put(fields, batch_sh),
                                      run._run_zeros(zeros, batch_sh.mesh, on_block))
    self.assertEqual((run._run_programs.compiles, run._run_programs.relocations), (1, 3))
    fn, batch_sh, zeros, params_sh = run.program(blocks[-1])
    on_block = replicas.on_devices(params, params_sh)
    want = fn(on_block, hdp_step._put(fields, batch_sh), zeros(on_block))
    got = sums[blocks[-1]]
    self.assertEqual({s.device for s in jax.tree.leaves(got)[-1].addressable_shards},
                     set(batch_sh.mesh.devices.flat))
    chex.assert_trees_all_equal(jax.device_get(got), jax.device_get(want))
    chex.assert_trees_all_equal(jax.device_get(sums[blocks[0]]), jax.device_get(want))

  def test_per_rank_fit_is_one_schedule_within_k_micro_batches(self):
    mesh = mesh_lib.make_mesh("data=8")
    optimizer, state_sh, _ = init(mesh)
    run = make(mesh, optimizer, state_sh)
    docs = documents(0)
    full = run.planner.micro_batches(run.plan(LENGTHS))
    for k in range(1, full + 1):
      kept, sched = run.fit(docs, k)
      self.assertEqual(kept[0], 0)
      self.assertLessEqual(run.planner.micro_batches(sched), k)
      self.assertEqual(sched.sequences(), list(range(len(kept))))  # it indexes the kept
      self.assertLessEqual(sum(LENGTHS[i] for i in kept), k * 8 * TOKENS_PER_DEVICE)
    self.assertEqual(run.fit(docs, 2 * full)[0], list(range(len(docs))))

  def test_refuses_a_mesh_it_cannot_regroup(self):
    mesh = mesh_lib.make_mesh("data=4,context=2")
    optimizer, state_sh, _ = init(mesh)
    with self.assertRaisesRegex(ValueError, r"HDP regroups the batch axes .* \{'context': 2\}"):
      make(mesh, optimizer, state_sh)

  @pytest.mark.slow
  def test_tensor_splits_and_fsdp_shards_in_the_compiled_programs(self):
    """Per device, against data=4 over the same 4 slots: tensor=2 halves a ring's
    micro-step FLOPs; fsdp=2 halves the gradients the pool's reduce leaves each device and
    the update's optimizer state."""
    def cost(spec, devices):
      mesh = mesh_lib.make_mesh(spec, jax.devices()[:devices])
      optimizer, state_sh, state = init(mesh)
      run = make(mesh, optimizer, state_sh)
      update, ring = run.lower(state, 2)
      acc = jax.eval_shape(hdp_step._zero_sums, state.params)
      stacked = jax.tree.map(
          lambda x, s: jax.ShapeDtypeStruct((run.num_devices,) + x.shape, x.dtype, sharding=s),
          acc, run._stacked_sh)
      reduce = run._reduce.lower([], stacked).compile()
      return (ring.compile().cost_analysis()["flops"],
              reduce.memory_analysis().output_size_in_bytes,
              update.compile().memory_analysis().argument_size_in_bytes)

    flops, grads, update = cost("data=4", 4)
    tensor_flops, _, _ = cost("data=4,tensor=2", 8)
    _, fsdp_grads, fsdp_update = cost("data=4,fsdp=2", 8)
    self.assertLess(tensor_flops, 0.6 * flops)
    self.assertLess(fsdp_grads, 0.55 * grads)
    self.assertLess(fsdp_update, 0.55 * update)

if __name__ == "__main__":
  absltest.main()
