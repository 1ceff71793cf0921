"""The HDP simulator's byte counts equal what the executors' compiled programs send.

The simulator (jaxsys/parallel/hdp_sim.py, compiled=True) is evaluated for the tiny test
model (configs/tiny_lm.py:size=test: d 64, 2 layers, K/V 2 heads of 16, f32) and set
beside XLA:CPU's programs on the 8 simulated devices, counted as jaxsys.train.aot does
(bytes each device sends per collective kind, loop bodies times their trips):
- a per-rank ring program (PerRankHDPStep) over c = 2 and 4 devices: its K/V and dK/dV
  hops and its gradient all-reduce over the ring;
- the per-rank step's other programs: a local program sends nothing, the update nothing,
  and the final reduce one all-reduce over the pool per stacked sum;
- a static data=2,context=4 step with 2 accumulated micro-batches: its hops and its
  layout all-gather per micro-step; its all-reduces (per micro-batch, over context and
  over data) by the simulator's all-reduce formula.
With a sharded model (`data=2,fsdp=2,tensor=2`: 4 slots, each a tensor group of 2, ZeRO
over fsdp=2; CostModel(tensor=2, fsdp=2)):
- a per-rank ring program over 2 and 4 slots: K/V and dK/dV hops of a device's K/V head,
  the tensor group's activation all-reduces and the gradient all-reduce over the ring;
- a local program (the tensor all-reduces only), the parameters' gather over fsdp, the
  final reduce (one all-reduce over the 4 slots) and the update (scalars only);
- a static context=4,tensor=2 step: hops, layout all-gather, tensor all-reduces.
The one inexact count: the int32 segment ids and positions sent beside K/V ("keys"). XLA
sends the forward's once for all layers (every layer's are the same) and, at c = 2, the
backward reuses the forward's hop; the simulator counts them per layer and hop, so its
count is an upper bound (8 bytes a token, against K and V's 2 * kv_dim * 2 bytes at bf16:
4,096 for the simulated GQA model, 16,384 for MHA).
"""
import re

import jax
import numpy as np
import pytest

from conftest import load_run_config
from jaxsys import comm_bytes
from jaxsys import mesh as mesh_lib
from jaxsys.data.packing import FIELDS
from jaxsys.models import transformer
from jaxsys.parallel import cost, hdp_schedule, hdp_sim
from jaxsys.train import aot, hdp_step
from jaxsys.train import setup as setup_lib

RING_TPD = 128  # the per-rank run's tokens per device: a ring program's cell
# The static step: rows of 256 tokens on context=4 (64 tokens a device), 2 rows a
# micro-batch (data=2), 2 micro-batches.
STATIC_ROW, STATIC_ACCUM = 256, 2
# The sharded pool: 4 slots, each a tensor group of 2, ZeRO over fsdp=2.
SHARDED = "data=2,fsdp=2,tensor=2"
# An s32[...] collective-permute: the ring's segment ids and positions.
_KEYS = re.compile(r"= s32\[[^\]]*\]\S* collective-permute\(")


# A collective-permute that keeps some of its data in place (a {d,d} pair): a batch
# layout's, never a ring hop.
_IN_PLACE = re.compile(r"source_target_pairs=\{.*\{(\d+),\1\}")


def _sent(compiled, devices: int) -> dict[str, int]:
  """Bytes each device sends, by kind; "collective-permute" split into the f32 blocks
  (K, V, dK, dV), "keys" (s32) and "layout" (permutes that lay a batch out)."""
  hlo = compiled.as_text()
  sent = {kind: comm_bytes.collective_bytes_from_hlo(hlo, devices, trips=True, kind=kind)
          for kind in aot.COLLECTIVES}
  permutes = lambda lines: comm_bytes.collective_bytes_from_hlo("\n".join(lines), devices,
                                                           trips=True, kind="collective-permute")
  ring = [line for line in hlo.splitlines() if not _IN_PLACE.search(line)]
  sent["layout"] = sent.pop("collective-permute") - permutes(ring)
  sent["blocks"] = permutes(line for line in ring if not _KEYS.search(line))
  sent["keys"] = permutes(ring) - sent["blocks"]
  return sent


def _model(run) -> cost.CostModel:
  """The simulator's cost model of `run`'s model and mesh (a slot's tensor group, fsdp),
  its hops and all-reduces as compiled."""
  cfg, mesh = run.model, dict(mesh_lib.parse_mesh_spec(run.mesh))
  return cost.CostModel(sec_per_attention_flop=1.0, sec_per_linear_flop=1.0,
                           d_model=cfg.d_model, n_layers=cfg.n_layers,
                           kv_dim=cfg.n_kv_heads * cfg.hd,
                           bytes_per_element=np.dtype(cfg.dtype).itemsize,
                           compiled=True, params=transformer.param_count(cfg),
                           tensor=mesh.get("tensor", 1), fsdp=mesh.get("fsdp", 1))


