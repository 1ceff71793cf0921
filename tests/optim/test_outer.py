"""Outer optimizers: DiLoCo == DP SGD in its limit, NoLoCo's pairs and HLO, CO2's delay, bytes."""

import dataclasses
import importlib.util
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized
from jax.sharding import Mesh, PartitionSpec as P

from jaxsys import comm_bytes
from jaxsys import optim
from jaxsys.train import config_check, replicas
from jaxsys.optim.noloco import peer_groups, round_index
from jaxsys.optim import outer as outer_lib

R = 4
AX = "replica"


def _params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w": jax.random.normal(k1, (6, 5)), "b": jax.random.normal(k2, (5,))}


def _data(step, r=R):
  """Per-replica regression data [R, 8, 6] -> [R, 8, 5] for a linear model."""
  k = jax.random.fold_in(jax.random.key(1), step)
  kx, ky = jax.random.split(k)
  return jax.random.normal(kx, (r, 8, 6)), jax.random.normal(ky, (r, 8, 5))


def _loss(p, x, y):
  return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def _stack(tree, r=R):
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (r, *x.shape)), tree)


def _mesh(r=R):
  return Mesh(np.array(jax.devices()[:r]), (AX,))


def _shard_sync(outer, r=R):
  """outer.sync under shard_map over a replica-only mesh, as the training loop runs it."""
  def per(p, s):
    p, s = outer.sync(jax.tree.map(lambda x: x[0], p), jax.tree.map(lambda x: x[0], s),
                      axis_name=AX)
    return jax.tree.map(lambda x: x[None], (p, s))
  return jax.jit(jax.shard_map(per, mesh=_mesh(r), in_specs=(P(AX), P(AX)),
                               out_specs=(P(AX), P(AX))))


def _vmap_sync(outer):
  return jax.jit(jax.vmap(lambda p, s: outer.sync(p, s, axis_name=AX), axis_name=AX))


class DiLoCoTest(parameterized.TestCase):

  @parameterized.parameters("vmap", "shard_map")
  def test_h1_lr1_no_momentum_is_data_parallel_sgd(self, how):
    """Inner SGD, H=1, lr=1, momentum 0: each sync is one synchronous DP SGD step."""
    lr = 0.1
    outer = optim.diloco(sync_every=1, lr=1.0, momentum=0.0)
    sync = _vmap_sync(outer) if how == "vmap" else _shard_sync(outer)
    grads = jax.jit(jax.vmap(jax.grad(_loss)))
    dp_step = jax.jit(lambda p, x, y: jax.tree.map(
        lambda p, g: p - lr * jnp.mean(g, 0), p, jax.vmap(jax.grad(_loss), (None, 0, 0))(p, x, y)))
    dp = _params()
    theta = _stack(dp)
    state = jax.vmap(outer.init)(theta)
    for step in range(5):
      x, y = _data(step)
      g = grads(theta, x, y)
      theta = jax.tree.map(lambda p, g: p - lr * g, theta, g)
      theta, state = sync(theta, state)
      dp = dp_step(dp, x, y)
    for r in range(R):
      chex.assert_trees_all_close(jax.tree.map(lambda x: x[r], theta), dp, atol=1e-6, rtol=1e-6)

  def test_one_replica_lr1_is_the_inner_optimizer(self):
    """R=1, lr=1, no momentum: syncing every 2 steps changes nothing (inner AdamW alone)."""
    inner = optax.adamw(1e-2)
    outer = optim.diloco(sync_every=2, lr=1.0, momentum=0.0)
    sync = jax.jit(jax.vmap(lambda p, s: outer.sync(p, s, axis_name=AX), axis_name=AX))
    ref = _params()
    ref_state = inner.init(ref)
    theta = _stack(ref, 1)
    inner_state = jax.vmap(inner.init)(theta)
    state = jax.vmap(outer.init)(theta)

    def inner_step(p, s, x, y):
      u, s = inner.update(jax.grad(_loss)(p, x, y), s, p)
      return optax.apply_updates(p, u), s
    step_r, step_1 = jax.jit(jax.vmap(inner_step)), jax.jit(inner_step)
    for step in range(6):
      x, y = _data(step, 1)
      theta, inner_state = step_r(theta, inner_state, x, y)
      ref, ref_state = step_1(ref, ref_state, x[0], y[0])
      if (step + 1) % outer.sync_every == 0:
        theta, state = sync(theta, state)
    chex.assert_trees_all_close(jax.tree.map(lambda x: x[0], theta), ref, atol=1e-6)

  @parameterized.parameters(True, False)
  def test_outer_step_is_sgd_with_momentum_on_the_mean_delta(self, nesterov):
    """The outer step equals optax.sgd(0.7, 0.9, nesterov) and the written-out momentum update."""
    lr, mu = 0.7, 0.9
    outer = optim.diloco(sync_every=1, nesterov=nesterov)
    sync = _vmap_sync(outer)
    sgd = optax.sgd(lr, momentum=mu, nesterov=nesterov)
    phi = _params()
    sgd_state = sgd.init(phi)
    state = jax.vmap(outer.init)(_stack(phi))
    ref, hand, m = phi, phi, jax.tree.map(jnp.zeros_like, phi)
    for step in range(3):
      x, _ = _data(step)
      theta = jax.tree.map(lambda p: p + 0.01 * jnp.mean(x) * jnp.arange(1, R + 1).reshape(
          (R,) + (1,) * (p.ndim - 1)), state.anchor)
      delta = jax.tree.map(lambda a, t: jnp.mean(a - t, 0), state.anchor, theta)
      u, sgd_state = sgd.update(delta, sgd_state)
      ref = optax.apply_updates(ref, u)
      m = jax.tree.map(lambda m, g: mu * m + g, m, delta)
      hand = jax.tree.map(lambda p, m, g: p - lr * (g + mu * m if nesterov else m), hand, m, delta)
      theta, state = sync(theta, state)
      chex.assert_trees_all_close(jax.tree.map(lambda x: x[0], theta), ref, atol=1e-6)
      chex.assert_trees_all_close(ref, hand, atol=1e-6)


