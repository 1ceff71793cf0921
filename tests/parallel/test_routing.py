"""NoLoCo's random routing between replicas' pipelines: the routes, and the executor against
references without a pipeline (fixed routing: each replica's own model; random routing: each
microbatch through the stages of the replicas it visited)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxsys import comm_bytes
from jaxsys import mesh as mesh_lib
from jaxsys.data import packing
from jaxsys.models import transformer
from jaxsys.parallel import pipeline, routing
from jaxsys.train import setup as setup_lib
from jaxsys.train import step as step_lib

CFG = transformer.TransformerConfig(vocab_size=61, d_model=32, n_layers=4, n_heads=4,
                                    n_kv_heads=2, d_ff=64, attention_impl="xla")


def _batch(rows, seq=16, seed=0):
  b = packing.random_packed_batch(rows, seq, docs_per_row=2, vocab_size=CFG.vocab_size, seed=seed)
  return {k: jnp.asarray(v) for k, v in b.items()}


def _replica_params(replicas, seed=1):
  """Different parameters per replica, so a microbatch's route changes its loss."""
  keys = jax.random.split(jax.random.key(seed), replicas)
  return jax.vmap(lambda k: transformer.init_params(CFG, k))(keys)


def test_routes_are_permutations_that_change_with_the_step():
  R, M, G = 4, 8, 3
  draws = [routing.draw_shifts(0, step, R, M, G) for step in range(50)]
  assert draws[0].shape == (M, G - 1)
  assert not np.array_equal(draws[0], draws[1])  # a new draw every step
  np.testing.assert_array_equal(draws[3], routing.draw_shifts(0, 3, R, M, G))  # seeded
  assert not np.array_equal(draws[3], routing.draw_shifts(1, 3, R, M, G))
  pairs = np.zeros((R, R), int)
  for shifts in draws:
    route = routing.routes(shifts, R)  # [M, G, R]
    assert (route[:, 0] == np.arange(R)).all()  # every microbatch starts on its replica
    for m in range(M):
      for g in range(1, G):
        # Each boundary is a permutation: every replica sends and receives exactly once.
        assert sorted(route[m, g]) == list(range(R))
        np.add.at(pairs, (route[m, g - 1], route[m, g]), 1)
  # Every pair (staying included) is reachable and about equally likely: 800 moves a row.
  assert pairs.min() > 0.7 * pairs.mean() and pairs.max() < 1.3 * pairs.mean(), pairs


def test_shift_moves_rows_when_stage_groups_shift_differently():
  """The collective itself, as the executor runs it: in one call each stage group has its
  own shift k (here 3 and 1 on a 4 x 2 mesh), and x of replica i lands on i + k."""
  mesh = mesh_lib.make_mesh("replica=4,stage=2")

  def body(x, ks):
    k = ks[jax.lax.axis_index("stage")]
    return routing.shift(x, k, 4)

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("replica", "stage"), P()),
                             out_specs=P("replica", "stage"), check_vma=False))
  x = np.arange(8, dtype=np.float32).reshape(4, 2)
  out = np.asarray(fn(x, jnp.asarray([3, 1])))
  for s, k in enumerate((3, 1)):
    np.testing.assert_array_equal(out[:, s], np.roll(x[:, s], k))


def _on_host(tree):
  """`tree` as numpy arrays: a reference jitted on them runs on one device, with no
  collective of XLA's choosing between it and what it checks."""
  return jax.tree.map(np.asarray, tree)


def _routed_reference(params_R, batch, shifts, weights, microbatches, chunks):
  """(loss of replica r's rows [R], gradients of sum_r weights[r] * loss[r]), each microbatch
  through the chunks of the replicas its route visits; plain jax, no pipeline, no collective."""
  R = jax.tree.leaves(params_R)[0].shape[0]
  route = routing.routes(shifts, R)
  (_, values), grads = _reference_fn(microbatches, chunks)(
      *_on_host((params_R, batch, route, weights)))
  return values, grads


@functools.lru_cache(maxsize=None)
def _reference_fn(microbatches, chunks):
  """jit of (params [R..], batch, route [M, G, R], weights) -> value_and_grad of the objective."""
  size = CFG.n_layers // chunks
  per_mb = lambda f: jax.vmap(jax.vmap(f))  # over microbatches and starting replicas

  def objective(params_R, batch, route, weights):
    R = route.shape[2]
    _, attention_fn = transformer.default_inputs(CFG, batch["inputs"], None, None)
    mbs = jax.tree.map(lambda x: x.swapaxes(0, 1),  # [M, R, rows, T]
                       pipeline.layout.microbatches_by_replica(batch, R, microbatches))
    x = per_mb(lambda e, t: transformer.embed(CFG, e, t))(
        params_R["embedding"][route[:, 0]], mbs["inputs"])
    for g in range(chunks):
      layers = jax.tree.map(lambda a: a[route[:, g], g * size:(g + 1) * size], params_R["layers"])
      chunk = lambda p, x, pos, seg: transformer.apply_layers(CFG, p, x, pos, seg, attention_fn)
      x = per_mb(chunk)(layers, x, mbs["positions"], mbs["segment_ids"])
    last = jax.tree.map(lambda a: a[route[:, chunks - 1]], params_R)
    logits = per_mb(lambda p, x: transformer.unembed(CFG, x, p["final_norm"], p["embedding"],
                                                     p.get("unembedding")))(last, x)
    values = jnp.sum(per_mb(step_lib.cross_entropy)(logits, mbs), axis=(0, 2, 3))
    return jnp.sum(weights * values), values
  return jax.jit(jax.value_and_grad(objective, has_aux=True))


