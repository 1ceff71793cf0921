"""Pallas kernels under a mesh (sharded.py) on 8 simulated devices, interpret mode.

The compiled program of a sharded call must gather none of the kernel's operands, and its
values and gradients must equal the unsharded reference: on the runner's Auto mesh (jit
with shardings) and on `jax.make_mesh`'s Explicit mesh under `jax.set_mesh`.
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from attention_testing import FAST_COMPILE, inputs
from jaxsys import mesh as mesh_lib
from jaxsys.kernels import quant_matmul as qm
from jaxsys.kernels import sharded
from jaxsys.kernels.attention import attention
from jaxsys.kernels.attention_pallas import pallas_attention
from jaxsys.models import transformer

B, T, HQ, HKV, D = 4, 32, 4, 2, 16
QKV = P("data", None, "tensor", None)
AUTO = mesh_lib.make_mesh("data=4,tensor=2")
EXPLICIT = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)


def _ids():
  """Two documents a row, split at a different place in each row."""
  return (np.arange(T)[None, :] >= np.array([[5], [16], [27], [32]])).astype(np.int32)


def _attention_step(impl):
  """(out, dq, dk, dv) of attention against a fixed cotangent."""
  def step(q, k, v, ids, ct):
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, segment_ids=ids, impl=impl), q, k, v)
    return (out, *vjp(ct))
  return step


def _assert_all_close(got, want, tol=1e-5):
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol, err_msg=name)


def _hlo(fn, *args) -> str:
  return fn.lower(*args).compile(FAST_COMPILE).as_text()


class AttentionUnderMeshTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    q, k, v, ct = inputs(B, T, T, HQ, HKV, D)
    cls.args = (q, k, v, _ids(), ct)
    cls.want = jax.jit(_attention_step("reference"))(*cls.args)

  def test_auto_mesh_no_gather_and_equal(self):
    qkv, ids = NamedSharding(AUTO, QKV), NamedSharding(AUTO, P("data"))
    shardings = dict(in_shardings=(qkv, qkv, qkv, ids, qkv), out_shardings=(qkv,) * 4)
    step = jax.jit(_attention_step("pallas"), **shardings)
    args = jax.device_put(self.args, shardings["in_shardings"])
    hlo = _hlo(step, *args)
    self.assertNotIn("all-gather", hlo)
    self.assertNotIn("all-to-all", hlo)
    # Each device's kernel sees its own shard: one batch row, one kv head, two q heads.
    self.assertIn("f32[1,32,2,16]", hlo)
    self.assertNotIn("f32[4,32,4,16]", hlo)
    _assert_all_close(step(*args), self.want)

  def test_fewer_kv_heads_than_tensor(self):
    """8 q heads, 2 kv heads (replicated over tensor, as the parameters place them) on
    tensor=4: each kv head is repeated twice, a device's kernel sees one row, its 2 q heads
    and their one kv head, and values and gradients equal the reference's."""
    mesh = mesh_lib.make_mesh("data=2,tensor=4")
    q, k, v, ct = inputs(2, T, T, 8, 2, D)
    args = (q, k, v, _ids()[:2], ct)
    want = jax.jit(_attention_step("reference"))(*args)
    heads, kv, rows = (NamedSharding(mesh, s) for s in (
        P("data", None, "tensor", None), P("data", None, None, None), P("data")))
    step = jax.jit(_attention_step("pallas"), in_shardings=(heads, kv, kv, rows, heads),
                   out_shardings=(heads, heads, kv, kv))
    args = jax.device_put(args, (heads, kv, kv, rows, heads))
    hlo = _hlo(step, *args)
    self.assertIn("f32[1,32,2,16]", hlo)
    self.assertIn("f32[1,32,1,16]", hlo)
    self.assertNotIn("f32[2,32,8,16]", hlo)  # the whole q on a device: attention repeated
    _assert_all_close(step(*args), want)

  def test_the_bare_kernel_gathers(self):
    # The control: XLA does not split the kernel itself, which is what the wrapper is for.
    qkv, ids = NamedSharding(AUTO, QKV), NamedSharding(AUTO, P("data"))
    bare = lambda q, k, v, ids: pallas_attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids)
    step = jax.jit(bare, in_shardings=(qkv, qkv, qkv, ids))
    self.assertIn("all-gather", _hlo(step, *jax.device_put(self.args[:4], (qkv, qkv, qkv, ids))))

  def test_under_vmap_over_replicas(self):
    # The outer optimizers' layout: replicas vmapped onto the `replica` axis, which the
    # kernel's own batch split must leave to the vmap.
    mesh = mesh_lib.make_mesh("replica=2,data=2,tensor=2")
    spec = P("replica", "data", None, "tensor", None)
    q = np.stack([self.args[0], self.args[0][::-1]])
    per_replica = lambda impl: jax.vmap(lambda q: attention(q, q[:, :, ::2], q[:, :, 1::2],
                                                            impl=impl), spmd_axis_name="replica")
    step = jax.jit(per_replica("pallas"), in_shardings=NamedSharding(mesh, spec))
    with jax.set_mesh(mesh):
      q_d = jax.device_put(q, spec)
      self.assertNotIn("all-gather", _hlo(step, q_d))
      got = step(q_d)
    want = jax.jit(per_replica("reference"))(q)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

  def test_explicit_mesh_with_segment_ids(self):
    with jax.set_mesh(EXPLICIT):
      q, k, v, ids, ct = jax.device_put(self.args, (QKV, QKV, QKV, P("data"), QKV))
      got = jax.jit(_attention_step("pallas"))(q, k, v, ids, ct)
      for x in got:
        self.assertEqual(jax.typeof(x).sharding.spec, QKV)
    _assert_all_close(got, self.want)