def _per_rank(mesh: str, slots: int):
  """(run, setup, abstract state) of a per-rank HDP run over `mesh`'s `slots` slots."""
  run = load_run_config("stdlib", mesh=mesh, data__seq_len=RING_TPD,
                        data__variable_length=True, parallel__hdp=True,
                        data__max_len=slots * RING_TPD,
                        data__truncate_long=True)
  setup = setup_lib.make_setup(run, mesh_lib.make_mesh(run.mesh))
  return run, setup, aot._abstract(setup.abstract, setup.state_sh)


@pytest.fixture(scope="module")
def per_rank():
  return _per_rank("data=8", 8)


@pytest.fixture(scope="module")
def sharded():
  return _per_rank(SHARDED, 4)


@pytest.mark.parametrize("c", [2, 4])
def test_ring_program(per_rank, c):
  run, setup, state = per_rank
  update, ring = setup.train_fn.lower(state, c)
  sent = _sent(ring.compile(), c)
  model = _model(run)
  lengths = [c * RING_TPD]  # one sequence on the c devices it needs, cells of RING_TPD
  sched = hdp_schedule.schedule(lengths, num_devices=c, tokens_per_device=RING_TPD,
                                widen=False)
  (job,) = hdp_sim.schedule_jobs(sched, lengths, tokens_per_device=RING_TPD, model=model)
  assert len(job.devices) == c and sched.rings[0].cell == RING_TPD
  assert sent["blocks"] == job.sent["kv"] + job.sent["dkv"]
  assert 0 < sent["keys"] <= job.sent["keys"]
  assert sent["all-reduce"] == job.sent["all-reduce"] == model.allreduce_bytes(c)
  assert sent["all-gather"] == sent["reduce-scatter"] == sent["all-to-all"] == 0
  assert not any(_sent(update.compile(), 8).values())  # the update sends nothing


def test_local_program_and_final_reduce(per_rank):
  """A step of one ring and local micro-batches of two sizes ends with one all-reduce over
  the pool (the per-device sums added first); the local program sends nothing."""
  run, setup, state = per_rank
  executor, model = setup.train_fn, _model(run)
  lengths = [2 * RING_TPD] + [RING_TPD] * 6 + [RING_TPD // 8] * 6
  docs = [np.zeros(n + 1, np.int32) for n in lengths]
  sched = executor.plan(lengths)
  local = hdp_step.local_batches(sched, lengths, RING_TPD)
  assert len(sched.rings) == 1 and len(local) == 2
  acc = jax.eval_shape(hdp_step._zero_sums, state.params)
  stacked = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct((8,) + x.shape, x.dtype, sharding=s),
                         acc, executor._stacked_sh)
  reduce = _sent(executor._reduce.lower([stacked] * len(local), stacked).compile(), 8)
  assert reduce["all-reduce"] == model.allreduce_bytes(8)
  size = min(local)
  fields = {f: jax.ShapeDtypeStruct((8, 1, size), np.float32 if f == "loss_mask" else np.int32,
                                    sharding=executor._stacked_sh[0]) for f in FIELDS}
  counts = jax.ShapeDtypeStruct((8,), np.int32, sharding=executor._stacked_sh[0])
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        state.params, executor.gathered_sh)
  local_sent = _sent(executor.local_program(1).lower(params, fields, counts).compile(), 8)
  assert not any(local_sent.values())


@pytest.mark.slow
def test_static_step():
  run = load_run_config("stdlib", mesh="data=2,context=4", data__seq_len=STATIC_ROW,
                        data__batch_size=2 * STATIC_ACCUM,
                        optimizer__grad_accum_steps=STATIC_ACCUM)
  setup = setup_lib.make_setup(run, mesh_lib.make_mesh(run.mesh))
  state = aot._abstract(setup.abstract, setup.state_sh)
  sent = _sent(setup.train_fn.lower(state, aot._batch(run, setup.batch_sh)).compile(), 8)
  model = _model(run)
  # The same micro-steps simulated: 4 rows of 256 tokens, 2 to a lock-step micro-step.
  static = hdp_sim.simulate_static([STATIC_ROW] * 4, num_devices=8,
                                   tokens_per_device=STATIC_ROW // 4, model=model,
                                   max_len=STATIC_ROW)
  assert static.steps == STATIC_ACCUM
  assert sent["blocks"] == static.sent["kv"] + static.sent["dkv"]
  assert 0 < sent["keys"] <= static.sent["keys"]
  assert sent["all-gather"] == static.sent["all-gather"]
  # The compiled step all-reduces every micro-batch, over context and then over data; the
  # simulated baselines all-reduce once, over the pool (the strongest a static mesh does).
  assert sent["all-reduce"] == STATIC_ACCUM * (model.allreduce_bytes(4)
                                               + model.allreduce_bytes(2))
  assert static.sent["all-reduce"] == model.allreduce_bytes(8)