def _partners(outer, r: int, syncs: int) -> np.ndarray:
  """[syncs, r]: replica i's partner at each of `syncs` syncs, read off the real sync under vmap.

  beta = gamma = 1, alpha = 0 from zero slow weights: phi_i becomes mean(theta_i, theta_j),
  so theta_i = i gives j = 2 phi_i - i.
  """
  ids = jnp.arange(r, dtype=jnp.float32)
  zero = jax.vmap(outer.init)(jnp.zeros((r,)))

  def one(t):
    out, _ = jax.vmap(lambda p, s: outer.sync(p, s, axis_name=AX), axis_name=AX)(
        ids, zero._replace(rounds=jnp.full((r,), t, jnp.int32)))
    return 2 * out - ids
  return np.rint(np.asarray(jax.jit(jax.vmap(one))(jnp.arange(syncs)))).astype(int)


def _chi2_uniform(partners: np.ndarray, r: int) -> float:
  """Pearson's chi-square of replica 0's partner counts against uniform over the other r-1."""
  counts = np.bincount(partners, minlength=r)[1:]
  expected = len(partners) / (r - 1)
  return float(np.sum((counts - expected) ** 2 / expected))


class NoLoCoTest(parameterized.TestCase):

  @parameterized.parameters(2, 4, 6, 16)
  def test_rounds_meet_every_pair_exactly_once(self, r):
    schedule = peer_groups(r, 2, seed=3)
    self.assertEqual(schedule.shape, (r - 1, r // 2, 2))
    met = []
    for groups in schedule:
      self.assertEqual(sorted(groups.reshape(-1).tolist()), list(range(r)))  # a perfect matching
      met += [tuple(sorted(g)) for g in groups.tolist()]
    self.assertLen(met, r * (r - 1) // 2)
    self.assertLen(set(met), r * (r - 1) // 2)
    self.assertFalse(np.array_equal(peer_groups(r, 2, seed=4), schedule) and r > 2)

  def test_every_partner_equally_likely_at_r16(self):
    """Replica 0's partner over 3000 syncs of the real sync at R=16: chi-square < 36.1
    (p = 0.001 at 14 dof); a pool of 16 random permutations fails the same test."""
    r, syncs, critical = 16, 3000, 36.12
    partners = _partners(optim.noloco(sync_every=1, lr=1.0, momentum=0.0, gamma=1.0,
                                      seed=7), r, syncs)
    np.testing.assert_array_equal(np.take_along_axis(partners, partners, 1),
                                  np.broadcast_to(np.arange(r), partners.shape))  # pairs
    for i in range(r):
      relabel = np.arange(r)
      relabel[[0, i]] = [i, 0]  # replica i's partners, as if it were replica 0
      self.assertLess(_chi2_uniform(relabel[partners[:, i]], r), critical, msg=f"replica {i}")
    # The old scheme: a seeded pool of 16 permutations, one drawn per sync.
    rng = np.random.default_rng(7)
    pool = [rng.permutation(r).reshape(2, r // 2).T for _ in range(16)]
    old = [next(int(g[1 - list(g).index(0)]) for g in pool[k] if 0 in g)
           for k in rng.integers(0, 16, syncs)]
    self.assertGreater(_chi2_uniform(np.array(old), r), critical)

  def test_sync_averages_within_the_drawn_pairs(self):
    """beta = gamma = 1, alpha = 0: phi_i <- mean of theta over i's pair, the drawn round's."""
    outer = optim.noloco(sync_every=1, lr=1.0, momentum=0.0, gamma=1.0, seed=5)
    sync = _shard_sync(outer)
    schedule = peer_groups(R, 2, 5)
    state = jax.vmap(outer.init)(jnp.zeros((R, 1)))
    seen = set()
    for t in range(6):
      theta = (jnp.arange(R, dtype=jnp.float32) * 10.0 ** np.arange(R)).reshape(R, 1)
      out, state = sync(theta, state)
      groups = schedule[int(round_index(5, jnp.int32(t), R - 1))]
      want = np.zeros(R)
      for g in groups:
        want[g] = np.asarray(theta)[g, 0].mean()
      np.testing.assert_allclose(np.asarray(out)[:, 0], want, rtol=1e-6)
      seen.add(tuple(sorted(tuple(sorted(g)) for g in groups.tolist())))
      state = state._replace(anchor=jnp.zeros((R, 1)), momentum=jnp.zeros((R, 1)))
    self.assertGreater(len(seen), 1)

  @parameterized.parameters(0.7, 0.3)
  def test_modified_nesterov_step(self, gamma):
    """The modified Nesterov update (both the beta == gamma shortcut and the general form)."""
    a, b = 0.5, 0.7
    outer = optim.noloco(sync_every=1, lr=b, momentum=a, gamma=gamma, group_size=R)
    sync = _vmap_sync(outer)
    phi = jnp.arange(R, dtype=jnp.float32).reshape(R, 1)
    state = jax.vmap(outer.init)(phi)._replace(momentum=jnp.ones((R, 1)))
    theta = phi + jnp.array([[1.0], [-2.0], [0.5], [3.0]])
    out, _ = sync(theta, state)
    want = phi + a * 1.0 - b * jnp.mean(phi - theta) - gamma * (phi - jnp.mean(phi))
    np.testing.assert_allclose(out, want, rtol=1e-6)

  def test_compiled_sync_is_one_branch_of_permutes_per_round(self):
    outer = optim.noloco(sync_every=1)
    p = _stack(_params())
    hlo = _shard_sync(outer).lower(p, jax.vmap(outer.init)(p)).compile().as_text()
    ops = [op for op, _ in comm_bytes.collective_ops_from_hlo(hlo)]
    self.assertEqual(set(ops), {"collective-permute"})
    self.assertNotIn("all-reduce", hlo)
    self.assertRegex(hlo, r"conditional\(.*branch_computations=\{[^,}]+, [^,}]+, [^,}]+\}")

  @parameterized.parameters((3, 2, "group_size=2 must divide the 3 replicas"),
                            (6, 3, "group_size=3 is invalid for the 6 replicas; valid: 2 "
                                   r"\(random pairs\) or 6 \(all replicas\)"))
  def test_replicas_that_cannot_be_grouped_are_one_line(self, r, n, pattern):
    outer = optim.noloco(sync_every=1, group_size=n)
    with self.assertRaisesRegex(ValueError, pattern) as ctx:
      _vmap_sync(outer)(jnp.zeros((r, 2)), jax.vmap(outer.init)(jnp.zeros((r, 2))))
    self.assertNotIn("\n", str(ctx.exception))


class CO2Test(absltest.TestCase):

  def test_applies_the_previous_rounds_average(self):
    # lambda = alpha = 1, no momentum applies each average whole (on the bound: allowed)
    outer = optim.co2(sync_every=1, lr=1.0, momentum=0.0, staleness_penalty=1.0,
                      allow_unstable=True)
    sync = _shard_sync(outer)
    x0 = jnp.zeros((R, 2))
    state = jax.vmap(outer.init)(x0)
    a = jnp.arange(R * 2, dtype=jnp.float32).reshape(R, 2)
    out, state = sync(a, state)  # round 0: no average yet
    np.testing.assert_allclose(out, x0)
    b = 100.0 + a
    out, state = sync(b, state)  # round 1 applies round 0's average, not round 1's
    np.testing.assert_allclose(out, jnp.broadcast_to(a.mean(0), (R, 2)), rtol=1e-6)
    out, state = sync(out, state)
    np.testing.assert_allclose(out, jnp.broadcast_to(a.mean(0) + b.mean(0), (R, 2)), rtol=1e-6)

  def test_staleness_penalty_momentum_and_clip(self):
    outer = optim.co2(sync_every=1, lr=0.5, momentum=0.5, staleness_penalty=2.0,
                      momentum_clip=0.3)
    sync = _vmap_sync(outer)
    state = jax.vmap(outer.init)(jnp.zeros((R, 3)))
    theta = jnp.array([[-1.0, 0.2, 0.0]] * R)
    out, state = sync(theta, state)
    out, state = sync(out, state)
    # g = (0 - theta)/2 = [0.5, -0.1, 0]; m = clip(g, 0.3) = [0.3, -0.1, 0]; x = 0 - 0.5 m
    np.testing.assert_allclose(state.momentum[0], [0.3, -0.1, 0.0], rtol=1e-6)
    np.testing.assert_allclose(out[0], [-0.15, 0.05, 0.0], rtol=1e-6)


  def test_stability_bound_on_directions_the_inner_steps_converge(self):
    # Every round's local steps land exactly on the replica's optimum c_i, wherever they
    # start (h = 1): the anchor should settle at mean(c) iff alpha/lambda < 1 - beta.
    c = jnp.array([[1.0, -2.0], [3.0, 0.0], [-1.0, 2.0], [1.0, 4.0]])
    target = c.mean(0)

    def distance_after(outer, syncs=60):
      sync = _vmap_sync(outer)
      x, state = jnp.zeros((R, 2)), jax.vmap(outer.init)(jnp.zeros((R, 2)))
      for _ in range(syncs):
        x, state = sync(c, state)
      return float(jnp.max(jnp.abs(x - target)))

    self.assertLess(distance_after(optim.co2(sync_every=1)), 1e-3)  # defaults: 1/3 < 0.5
    with self.assertLogs("absl", "WARNING") as logs:  # the authors' code's: 1/1 >= 0.5
      unstable = optim.co2(sync_every=1, staleness_penalty=1.0, allow_unstable=True)
    self.assertIn("stability bound", logs.output[0])
    self.assertGreater(distance_after(unstable), 10 * float(jnp.max(jnp.abs(target))))

  def test_outside_the_bound_is_an_error_unless_allowed(self):
    with self.assertRaises(ValueError) as ctx:
      optim.co2(sync_every=1, staleness_penalty=1.0)
    self.assertEqual(str(ctx.exception),
                     "lr=1, momentum=0.5, staleness_penalty=1 are outside CO2's "
                     "stability bound lr / staleness_penalty < 1 - momentum "
                     "(1 >= 0.5); use staleness_penalty > 2 or allow_unstable=True")


class ConfigTest(parameterized.TestCase):
  """The run config's outer section -> outer optimizer: unset fields take the library's defaults."""

  def _config(self, **fields):
    return dataclasses.replace(config_check.parse(_tiny_lm().get_config("size=test")).outer,
                               **fields)

  def test_unset_fields_take_the_library_defaults(self):
    for name, hparams in (("diloco", dict(lr=0.7, momentum=0.9, nesterov=True)),
                          ("noloco", dict(lr=0.7, momentum=0.5, gamma=0.7)),
                          ("co2", dict(lr=1.0, momentum=0.5, staleness_penalty=3.0,
                                       allow_unstable=False))):
      outer = replicas.make_outer_optimizer(self._config(name=name))
      self.assertEqual({k: outer.hparams[k] for k in hparams}, hparams, msg=name)

  def test_co2_outside_the_bound_names_the_config_fields(self):
    config = _tiny_lm().get_config("size=test")
    config.mesh, config.outer.name, config.outer.staleness_penalty = "replica=2,data=-1", "co2", 1.0
    with self.assertRaisesRegex(ValueError, r"^outer.staleness_penalty=1.0 is invalid with "
                                r"outer.lr=None, outer.momentum=None, outer.allow_unstable=False, "
                                r"outer.name='co2'; it must keep outer.lr / "
                                r"outer.staleness_penalty < 1 - outer.momentum"):
      config_check.check_config(config)
    config.outer.staleness_penalty = 2.5  # 1 / 2.5 < 1 - 0.5: inside the bound
    config_check.check_config(config)
    cfg = self._config(name="co2", staleness_penalty=1.0, allow_unstable=True)
    with self.assertLogs("absl", "WARNING"):
      self.assertEqual(replicas.make_outer_optimizer(cfg).hparams["staleness_penalty"], 1.0)


def _tiny_lm():
  spec = importlib.util.spec_from_file_location(
      "tiny_lm", pathlib.Path(__file__).parents[2] / "configs" / "tiny_lm.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


class CompressionTest(parameterized.TestCase):

  @parameterized.parameters(("bf16", 2.0 ** -8), ("fp8", 2.0 ** -4))
  def test_float_roundtrip_relative_error(self, kind, rel):
    x = jax.random.normal(jax.random.key(2), (1000,)) * 3.0
    y = outer_lib.quantize_roundtrip(x, kind)
    big = jnp.abs(x) > 1e-2 * jnp.max(jnp.abs(x))  # fp8: small values are subnormal
    np.testing.assert_array_less(jnp.abs(y - x)[big], rel * jnp.abs(x)[big] + 1e-7)

  def test_int8_roundtrip_error_is_half_a_step(self):
    x = jax.random.normal(jax.random.key(2), (1001,))
    for chunks in (1, 4):
      y = outer_lib.quantize_roundtrip(x, "int8", chunks)
      step = jnp.max(jnp.abs(x)) / 127
      self.assertLessEqual(float(jnp.max(jnp.abs(y - x))), float(step) / 2 * 1.0001)

  @parameterized.parameters("bf16", "int8", "fp8")
  def test_compressed_mean_is_close_to_the_mean(self, kind):
    x = jax.random.normal(jax.random.key(3), (R, 37, 3))
    got = jax.jit(jax.vmap(lambda v: outer_lib.compressed_mean(v, AX, kind), axis_name=AX))(x)
    want = jnp.mean(x, 0)
    # two quantizations (chunks, then the averaged chunk), each within half a step / rel. error
    tol = {"bf16": 4 * 2.0 ** -8 * 3, "int8": 2 * float(jnp.max(jnp.abs(x))) / 127,
           "fp8": 2 * 2.0 ** -4 * float(jnp.max(jnp.abs(x)))}[kind]
    for r in range(R):
      self.assertLess(float(jnp.max(jnp.abs(got[r] - want))), tol)


  @parameterized.parameters(("int8", 1.5e-3, 3e-3, 1.1e-2), ("fp8", 4e-3, 9e-3, 3.8e-2))
  def test_error_feedback_leaves_the_requantized_mean_s_bias(self, kind, lo, hi, without):
    """The drift diloco.py's docstring quotes: 100 rounds of one fixed pseudo-gradient, the
    summed applied update against the true sum (relative L2)."""
    d = jax.random.normal(jax.random.key(0), (R, 4096))

    def drift(error_feedback):
      outer = optim.diloco(sync_every=1, lr=1.0, momentum=0.0, compression=kind,
                           error_feedback=error_feedback)
      sync = _vmap_sync(outer)
      state = jax.vmap(outer.init)(jnp.zeros_like(d))
      for _ in range(100):
        _, state = sync(state.anchor - d, state)
      return float(jnp.linalg.norm(state.anchor[0] + 100 * d.mean(0))
                   / jnp.linalg.norm(100 * d.mean(0)))
    self.assertBetween(drift(True), lo, hi)
    self.assertAlmostEqual(drift(False), without, delta=0.1 * without)


class BytesTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("diloco", lambda: optim.diloco(sync_every=5)),
      ("diloco_bf16", lambda: optim.diloco(sync_every=5, compression="bf16")),
      ("diloco_int8", lambda: optim.diloco(sync_every=5, compression="int8")),
      ("diloco_fp8_ef", lambda: optim.diloco(sync_every=5, compression="fp8",
                                             error_feedback=True)),
      # R-1 = 3 switch branches of permutes in the HLO; one runs per sync
      ("noloco", lambda: optim.noloco(sync_every=5)),
      ("noloco_general", lambda: optim.noloco(sync_every=5, gamma=0.2)),
      ("noloco_one_group", lambda: optim.noloco(sync_every=5, gamma=0.2, group_size=4)),
      ("co2", lambda: optim.co2(sync_every=5)))
  def test_reported_bytes_match_the_compiled_collectives(self, make):
    outer = make()
    params = _params()
    p = _stack(params)
    hlo = _shard_sync(outer).lower(p, jax.vmap(outer.init)(p)).compile().as_text()
    self.assertEqual(comm_bytes.collective_bytes_from_hlo(hlo, R), outer.bytes_per_sync(params, R))

  @parameterized.parameters(
      ("replica_groups={{0,2,4,6},{1,3,5,7}}", 4), ("replica_groups=[4,2]<=[8]", 2),
      ("replica_groups=mesh['a'=2,'b'=4] {'b'}", 4),
      ("replica_groups=mesh['a'=2,'b'=4], device_ids=(0,2,1,3,4,6,5,7) {'a'}", 2),
      ("replica_groups=mesh['a'=2,'b'=2,'c'=2], device_ids=([2,2,2]T(1,0,2)) {'a','c'}", 4))
  def test_group_sizes_in_each_of_xla_s_spellings(self, groups, want):
    hlo = ("ENTRY %main (x: f32[8]) -> f32[8] {\n"
           f"  ROOT %ar = f32[8]{{0}} all-reduce(f32[8]{{0}} %x), {groups}, to_apply=%add\n}}")
    self.assertEqual(comm_bytes.collective_bytes_from_hlo(hlo, 8), 2 * (want - 1) * 32 // want)

  @parameterized.parameters(("replica=4,data=2", 4), ("replica=2 x data=-1", 2), ("data=-1", 8),
                            ("data=2,fsdp=2,tensor=2", 4), ("replica=1,data=2,tensor=4", 2))
  def test_num_workers_reads_any_mesh_spec(self, spec, want):
    self.assertEqual(outer_lib.num_workers(spec), want)

  def test_int8_sends_a_quarter_of_float32(self):
    params = {"w": jnp.zeros((1024, 256))}
    f32 = optim.diloco(sync_every=1).bytes_per_sync(params, 4)
    i8 = optim.diloco(sync_every=1, compression="int8").bytes_per_sync(params, 4)
    self.assertEqual(f32, 2 * 3 * 1024 * 256 * 4 // 4)
    self.assertAlmostEqual(f32 / i8, 4.0, delta=0.01)


class BadInputTest(parameterized.TestCase):

  @parameterized.parameters(
      (lambda: optim.diloco(sync_every=0), r"^sync_every=0 is invalid; it must be an int >= 1"),
      (lambda: optim.diloco(sync_every=2.5), r"^sync_every=2.5 is invalid"),
      (lambda: optim.diloco(sync_every=1, compression="int4"),
       r"^compression='int4' is unknown; valid: none, bf16, int8, fp8$"),
      (lambda: optim.diloco(sync_every=1, lr=-1), r"^lr=-1 is invalid"),
      (lambda: optim.noloco(sync_every=1, group_size=1), r"^group_size=1 is invalid"),
      (lambda: optim.co2(sync_every=1, staleness_penalty=0), r"^staleness_penalty=0 is invalid"),
      (lambda: optim.co2(sync_every=1, momentum=1.5), r"^momentum=1.5 is invalid"),
      (lambda: optim.co2(sync_every=1, momentum=0.9), r"^lr=1, momentum=0.9, "
       r"staleness_penalty=3 are outside CO2's stability bound"))
  def test_one_line_errors(self, make, pattern):
    with self.assertRaisesRegex(ValueError, pattern) as ctx:
      make()
    self.assertNotIn("\n", str(ctx.exception))


if __name__ == "__main__":
  absltest.main()
