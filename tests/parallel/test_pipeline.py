"""The pipeline executor against the unpipelined model: loss and gradients, every schedule."""
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys import comm_bytes
from jaxsys import hlo_flops
from jaxsys import mesh as mesh_lib
from jaxsys.data import packing
from jaxsys.models import transformer
from jaxsys.parallel import pipeline
from jaxsys.train import step as step_lib
from jaxsys.train import config_check
from jaxsys.train.setup import make_setup

CFG = transformer.TransformerConfig(vocab_size=61, d_model=32, n_layers=4, n_heads=4,
                                    n_kv_heads=2, d_ff=64, attention_impl="xla")


def _batch(batch=8, seq=16, seed=0):
  b = packing.random_packed_batch(batch, seq, docs_per_row=2, vocab_size=CFG.vocab_size, seed=seed)
  return {k: jnp.asarray(v) for k, v in b.items()}


@functools.lru_cache(maxsize=None)
def _reference(tie: bool, n_layers: int = CFG.n_layers):
  cfg = dataclasses_replace(CFG, tie_embeddings=tie, n_layers=n_layers)
  params = transformer.init_params(cfg, jax.random.key(1))
  batch = _batch()
  loss_fn = lambda p: jnp.sum(step_lib.token_losses(cfg, p, batch))
  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
  return cfg, params, batch, loss, grads


def dataclasses_replace(cfg, **kw):
  import dataclasses
  return dataclasses.replace(cfg, **kw)


def _run(cfg, params, batch, mesh_spec, name, microbatches, virtual=1, vocab_parallel=False,
         algorithm=2, gather_once=False):
  mesh = mesh_lib.make_mesh(mesh_spec)
  stages = dict(mesh.shape)["stage"]
  layout = pipeline.Layout(stages=stages, virtual=virtual, vocab_size=cfg.vocab_size,
                           vocab_parallel=vocab_parallel, tensor=dict(mesh.shape).get("tensor", 1))
  schedule = pipeline.make_schedule(name, stages=stages, microbatches=microbatches,
                                    virtual_stages=virtual)
  staged = pipeline.to_stages(layout, params)
  fn = jax.jit(lambda p, b: pipeline.pipeline_loss_and_grads(
      cfg, schedule, layout, p, b, mesh=mesh, vocab_algorithm=algorithm,
      gather_once=gather_once))
  loss, grads = fn(staged, batch)
  return loss, pipeline.from_stages(layout, grads)


CASES = [
    ("stage=2,data=4", "gpipe", 4, 1),
    ("stage=2,tensor=2,data=2", "1f1b", 4, 1),
    ("stage=4,data=2", "1f1b", 4, 1),
    ("stage=2,data=4", "interleaved_1f1b", 4, 2),
    ("stage=4,data=2", "gpipe", 8, 1),
    ("stage=4,tensor=2", "interleaved_1f1b", 8, 1),
    ("stage=2,data=4", "eager_1f1b", 4, 1),
]


# The fast tier runs these pairs of (case, vocab_parallel); the others are slow.
FAST = {("stage=2,data=4", "interleaved_1f1b", False), ("stage=4,data=2", "gpipe", False),
        ("stage=2,data=4", "eager_1f1b", False), ("stage=4,data=2", "1f1b", True)}


@pytest.mark.parametrize("mesh_spec,name,microbatches,virtual,vocab_parallel", [
    pytest.param(*case, vp, marks=() if (*case[:2], vp) in FAST else pytest.mark.slow)
    for vp in (False, True) for case in CASES])
def test_matches_unpipelined(mesh_spec, name, microbatches, virtual, vocab_parallel):
  cfg, params, batch, ref_loss, ref_grads = _reference(False)
  loss, grads = _run(cfg, params, batch, mesh_spec, name, microbatches, virtual, vocab_parallel)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_close(grads, ref_grads)


def assert_close(tree, ref, rtol=1e-5):
  """Every leaf within rtol of the reference leaf's largest magnitude (summation order
  differs between microbatched and whole-batch gradients, so tiny entries wobble)."""
  chex.assert_trees_all_equal_shapes(tree, ref)
  for path, a, b in zip(jax.tree_util.tree_flatten_with_path(ref)[0], jax.tree.leaves(tree),
                        jax.tree.leaves(ref)):
    err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    assert err < rtol, f"{jax.tree_util.keystr(path[0])}: relative error {err:.2e}"