@pytest.mark.parametrize("c", [2, 4])
def test_sharded_ring_program(sharded, c):
  """A ring of c slots, each a tensor group: a device's K/V head travels the ring; its
  all-reduces are the tensor group's activations' and the gradients' over the ring."""
  run, setup, state = sharded
  _, ring = setup.train_fn.lower(state, c)
  sent = _sent(ring.compile(), 8)
  model = _model(run)
  lengths = [c * RING_TPD]
  sched = hdp_schedule.schedule(lengths, num_devices=c, tokens_per_device=RING_TPD,
                                widen=False)
  (job,) = hdp_sim.schedule_jobs(sched, lengths, tokens_per_device=RING_TPD, model=model)
  assert model.tensor == 2 and sched.rings[0].cell == RING_TPD
  assert sent["blocks"] == job.sent["kv"] + job.sent["dkv"]
  assert 0 < sent["keys"] <= job.sent["keys"]
  assert job.sent["all-reduce"] == model.allreduce_bytes(c)
  assert sent["all-reduce"] == job.sent["all-reduce"] + job.sent["tensor"]
  assert sent["all-gather"] == sent["reduce-scatter"] == sent["all-to-all"] == 0


def test_sharded_pool_programs(sharded):
  """The parameters' gather over fsdp, a local program (tensor all-reduces only), the
  final reduce (one all-reduce over the slots, whole) and the update (scalars only)."""
  run, setup, state = sharded
  executor, model = setup.train_fn, _model(run)
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        state.params, executor.params_sh)
  gather = _sent(executor._gather_jit.lower(params).compile(), 8)
  assert gather["all-gather"] == model.gather_bytes() > 0
  assert gather["all-reduce"] == gather["reduce-scatter"] == 0
  slots = executor.num_devices
  acc = jax.eval_shape(hdp_step._zero_sums, state.params)
  stacked = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct((slots,) + x.shape, x.dtype, sharding=s), acc,
      executor._stacked_sh)
  reduce = _sent(executor._reduce.lower([stacked], stacked).compile(), 8)
  assert reduce["all-reduce"] == model.allreduce_bytes(slots)
  assert reduce["all-gather"] == reduce["reduce-scatter"] == 0
  size = RING_TPD // 2
  fields = {f: jax.ShapeDtypeStruct((slots, 1, size),
                                    np.float32 if f == "loss_mask" else np.int32,
                                    sharding=executor._stacked_sh[0]) for f in FIELDS}
  counts = jax.ShapeDtypeStruct((slots,), np.int32, sharding=executor._stacked_sh[0])
  gathered = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          state.params, executor.gathered_sh)
  local = _sent(executor.local_program(1).lower(gathered, fields, counts).compile(), 8)
  assert local["all-reduce"] == model.tensor_bytes(size)
  update, _ = executor.lower(state, 2)
  # The update all-reduces only the gradient norm's partial sums (a scalar per leaf).
  assert sum(_sent(update.compile(), 8).values()) < 1024


def test_sharded_static_step():
  """A static context=4,tensor=2 step: 2 micro-batches of one row of 256 tokens."""
  run = load_run_config("stdlib", mesh="context=4,tensor=2", data__seq_len=STATIC_ROW,
                        data__batch_size=STATIC_ACCUM, optimizer__grad_accum_steps=STATIC_ACCUM)
  setup = setup_lib.make_setup(run, mesh_lib.make_mesh(run.mesh))
  state = aot._abstract(setup.abstract, setup.state_sh)
  sent = _sent(setup.train_fn.lower(state, aot._batch(run, setup.batch_sh)).compile(), 8)
  model = _model(run)
  static = hdp_sim.simulate_static([STATIC_ROW] * STATIC_ACCUM, num_devices=4,
                                   tokens_per_device=STATIC_ROW // 4, model=model,
                                   max_len=STATIC_ROW)
  assert static.steps == STATIC_ACCUM and model.tensor == 2
  assert sent["blocks"] == static.sent["kv"] + static.sent["dkv"]
  assert 0 < sent["keys"] <= static.sent["keys"]
  # Beside the tensor group's all-reduces, the compiled step all-reduces every
  # micro-batch's gradients over context (see test_static_step). With tensor, XLA lays the
  # rows out by permutes, all-gathers and all-reduces of the fields: the rest. That is
  # more than the simulator's all-gather of them (at most 1.5x), 20-odd bytes a token
  # against K/V's thousands.
  grads = STATIC_ACCUM * model.allreduce_bytes(4)
  layout = sent["all-gather"] + sent["layout"] + sent["all-reduce"] - static.sent["tensor"] - grads
  assert static.sent["all-gather"] <= layout <= 1.5 * static.sent["all-gather"]