MESH, SCHEDULE, M, V = "replica=2,stage=2,data=2", "interleaved_1f1b", 4, 2


@functools.lru_cache(maxsize=None)
def _executor(routed: bool):
  """(compiled executor, its HLO text): two replicas, two stages of two virtual chunks each
  (so one boundary runs from the last stage back to the first), vocabulary parallel, over a
  data axis; canonical parameters in and out."""
  mesh = mesh_lib.make_mesh(MESH)
  layout = pipeline.Layout(stages=2, virtual=V, vocab_size=CFG.vocab_size, vocab_parallel=True)
  schedule = pipeline.make_schedule(SCHEDULE, stages=2, microbatches=M, virtual_stages=V)
  to_view = jax.vmap(functools.partial(pipeline.to_stages, layout))
  from_view = jax.vmap(functools.partial(pipeline.from_stages, layout))

  def run(params_R, batch, shifts, weights):
    loss, grads = pipeline.replica_loss_and_grads(
        CFG, schedule, layout, to_view(params_R), batch, mesh=mesh,
        shifts=shifts if routed else None, weights=weights)
    return loss, from_view(grads)
  compiled = jax.jit(run).lower(*_inputs()).compile()
  return compiled, compiled.as_text()


@functools.lru_cache(maxsize=None)
def _inputs():
  """Two replicas' different parameters, a batch sharded as the loop shards it, routes, weights."""
  R = 2
  batch = jax.device_put(_batch(R * M * 2), mesh_lib.batch_sharding(mesh_lib.make_mesh(MESH)))
  shifts = routing.draw_shifts(0, 5, R, M, 2 * V)
  return _replica_params(R), batch, shifts, jnp.asarray([1.0, 0.25])


def _assert_close(tree, ref, rtol=1e-5):
  """Every leaf within rtol of the reference leaf's largest magnitude."""
  for path, a, b in zip(jax.tree_util.tree_flatten_with_path(ref)[0],
                        jax.tree.leaves(_on_host(tree)), jax.tree.leaves(_on_host(ref))):
    err = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
    assert err < rtol, f"{jax.tree_util.keystr(path[0])}: relative error {err:.2e}"


@pytest.mark.slow
def test_identity_routing_is_each_replicas_own_pipeline_and_model():
  """Random routing whose draws are all 0 == fixed routing == each replica's model alone,
  unpipelined (per-replica loss sums and gradients), with per-replica loss weights."""
  params_R, batch, shifts, weights = _inputs()
  R = 2
  loss_f, grads_f = _executor(False)[0](params_R, batch, shifts, weights)
  loss_r, grads_r = _executor(True)[0](params_R, batch, jnp.zeros_like(shifts), weights)

  def per_replica(params, rows, w):  # the unpipelined replica step's summed loss
    loss = jnp.sum(step_lib.token_losses(CFG, params, rows))
    return w * loss, loss
  rows = jax.tree.map(lambda x: x.reshape(R, -1, *x.shape[1:]), _on_host(batch))
  grads_ref, loss_ref = jax.jit(jax.vmap(jax.grad(per_replica, has_aux=True)))(
      *_on_host((params_R, rows, weights)))
  np.testing.assert_allclose(loss_f, loss_ref, rtol=1e-5)
  np.testing.assert_allclose(loss_r, loss_ref, rtol=1e-5)
  _assert_close(grads_f, grads_ref)
  _assert_close(grads_r, grads_ref)


def test_random_routing_gradients_follow_the_route():  # the fast tier's check of uneven weights
  """Loss per replica and gradients equal jax.grad of the losses through the route's replicas."""
  params_R, batch, shifts, weights = _inputs()
  assert 0 < int(jnp.sum(shifts)) < shifts.size  # some microbatches cross, some stay
  loss, grads = _executor(True)[0](params_R, batch, shifts, weights)
  loss_ref, grads_ref = _routed_reference(params_R, batch, shifts, weights, M, 2 * V)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
  unrouted, _ = _routed_reference(params_R, batch, jnp.zeros_like(shifts), weights, M, 2 * V)
  assert not np.allclose(loss, unrouted, rtol=1e-3)  # the routes really change the losses
  _assert_close(grads, grads_ref)