class SpecTest(parameterized.TestCase):
  """Which axes split which dim: no compiles."""

  @parameterized.named_parameters(
      dict(testcase_name="batch_and_heads", mesh="data=4,tensor=2", b=4, hq=4, hkv=2,
           want=P("data", None, "tensor", None)),
      # 2 rows cannot split 4 ways; 6 q heads split 2 ways would cut a group of 2 from its
      # one kv head of 3: both replicated.
      dict(testcase_name="indivisible_left_unsplit", mesh="data=4,tensor=2", b=2, hq=6, hkv=3,
           want=P(None, None, None, None)),
      # GQA, fewer kv heads than tensor: each of the 2 kv heads twice, a shard holds 2 q
      # heads and their kv head (as MaxText replicates K/V heads).
      dict(testcase_name="gqa_repeats_kv_heads", mesh="data=2,tensor=4", b=2, hq=8, hkv=2,
           want=P("data", None, "tensor", None), repeat=2),
      dict(testcase_name="mqa_repeats_kv_head", mesh="tensor=8", b=1, hq=8, hkv=1,
           want=P(None, None, "tensor", None), repeat=8),
      dict(testcase_name="fsdp_splits_batch", mesh="data=2,fsdp=2,tensor=2", b=4, hq=2, hkv=2,
           want=P(("data", "fsdp"), None, "tensor", None)),
      dict(testcase_name="partial_batch", mesh="data=2,fsdp=4", b=2, hq=1, hkv=1,
           want=P("data", None, None, None)),
  )
  def test_attention_spec(self, mesh, b, hq, hkv, want, repeat=1):
    mesh = mesh_lib.make_mesh(mesh).abstract_mesh
    q, k = jnp.zeros((b, 8, hq, 4)), jnp.zeros((b, 8, hkv, 4))
    self.assertEqual(sharded.attention_spec(mesh, q, k), (want, repeat))

  def test_explicit_layout_wins_over_rules(self):
    with jax.set_mesh(EXPLICIT):
      q = jax.device_put(jnp.zeros((4, 8, 4, 4)), P("tensor"))
      # The operand's own batch split, then "data" cannot also split 4 rows 8 ways.
      self.assertEqual(sharded.attention_spec(EXPLICIT.abstract_mesh, q, q),
                       (P("tensor", None, None, None), 1))

  def test_qmatmul_specs(self):
    qw = qm.quantize_weight(jnp.ones((64, 6)), "w8a8_int8")
    mesh = AUTO.abstract_mesh
    self.assertEqual(sharded.qmatmul_specs(mesh, jnp.zeros((8, 64)), qw),
                     (P("data", None), P(None, "tensor"), P("data", "tensor")))
    self.assertEqual(sharded.qmatmul_specs(mesh, jnp.zeros((2, 3, 64)), qw),
                     (P(None, None, None), P(None, "tensor"), P(None, None, "tensor")))