@pytest.mark.slow
def test_interleaved_with_two_virtual_stages_on_four():
  """Interleaved 1F1B at p=4, v=2 (8 chunks of one layer, m=8): each stage runs two chunks
  that are p apart in the model (v=2 is exact at p=2 in CASES, with and without VP)."""
  cfg, params, batch, ref_loss, ref_grads = _reference(False, n_layers=8)
  loss, grads = _run(cfg, params, batch, "stage=4,data=2", "interleaved_1f1b", 8, 2)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_close(grads, ref_grads)


@pytest.mark.parametrize("mesh_spec,tie,vocab_parallel,algorithm", [
    pytest.param("stage=4,data=2", True, False, 2, marks=pytest.mark.slow),
    ("stage=4,data=2", True, True, 1),
    ("stage=4,data=2", True, True, 2),
    # VP over stage x tensor (untied with Algorithm 2: CASES).
    pytest.param("stage=2,tensor=2,data=2", False, True, 1, marks=pytest.mark.slow),
    ("stage=2,tensor=2,data=2", True, True, 1),
    pytest.param("stage=2,tensor=2,data=2", True, True, 2, marks=pytest.mark.slow)])
def test_embeddings_and_vocab_algorithms(mesh_spec, tie, vocab_parallel, algorithm):
  cfg, params, batch, ref_loss, ref_grads = _reference(tie)
  loss, grads = _run(cfg, params, batch, mesh_spec, "1f1b", 4, vocab_parallel=vocab_parallel,
                     algorithm=algorithm)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_close(grads, ref_grads)


@pytest.mark.slow
def test_remat_and_bf16_compute():
  """Residual slots hold whatever the chunk's vjp keeps: with remat only layer inputs."""
  cfg = dataclasses_replace(CFG, remat="full", dtype="bfloat16")
  params = transformer.init_params(cfg, jax.random.key(1))
  batch = _batch()
  loss_fn = lambda p: jnp.sum(step_lib.token_losses(cfg, p, batch))
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(params)
  loss, grads = _run(cfg, params, batch, "stage=2,data=4", "1f1b", 4, vocab_parallel=True)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-2)
  assert_close(grads, ref_grads, rtol=5e-2)


@pytest.mark.parametrize("name,virtual", [("gpipe", 1), ("interleaved_1f1b", 2)])
@pytest.mark.slow
def test_executed_ticks_match_the_schedule(name, virtual):
  """The executor runs the fused ticks' actions (here the shorter lock step)."""
  cfg, params, batch, _, _ = _reference(False)
  mesh = mesh_lib.make_mesh("stage=2,data=4")
  layout = pipeline.Layout(stages=2, virtual=virtual, vocab_size=cfg.vocab_size,
                           vocab_parallel=False)
  schedule = pipeline.make_schedule(name, stages=2, microbatches=4, virtual_stages=virtual)
  _, _, counts = jax.jit(lambda p, b: pipeline.pipeline_loss_and_grads(
      cfg, schedule, layout, p, b, mesh=mesh, with_counts=True))(
          pipeline.to_stages(layout, params), batch)
  assert schedule.executed is schedule.fused
  np.testing.assert_array_equal(counts, schedule.fused.counts())
  # Every chunk forward and backward once; fewer idle ticks than the table's.
  assert counts[:, pipeline.FORWARD].tolist() == counts[:, pipeline.BACKWARD].tolist() == [
      4 * virtual] * 2
  assert counts[:, pipeline.IDLE].sum() < np.sum(schedule.unfused.kind == pipeline.IDLE)


# (mesh, schedule, virtual, VP): each run in the tick shape it does NOT run by default (the
# exactness tests run the default), on 2 stages; with `context`, every stage runs every
# action of a lane and keeps its own (uniform ticks).
@pytest.mark.parametrize("mesh_spec,name,virtual,vocab_parallel", [
    ("stage=2,data=4", "gpipe", 1, True), ("stage=2,data=4", "1f1b", 1, False),
    ("stage=2,data=4", "1f1b", 1, True), ("stage=2,data=4", "interleaved_1f1b", 2, True),
    ("stage=2,data=4", "zb_h1", 1, False), ("stage=2,data=4", "zbv", 2, True),
    ("stage=2,context=2,data=2", "zb_h1", 1, False)])
