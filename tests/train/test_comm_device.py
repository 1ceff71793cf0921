"""CO2's all-reduce on communication twins (outer.comm_device): the fused sync's
math, the collective only in the twins' program, exact resume, one-line errors."""
import chex
import jax
import numpy as np
import pytest

from jaxsys import mesh as mesh_lib
from jaxsys.comm_bytes import collective_ops_from_hlo
from jaxsys.train import comm_device
from jaxsys.train import config_check
from jaxsys.train.setup import make_setup

from tests.train.test_replicas import _straight_and_in_two_legs


def _batches(setup, n):
  rng = np.random.default_rng(0)
  for _ in range(n):
    tokens = rng.integers(0, 256, size=(16, 65))
    yield jax.device_put(
        {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
         "segment_ids": np.ones((16, 64), np.int32),
         "positions": np.tile(np.arange(64, dtype=np.int32), (16, 1)),
         "loss_mask": np.ones((16, 64), np.float32)}, setup.batch_sh)


def _setups(make_config):
  """The fused CO2 run and the twins' over the same four training devices."""
  kw = dict(mesh="replica=4", outer__name="co2", outer__sync_every=2)
  fused_run = config_check.check_config(make_config(**kw, outer__comm_device=False),
                                        devices=jax.devices()[:4])
  twin_run = config_check.check_config(make_config(**kw, outer__comm_device=True))
  train_devices, _ = comm_device.split_devices()
  assert train_devices == jax.devices()[:4]
  fused = make_setup(fused_run, mesh_lib.make_mesh(fused_run.mesh, train_devices))
  twins = make_setup(twin_run, mesh_lib.make_mesh(twin_run.mesh, train_devices))
  return fused, twins


def test_twins_match_the_fused_sync(make_config):
  """7 steps, syncs after 2, 4 and 6: the fused program (sync in the next step) and the
  sync without its collective plus the twins' all-reduce, landed before reading, agree in
  parameters and every outer-state field (CO2's pending average included) to float
  rounding (the programs fuse differently: 2.4e-7 apart at most here)."""
  fused, twins = _setups(make_config)
  a, b = fused.init_state(0), twins.init_state(0)
  due = False
  for step, (ba, bb) in enumerate(zip(_batches(fused, 7), _batches(twins, 7)), start=1):
    a, _ = (fused.sync_train_fn if due else fused.train_fn)(a, ba)
    b, _ = twins.train_fn(b, bb)
    due = fused.outer.due(step)
    if due:
      b = twins.off_device_sync(b)
  b = twins.off_device_sync.land(b)  # as the loop's save does (step 6's sync ran in step 7)
  chex.assert_trees_all_close(jax.device_get(b.params), jax.device_get(a.params), atol=1e-6)
  chex.assert_trees_all_close(jax.device_get(b.outer), jax.device_get(a.outer), atol=1e-6)
  assert int(jax.device_get(a.outer.rounds)[0]) == 3


def test_the_collective_runs_on_the_twins_only(make_config):
  """The sync the training devices run has no collective; the twins' program is one
  all-reduce of the replicas' parameters, on the twin devices."""
  _, twins = _setups(make_config)
  state = twins.init_state(0)
  sync = twins.off_device_sync
  text = sync.local_sync.lower(state).compile().as_text()
  assert collective_ops_from_hlo(text) == []
  state = sync(state)
  (leaf, *_) = jax.tree.leaves(sync.in_flight)
  assert {d.id for d in leaf.sharding.device_set} == {d.id for d in jax.devices()[4:]}
  twin_text = sync._mean.lower(sync.in_flight).compile().as_text()
  ops = collective_ops_from_hlo(twin_text)
  params = sum(x.nbytes for x in jax.tree.leaves(state.params))  # all 4 replicas'
  assert {op for op, _ in ops} == {"all-reduce"} and sum(b for _, b in ops) == params // 4


def test_an_inner_step_does_not_communicate(make_config):
  """Between syncs a replica never waits on another: with one device a replica, the inner
  step's program has no collective at all (its metrics stay per replica, combined on the
  host), so nothing queues behind an all-reduce in flight."""
  _, twins = _setups(make_config)
  state = twins.init_state(0)
  batch = next(_batches(twins, 1))
  text = twins.train_fn.lower(state, batch).compile().as_text()
  assert collective_ops_from_hlo(text) == []
  _, metrics = twins.train_fn(state, batch)
  assert metrics["loss"].shape == (4,) and metrics["loss"].sharding.spec[0] == "replica"


@pytest.mark.slow
def test_resume_is_exact_with_an_average_in_flight(make_config, tmp_path):
  """Syncs every 3 steps; the 4 + 4 run stops with step 3's average in flight (landed
  into the checkpoint): 8 steps straight == 4, stop, restore, 4 more."""
  kw = dict(mesh="replica=4", log_every=1, eval_every=0, checkpoint_every=100,
            optimizer__schedule_steps=8, outer__name="co2",
            outer__sync_every=3, outer__comm_device=True)
  a, b, sa, sb = _straight_and_in_two_legs(make_config, tmp_path, **kw)
  assert sorted(a) == sorted(b) == list(range(1, 9))
  np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=1e-6)
  chex.assert_trees_all_close(sb["outer"], sa["outer"], atol=1e-6)
  chex.assert_trees_all_close(sb["params"], sa["params"], atol=1e-6)
  # The landed average is the replicas' mean of step 6's local parameters: all rows equal.
  pending = sa["outer"]["pending"]["layers"]["wq"]
  np.testing.assert_array_equal(pending[0], pending[3])


@pytest.mark.parametrize("overrides, message", [
    (dict(outer__name="diloco", outer__comm_device=True),
     r"^outer.comm_device=True is invalid with outer.name='diloco'; it must be "
     r"False unless outer.name=co2"),
    (dict(outer__name="none", outer__comm_device=True),
     r"^outer.comm_device=True is invalid with outer.name='none'"),
])
def test_bad_config_is_one_line(make_config, overrides, message):
  mesh = "data=-1" if overrides["outer__name"] == "none" else "replica=2,data=-1"
  with pytest.raises(ValueError, match=message):
    config_check.check_config(make_config(mesh=mesh, **overrides))


def test_odd_device_count_is_refused(make_config):
  with pytest.raises(ValueError, match=r"^outer.comm_device=True needs an even number "
                     r"of CPU devices in each process .* process 0 has 7 cpu devices"):
    config_check.check_config(make_config(mesh="replica=-1", outer__name="co2",
                                          outer__comm_device=True),
                              devices=jax.devices()[:7])