class QmatmulUnderMeshTest(parameterized.TestCase):

  @parameterized.parameters(("w4a16", "u8[64,32]"), ("w8a8_int8", "s8[128,32]"))
  def test_split_over_tokens_and_n_no_gather_and_equal(self, scheme, weight_shard):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 128), dtype=np.float32)
    qw = qm.quantize_weight(rng.standard_normal((128, 64), dtype=np.float32), scheme,
                            group_size=32)
    w_sh = NamedSharding(AUTO, P(None, "tensor"))
    x_sh = NamedSharding(AUTO, P("data"))
    qw_sh = qm.QWeight(w_sh, w_sh, qw.scheme, qw.group_size)
    fn = jax.jit(lambda x, qw: qm.qmatmul(x, qw, impl="pallas"), in_shardings=(x_sh, qw_sh), out_shardings=NamedSharding(AUTO, P("data", "tensor")))
    x_d, qw_d = jax.device_put((x, qw), (x_sh, qw_sh))  # committed: the mesh is in the types
    hlo = _hlo(fn, x_d, qw_d)
    self.assertNotIn("all-gather", hlo)
    # XLA also splits this kernel's interpret-mode loops (never a Triton/Mosaic call): check
    # that it runs per shard.
    self.assertIn("shard_map/jaxsys_qmatmul", hlo)
    self.assertIn("f32[8,128]", hlo)  # x rows per device; the weight's N per device: 32
    self.assertIn(weight_shard, hlo)
    got = fn(x_d, qw_d)
    want = jax.jit(lambda x, qw: qm.qmatmul(x, qw, impl="reference"))(x, qw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


class ModelUnderMeshTest(absltest.TestCase):

  def test_pallas_forward_on_data_tensor_mesh_equals_unsharded(self):
    cfg = transformer.TransformerConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=4,
                                        n_kv_heads=2, d_ff=64,
                                        attention_impl="pallas")
    params = transformer.init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(1).integers(0, 32, (B, T)).astype(np.int32)
    ids = _ids()
    # The runner's layout: parameters by their logical axes, the batch over data.
    param_sh = mesh_lib.logical_to_sharding(transformer.param_axes(cfg), AUTO)
    batch_sh = mesh_lib.batch_sharding(AUTO)
    forward = lambda p, t, s: transformer.apply(cfg, p, t, None, s)
    # Host inputs carry no mesh in their types: the mesh is visible through under_mesh.
    fn = jax.jit(sharded.under_mesh(forward, AUTO), in_shardings=(param_sh, batch_sh, batch_sh))
    compiled = fn.lower(params, tokens, ids).compile(FAST_COMPILE)
    # Tensor parallelism all-reduces; nothing (the bare kernel: q, k, v, ids) is gathered.
    self.assertNotIn("all-gather", compiled.as_text())
    got = compiled(params, tokens, ids)
    want = jax.jit(forward).lower(params, tokens, ids).compile(FAST_COMPILE)(params, tokens, ids)
    chex.assert_trees_all_close(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
  absltest.main()