@pytest.mark.slow
def test_both_tick_shapes_exact(mesh_spec, name, virtual, vocab_parallel):
  """Fused and table ticks give the unpipelined loss and gradients; the compiled loop runs
  the shape's number of ticks, and the executor counts the shape's actions."""
  cfg, params, batch, ref_loss, ref_grads = _reference(False)
  mesh = mesh_lib.make_mesh(mesh_spec)
  layout = pipeline.Layout(stages=2, virtual=virtual, vocab_size=cfg.vocab_size,
                           vocab_parallel=vocab_parallel)
  schedule = pipeline.make_schedule(name, stages=2, microbatches=4, virtual_stages=virtual)
  fused = schedule.executed is not schedule.fused
  ticks = schedule.fused if fused else schedule.unfused
  assert ticks.ticks != schedule.executed.ticks
  staged = pipeline.to_stages(layout, params)
  compiled = jax.jit(lambda p, b: pipeline.pipeline_loss_and_grads(
      cfg, schedule, layout, p, b, mesh=mesh, with_counts=True, fused=fused)).lower(
          staged, batch).compile()
  comps, _ = hlo_flops.computations(compiled.as_text())
  trips = [hlo_flops.trip_count(line, comps) for lines in comps.values() for line in lines
           if " while(" in line]
  assert ticks.ticks in trips and schedule.executed.ticks not in trips, trips
  loss, grads, counts = compiled(staged, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_close(pipeline.from_stages(layout, grads), ref_grads)
  np.testing.assert_array_equal(counts, ticks.counts())


def _temp_bytes(name, microbatches):
  cfg = dataclasses_replace(CFG, d_model=64, d_ff=128)
  mesh = mesh_lib.make_mesh("stage=4,data=2")
  layout = pipeline.Layout(stages=4, virtual=1, vocab_size=cfg.vocab_size, vocab_parallel=False)
  schedule = pipeline.make_schedule(name, stages=4, microbatches=microbatches)
  params = jax.eval_shape(lambda: pipeline.to_stages(
      layout, transformer.init_params(cfg, jax.random.key(0))))
  rows, seq = 2 * microbatches, 64  # a fixed microbatch of 2 rows
  batch = {k: jax.ShapeDtypeStruct((rows, seq), jnp.int32)
           for k in ("inputs", "targets", "positions", "segment_ids")}
  batch["loss_mask"] = jax.ShapeDtypeStruct((rows, seq), jnp.float32)
  fn = jax.jit(lambda p, b: pipeline.pipeline_loss_and_grads(cfg, schedule, layout, p, b, mesh=mesh))
  return fn.lower(params, batch).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_1f1b_memory_grows_with_stages_not_microbatches():
  one_f_one_b = [_temp_bytes("1f1b", m) for m in (4, 8, 16)]
  gpipe = _temp_bytes("gpipe", 16)
  # 1F1B holds `stages` microbatches' residuals whatever m is; GPipe holds all m (measured:
  # 3.78 MB for 1F1B at every m, 9.84 MB for GPipe at 16).
  assert max(one_f_one_b) < 1.05 * min(one_f_one_b), one_f_one_b
  assert one_f_one_b[-1] < gpipe / 2.5, (one_f_one_b, gpipe)


_COPY = re.compile(r"=\s*(\S+)\s+copy\((%[\w.\-]+)\)")
_FILL = re.compile(r" broadcast\(|calls=%?wrapped_broadcast")


def _copied_per_tick(hlo: str, ticks: int) -> int:
  """Bytes of live buffers the tick loop's body copies on its costliest path: its own
  copies, and of each conditional the branch that copies most (one branch runs). A copy
  of a broadcast is how XLA fills a branch's zero results, not a buffer copied: left out."""
  comps, _ = hlo_flops.computations(hlo)

  def copied(computation: str) -> int:
    total = 0
    lines = comps[computation]
    defs = {line.split("=", 1)[0].strip(): line for line in lines if "=" in line}
    for line in lines:
      copy = _COPY.search(line)
      if copy and not _FILL.search(defs.get(copy[2], "")):
        total += comm_bytes._shape_bytes(copy[1])
      branches = comm_bytes._BRANCHES.search(line)
      if branches:
        names = (re.findall(r"%?([\w.\-]+)", branches[1]) if branches[1]
                 else branches.group(2, 3))
        total += max(copied(n) for n in names)
    return total

  return copied(_tick_body(comps, ticks))


def _tick_body(comps, ticks: int) -> str:
  (body,) = [name for lines in comps.values() for line in lines
             if " while(" in line and hlo_flops.trip_count(line, comps) == ticks
             for name in re.findall(r"body=%?([\w.\-]+)", line)]
  return body


_SLICE = re.compile(r"=\s*(\S+)\s+(dynamic-slice|fusion)\(")


def _sliced_every_tick(hlo: str, ticks: int) -> int:
  """Bytes the tick loop's body slices out of its buffers outside any conditional, so every
  tick, whatever its stages run: dynamic slices, alone or fused (not into a write)."""
  comps, _ = hlo_flops.computations(hlo)
  total = 0
  for line in comps[_tick_body(comps, ticks)]:
    op = _SLICE.search(line)
    if not op or op[1].startswith("("):
      continue
    called = re.search(r"calls=%?([\w.\-]+)", line)
    fused = "\n".join(comps.get(called[1] if called else "", []))
    # A fused dynamic-update-slice writes one slot in place (its shape is the buffer's).
    if op[2] == "dynamic-slice" or (" dynamic-slice(" in fused
                                    and " dynamic-update-slice(" not in fused):
      total += comm_bytes._shape_bytes(op[1])
  return total


@pytest.mark.parametrize("name,fused", [("gpipe", None),
                                        pytest.param("1f1b", None, marks=pytest.mark.slow),
                                        pytest.param("1f1b", True, marks=pytest.mark.slow)])
def test_a_tick_copies_no_buffer(name, fused):
  """A tick copies no live buffer as big as one microbatch's activation, and slices out of
  its buffers, whatever runs, at most a few activations, however many
  residual slots the schedule keeps (GPipe 8, 1F1B 4 at m=8): 12 bytes here (scalars).
  Branches that carried the loop's buffers copied them all every tick (5.2 MB for 1F1B,
  9.1 MB for GPipe at one layer a chunk); with a switch per lane, fused ticks copied every
  residual buffer twice a tick; a chunk's gradient sum carried through the tick's switch
  (three or more branches) was copied in its idle branch and again into the loop's
  buffer: 0.99 MB a tick here, at two layers a chunk."""
  cfg = dataclasses_replace(CFG, d_model=64, d_ff=128, n_layers=8)
  mesh = mesh_lib.make_mesh("stage=4,data=2")
  layout = pipeline.Layout(stages=4, virtual=1, vocab_size=cfg.vocab_size, vocab_parallel=False)
  schedule = pipeline.make_schedule(name, stages=4, microbatches=8)
  params = jax.eval_shape(lambda: pipeline.to_stages(
      layout, transformer.init_params(cfg, jax.random.key(0))))
  batch = {k: jax.ShapeDtypeStruct((16, 64), jnp.float32 if k == "loss_mask" else jnp.int32)
           for k in packing.FIELDS}
  fn = jax.jit(lambda p, b: pipeline.pipeline_loss_and_grads(cfg, schedule, layout, p, b,
                                                             mesh=mesh, fused=fused))
  ticks = schedule.fused if fused else schedule.executed
  hlo = fn.lower(params, batch).compile().as_text()
  activation = 1 * 64 * cfg.d_model * 4  # one device's microbatch: 1 row of 64 tokens
  copied = _copied_per_tick(hlo, ticks.ticks)
  assert copied < activation, copied
  # An action's weights, residual slot and stash are sliced inside its branch, so what a
  # tick slices whatever runs is activation-sized (inputs, output gradients, sends): 98.9
  # KB here, 6 activations; with the chunk's weights and residual slot sliced before the
  # switch, 1.06 MB.
  sliced = _sliced_every_tick(hlo, ticks.ticks)
  assert sliced < 8 * activation, sliced


def _fsdp_step_collectives(cfg, mesh, layout, schedule, gather_once):
  """{kind: (bytes a step sends, bytes outside the ticks' loop)} of the compiled 1F1B
  step, its parameters placed as a run places them (split over fsdp)."""
  sh = mesh_lib.logical_to_sharding(layout.logical_axes(transformer.param_axes(cfg)), mesh,
                                    layout.rules(mesh_lib.DEFAULT_RULES))
  params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        jax.eval_shape(lambda: pipeline.to_stages(
                            layout, transformer.init_params(cfg, jax.random.key(0)))), sh)
  batch = {k: jax.ShapeDtypeStruct((32, 32), jnp.float32 if k == "loss_mask" else jnp.int32)
           for k in packing.FIELDS}
  hlo = jax.jit(lambda p, b: pipeline.pipeline_loss_and_grads(
      cfg, schedule, layout, p, b, mesh=mesh, gather_once=gather_once)).lower(
          params, batch).compile().as_text()
  kinds = ("all-gather", "all-reduce", "reduce-scatter")
  return {k: (comm_bytes.collective_bytes_from_hlo(hlo, 8, trips=True, kind=k),
              comm_bytes.collective_bytes_from_hlo(hlo, 8, kind=k)) for k in kinds}