@pytest.mark.slow
def test_random_routing_attributes_losses_to_their_rows():
  """Replicas with equal parameters: each microbatch's loss is the same on any route, so the
  routed losses per replica are the unrouted ones, and the replicas' summed gradients too."""
  params_R, batch, shifts, weights = _inputs()
  same = jax.tree.map(lambda x: jnp.broadcast_to(x[:1], x.shape), params_R)
  loss, grads = _executor(True)[0](same, batch, shifts, weights)
  loss_f, grads_f = _executor(False)[0](same, batch, shifts, weights)
  np.testing.assert_allclose(loss, loss_f, rtol=1e-5)
  summed = lambda tree: jax.tree.map(lambda x: np.sum(x, axis=0), _on_host(tree))
  _assert_close(summed(grads), summed(grads_f))
  assert not np.allclose(grads["layers"]["wq"], grads_f["layers"]["wq"], rtol=1e-3)


@pytest.mark.slow
def test_bytes_match_the_compiled_program():
  """`setup.transfer_bytes` against the executors' HLO (ring rules): the tick's
  collective-permutes, and routing's extra bytes (shifts per tick, the batch gathered once)."""
  schedule = pipeline.make_schedule(SCHEDULE, stages=2, microbatches=M, virtual_stages=V)
  mesh = mesh_lib.make_mesh(MESH)
  batch = _inputs()[1]
  (tick_f, once_f), (tick_r, once_r) = (setup_lib.transfer_bytes(
      CFG, schedule, mesh, batch["inputs"].shape[0], batch["inputs"].shape[1], routed)
      for routed in (False, True))
  assert once_f == 0 and tick_r == 2 * tick_f  # two replicas: one more hop each way
  hlo_f, hlo_r = _executor(False)[1], _executor(True)[1]
  permutes = lambda hlo: sum(b for op, b in comm_bytes.collective_ops_from_hlo(hlo)
                             if op == "collective-permute")
  assert (permutes(hlo_f), permutes(hlo_r)) == (tick_f, tick_r)  # all in the tick's body
  extra = comm_bytes.collective_bytes_from_hlo(hlo_r, 8) - comm_bytes.collective_bytes_from_hlo(
      hlo_f, 8)
  assert extra == tick_r - tick_f + once_r


def _four_replicas(name, microbatches, shifts):
  """R=4 replicas of 2-stage `name` pipelines (no data axis, no VP) routed by `shifts`:
  their (loss, gradients) and the reference's through the same routes."""
  R, G = 4, 2
  mesh = mesh_lib.make_mesh("replica=4,stage=2")
  layout = pipeline.Layout(stages=2, virtual=1, vocab_size=CFG.vocab_size, vocab_parallel=False)
  schedule = pipeline.make_schedule(name, stages=2, microbatches=microbatches)
  params_R, batch = _replica_params(R), _batch(R * microbatches)
  weights = jnp.asarray([1.0, 0.5, 0.25, 2.0])

  def run(params_R, batch, shifts, weights):
    loss, grads = pipeline.replica_loss_and_grads(
        CFG, schedule, layout, jax.vmap(functools.partial(pipeline.to_stages, layout))(params_R),
        batch, mesh=mesh, shifts=shifts, weights=weights)
    return loss, jax.vmap(functools.partial(pipeline.from_stages, layout))(grads)
  return (jax.jit(run)(params_R, batch, shifts, weights),
          _routed_reference(params_R, batch, shifts, weights, microbatches, G))


@pytest.mark.slow
def test_four_replicas_with_odd_shifts_follow_the_route():
  """R=4 replicas of 2-stage 1F1B pipelines: microbatches shifted by 1, 2 or 3 replicas
  between chunks give jax.grad's losses and gradients through their route."""
  shifts = routing.draw_shifts(0, 3, 4, 4, 2)
  assert {1, 3} & set(np.asarray(shifts).ravel().tolist())  # an odd shift among them
  (loss, grads), (loss_ref, grads_ref) = _four_replicas("1f1b", 4, shifts)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
  _assert_close(grads, grads_ref)


@pytest.mark.slow
def test_four_replicas_zero_bubble_follow_the_route():
  """Routed ZB-H1 at R=4: its input-gradient passes (BACKWARD_INPUT) send gradients back
  along each microbatch's route, shifted by 3 and 1 (where +k and -k differ), and the
  gradients equal jax.grad's through the route."""
  schedule = pipeline.make_schedule("zb_h1", stages=2, microbatches=2)
  assert pipeline.BACKWARD_INPUT in schedule.executed.lane_kinds(0)
  (loss, grads), (loss_ref, grads_ref) = _four_replicas("zb_h1", 2, jnp.asarray([[3], [1]]))
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
  _assert_close(grads, grads_ref)