@pytest.mark.slow
def test_gather_once_moves_weights_once_a_step():
  """Pipeline x FSDP with `gather_once`: each stage's weights are all-gathered before the
  ticks and their gradients reduce-scattered after them, nothing over fsdp inside the loop
  (stage=2, fsdp=4, 1F1B, m=4); the per-tick mode all-reduces 22x those bytes (45 MiB).
  Exact against the unpipelined model, training and evaluation."""
  cfg = dataclasses_replace(CFG, d_model=64, d_ff=256, n_layers=8, vocab_size=512)
  mesh = mesh_lib.make_mesh("stage=2,fsdp=4")
  layout = pipeline.Layout(stages=2, virtual=1, vocab_size=cfg.vocab_size, vocab_parallel=False)
  schedule = pipeline.make_schedule("1f1b", stages=2, microbatches=4)
  once = _fsdp_step_collectives(cfg, mesh, layout, schedule, gather_once=True)
  per_tick = _fsdp_step_collectives(cfg, mesh, layout, schedule, gather_once=False)
  assert all(step == outside for step, outside in once.values()), once  # none in the loop
  stage_bytes = 4 * transformer.param_count(cfg) // 2  # f32, about half the model a stage
  assert once["all-gather"][0] == once["reduce-scatter"][0] < stage_bytes
  moved = lambda kinds: sum(step for step, _ in kinds.values())
  assert moved(per_tick) > 10 * moved(once), (per_tick, once)

  cfg, params, batch, ref_loss, ref_grads = _reference(False)
  for vocab_parallel in (False, True):
    loss, grads = _run(cfg, params, batch, "stage=2,fsdp=2,data=2", "1f1b", 2,
                       vocab_parallel=vocab_parallel, gather_once=True)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)
  layout = pipeline.Layout(stages=2, virtual=1, vocab_size=cfg.vocab_size, vocab_parallel=False)
  evaluate = jax.jit(lambda p, b: pipeline.pipeline_loss(
      cfg, pipeline.make_schedule("1f1b", stages=2, microbatches=2), layout, p, b,
      mesh=mesh_lib.make_mesh("stage=2,fsdp=4"), gather_once=True))
  np.testing.assert_allclose(evaluate(pipeline.to_stages(layout, params), batch), ref_loss,
                             rtol=1e-5)


def test_layout_round_trip():
  """to_stages/from_stages are inverses; layer l sits on stage (l // chunk) % stages."""
  cfg = dataclasses_replace(CFG, n_layers=16)
  params = transformer.init_params(cfg, jax.random.key(0))
  layout = pipeline.Layout(stages=4, virtual=2, vocab_size=cfg.vocab_size, vocab_parallel=True)
  staged = pipeline.to_stages(layout, params)
  assert staged["layers"]["wq"].shape[:3] == (2, 4, 2)
  assert staged["embedding"].shape[0] == 64  # 61 padded to a multiple of 4
  chex.assert_trees_all_equal(pipeline.from_stages(layout, staged), params)
  for l in range(cfg.n_layers):
    g = l // 2
    np.testing.assert_array_equal(staged["layers"]["wq"][g // 4, g % 4, l % 2],
                                  params["layers"]["wq"][l])


@pytest.mark.parametrize("mesh_spec,vocab_parallel,shards", [
    ("stage=4,data=2", False, 1), ("stage=4,data=2", True, 4), ("stage=4,tensor=2", True, 8)])
def test_vocab_layer_bytes_per_device(mesh_spec, vocab_parallel, shards, make_config):
  """With VP every device holds 1/(stages x tensor) of the (padded) vocab layers and their
  Adam moments."""
  config = make_config(mesh=mesh_spec, pipeline__schedule="1f1b",
                       pipeline__vocab_parallel=vocab_parallel, model__n_layers=4)
  run = config_check.check_config(config)
  model_cfg, mesh = run.model, mesh_lib.make_mesh(run.mesh)
  setup = make_setup(run, mesh)

  def vocab_bytes(sharding_tree, abstract_tree):
    total = 0
    for path, sh in jax.tree_util.tree_flatten_with_path(sharding_tree)[0]:
      if pipeline.layout.leaf_kind(path) in pipeline.VOCAB_PARAMS:
        leaf = functools.reduce(lambda t, k: t[k.key] if hasattr(k, "key") else getattr(t, k.name),
                                path, abstract_tree)
        total += np.prod(sh.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return total

  per_device = vocab_bytes(setup.state_sh.params, setup.abstract.params)
  whole = 2 * model_cfg.vocab_size * model_cfg.d_model * 4  # embedding + output layer, f32
  padded = 2 * setup.view.stages.padded_vocab * model_cfg.d_model * 4
  assert setup.view.stages.padded_vocab % shards == 0
  assert per_device == (padded // shards if vocab_parallel else whole)


def _vocab_dots_only(hlo: str, vocab_dims) -> str:
  """`hlo` with every dot that has none of `vocab_dims` in its output's or operands' shape
  renamed out of `hlo_flops.dot_flops`'s sight: the output layer's three matmuls (logits,
  dh, dw) remain."""
  shapes = dict(re.findall(r"%([\w.\-]+) = \w+\[([\d,]*)\]", hlo))
  dot = re.compile(r"= \w+\[([\d,]*)\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)")

  def keep(line):
    m = dot.search(line)
    return m is None or any(int(d) in vocab_dims for ds in (m[1], shapes[m[2]], shapes[m[3]])
                            for d in ds.split(",") if d)
  return "\n".join(l if keep(l) else l.replace(" dot(", " not-a-dot(") for l in hlo.splitlines())


def test_vocab_parallel_output_layer_flops_over_stage_and_tensor():
  """On stage=4,tensor=2 each device runs 1/8 of the output layer's matmuls (VP over stage
  alone: 1/4, each stage's shard replicated over tensor), read from the compiled program:
  the dots with a vocabulary dim (V, V/4 or V/8 = 37, no other dim of the model), the
  tick loop's head branch counted on every tick, against the unsplit layer's 3 matmuls
  (logits, dh, dw) of 2 x tokens x d_model x V each per microbatch."""
  v = 8 * 37
  cfg = dataclasses_replace(CFG, vocab_size=v)
  mesh = mesh_lib.make_mesh("stage=4,tensor=2")
  layout = pipeline.Layout(stages=4, virtual=1, vocab_size=v, vocab_parallel=True, tensor=2)
  schedule = pipeline.make_schedule("1f1b", stages=4, microbatches=4)
  params = jax.eval_shape(lambda: pipeline.to_stages(
      layout, transformer.init_params(cfg, jax.random.key(0))))
  rows, seq = 4, 16  # one row of 16 tokens a microbatch
  batch = {k: jax.ShapeDtypeStruct((rows, seq), jnp.float32 if k == "loss_mask" else jnp.int32)
           for k in packing.FIELDS}
  fn = jax.jit(lambda p, b: pipeline.pipeline_loss_and_grads(cfg, schedule, layout, p, b,
                                                             mesh=mesh))
  hlo = fn.lower(params, batch).compile().as_text()
  per_device = hlo_flops.dot_flops(_vocab_dots_only(hlo, {v, v // 4, v // 8}))
  unsplit = schedule.ticks * 3 * 2 * (rows // 4 * seq) * cfg.d_model * v
  assert per_device / unsplit == pytest.approx(1 / 8), per_device / unsplit


def test_vocab_split_over_a_tensor_axis_the_mesh_lacks_is_refused():
  cfg, params, batch, _, _ = _reference(False)
  layout = pipeline.Layout(stages=2, virtual=1, vocab_size=cfg.vocab_size, vocab_parallel=True,
                           tensor=4)
  mesh = mesh_lib.make_mesh("stage=2,tensor=2,data=2")
  with pytest.raises(ValueError, match=r"over tensor=4, the mesh has tensor=2") as err:
    pipeline.pipeline_loss_and_grads(
        cfg, pipeline.make_schedule("1f1b", stages=2, microbatches=4), layout,
        pipeline.to_stages(layout, params), batch, mesh=mesh)
  assert "\n" not in str(err.value)


@pytest.mark.parametrize("mesh_spec,name,virtual,vocab_parallel", [
    ("stage=2,data=4", "1f1b", 1, False), ("stage=4,tensor=2", "interleaved_1f1b", 1, True),
    ("stage=2,data=4", "interleaved_1f1b", 2, True)])
def test_forward_only_loss(mesh_spec, name, virtual, vocab_parallel):
  """Evaluation runs the schedule's forwards only and gives the unpipelined loss."""
  cfg, params, batch, ref_loss, _ = _reference(False)
  mesh = mesh_lib.make_mesh(mesh_spec)
  stages = dict(mesh.shape)["stage"]
  layout = pipeline.Layout(stages=stages, virtual=virtual, vocab_size=cfg.vocab_size,
                           vocab_parallel=vocab_parallel, tensor=dict(mesh.shape).get("tensor", 1))
  schedule = pipeline.make_schedule(name, stages=stages, microbatches=4, virtual_stages=virtual)
  fn = jax.jit(lambda p, b: pipeline.pipeline_loss(cfg, schedule, layout, p, b, mesh=mesh))
  staged = pipeline.to_stages(layout, params)
  np.testing.assert_allclose(fn(staged, batch), ref_loss, rtol=1e-5)
  hlo = fn.lower(staged, batch).compile().as_text()
  assert "all-gather" not in hlo  # no stage gathers another's layers


def test_residual_slots_hold_no_weights():
  """Stored residuals scale with the microbatch: none is a (reshaped) copy of a weight."""
  params = transformer.init_params(CFG, jax.random.key(0))["layers"]

  def stored_bytes(rows):
    chunk = pipeline.chunk.Chunk(CFG, functools.partial(transformer.local_attention, impl="xla"))
    x = jax.ShapeDtypeStruct((rows, 16, CFG.d_model), jnp.float32)
    mb = {k: jax.ShapeDtypeStruct((rows, 16), jnp.int32) for k in ("positions", "segment_ids")}
    return sum(r.size * r.dtype.itemsize for r in chunk.residual_shapes(params, x, mb))

  assert stored_bytes(4) == 2 * stored_bytes(2)


@pytest.mark.parametrize("name,virtual", [("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2)])
def test_weight_moves_are_the_compiled_program_s(name, virtual):
  """`executor.rows_moved` (what bench_pipeline_wall charges a step for a V's weights and
  gradients) against the compiled step: collective-permutes outside the tick loop, one a
  weight leaf each way, exactly where a row moves."""
  mesh = mesh_lib.make_mesh("stage=2", jax.devices()[:2])
  layout = pipeline.Layout(stages=2, virtual=virtual, vocab_size=CFG.vocab_size,
                           vocab_parallel=False)
  schedule = pipeline.make_schedule(name, stages=2, microbatches=4, virtual_stages=virtual)
  cfg, params, batch, _, _ = _reference(False)
  step = jax.jit(lambda p, b: pipeline.pipeline_loss_and_grads(cfg, schedule, layout, p, b,
                                                               mesh=mesh))
  hlo = step.lower(pipeline.to_stages(layout, params), batch).compile().as_text()
  comps, _ = hlo_flops.computations(hlo)
  body = _tick_body(comps, schedule.executed.ticks)
  outside = [line for comp, lines in comps.items() if comp != body for line in lines
             if re.search(r" collective-permute(-start)?\(", line)]
  leaves = len(jax.tree.leaves(params["layers"]))
  assert len(outside) == 2 * leaves * pipeline.executor.rows_moved(schedule)
