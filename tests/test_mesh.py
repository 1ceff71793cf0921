"""Tests for jaxsys.mesh on 8 simulated CPU devices (see conftest.py)."""

import dataclasses
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsys import mesh as mesh_lib


def _ids(arr) -> np.ndarray:
  return np.vectorize(lambda d: d.id)(np.asarray(arr))


@dataclasses.dataclass(frozen=True)
class _FakeDevice:
  """Stands in for a multi-slice / multi-host device (real CPU devices are all one granule)."""
  id: int
  process_index: int
  platform: str = "fake"
  device_kind: str = "fake"


class ParseTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("string", "data=2,tensor=4"),
      ("string_spaces", " data = 2 , tensor=4 "),
      ("string_x", "data=2 x tensor=4"),
      ("pairs", [("data", 2), ("tensor", 4)]),
      ("mapping", {"data": 2, "tensor": 4}),
      ("numpy_int", {"data": np.int64(2), "tensor": 4}),
  )
  def test_forms(self, spec):
    self.assertEqual(mesh_lib.parse_mesh_spec(spec), (("data", 2), ("tensor", 4)))

  def test_order_preserved(self):
    self.assertEqual(mesh_lib.parse_mesh_spec("tensor=4,data=-1"),
                     (("tensor", 4), ("data", -1)))

  @parameterized.named_parameters(
      ("unknown_axis", "dta=2", ["mesh", "'dta'", "replica, data, stage, fsdp, context, tensor"]),
      ("duplicate", "data=2,data=4", ["mesh", "'data'", "twice"]),
      ("zero", "data=0", ["mesh", "size 0", "positive int or -1"]),
      ("negative", {"data": -2}, ["mesh", "size -2", "positive int or -1"]),
      ("float", {"data": 2.0}, ["mesh", "2.0", "positive int or -1"]),
      ("bool", {"data": True}, ["mesh", "True", "positive int or -1"]),
      ("word", "data=two", ["mesh", "'two'", "positive int or -1"]),
      ("two_fill", "data=-1,tensor=-1", ["mesh", "more than one", "-1"]),
      ("no_equals", "data2", ["mesh", "'data2'", "axis=size"]),
  )
  def test_errors(self, spec, fragments):
    with self.assertRaises(ValueError) as cm:
      mesh_lib.parse_mesh_spec(spec)
    msg = str(cm.exception)
    self.assertNotIn("\n", msg)
    for f in fragments:
      self.assertIn(f, msg)


class MakeMeshTest(parameterized.TestCase):

  def test_device_count(self):
    self.assertLen(jax.devices(), 8)

  @parameterized.named_parameters(
      ("plain", "data=2,tensor=4", {"data": 2, "tensor": 4}),
      ("fill_last", "data=2,tensor=-1", {"data": 2, "tensor": 4}),
      ("fill_first", "fsdp=-1,tensor=2", {"fsdp": 4, "tensor": 2}),
      ("fill_all", "data=-1", {"data": 8}),
      ("size_one_kept", "replica=1,data=-1,tensor=1", {"replica": 1, "data": 8, "tensor": 1}),
  )
  def test_shape(self, spec, expected):
    m = mesh_lib.make_mesh(spec)
    self.assertEqual(dict(m.shape), expected)
    self.assertEqual(tuple(m.axis_names), tuple(expected))
    self.assertCountEqual(_ids(m.devices).ravel().tolist(), range(8))

  def test_subset_of_devices(self):
    m = mesh_lib.make_mesh("data=2,tensor=2", devices=jax.devices()[4:])
    self.assertEqual(sorted(_ids(m.devices).ravel().tolist()), [4, 5, 6, 7])

  def test_wrong_product(self):
    with self.assertRaises(ValueError) as cm:
      mesh_lib.make_mesh("data=2,tensor=3")
    self.assertEqual(
        str(cm.exception),
        "mesh data=2 x tensor=3 needs 6 devices but 8 are available; "
        "choose sizes whose product is 8 (or use -1 for one axis)")

  def test_fill_not_dividing(self):
    with self.assertRaises(ValueError) as cm:
      mesh_lib.make_mesh("data=3,tensor=-1")
    self.assertEqual(str(cm.exception), "mesh data=3 x tensor=-1: 8 devices do not divide by 3")

  def test_bad_axis(self):
    with self.assertRaisesRegex(ValueError, r"unknown axis 'model'.*valid axes are replica"):
      mesh_lib.make_mesh("model=8")

  def test_empty(self):
    with self.assertRaisesRegex(ValueError, "no axes"):
      mesh_lib.make_mesh("")

  def test_jit_with_named_sharding(self):
    # Default (Auto) axis types: plain jit over NamedSharding inputs must just work.
    m = mesh_lib.make_mesh("data=2,tensor=4")
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(m, P("data", "tensor")))
    y = jax.jit(lambda a: (a * 2).sum(axis=1))(x)
    chex.assert_trees_all_close(y, jnp.arange(32.0).reshape(8, 4).sum(axis=1) * 2)

  def test_describe(self):
    self.assertEqual(mesh_lib.describe(mesh_lib.make_mesh("data=2,tensor=4")),
                     "data=2 x tensor=4 (8 cpu devices)")


class HybridMeshTest(parameterized.TestCase):

  def test_dcn_data_ici_fsdp(self):
    m = mesh_lib.make_hybrid_mesh("fsdp=4", "data=2")
    self.assertEqual(dict(m.shape), {"data": 2, "fsdp": 4})
    # Each DCN group (data index) is one contiguous block of device ids.
    np.testing.assert_array_equal(_ids(m.devices), [[0, 1, 2, 3], [4, 5, 6, 7]])

  def test_shared_axis(self):
    m = mesh_lib.make_hybrid_mesh("data=2,tensor=2", "data=2")
    self.assertEqual(dict(m.shape), {"data": 4, "tensor": 2})
    ids = _ids(m.devices)
    # DCN index is the outer part of `data`: rows 0-1 are group 0, rows 2-3 group 1.
    self.assertEqual(sorted(ids[:2].ravel().tolist()), [0, 1, 2, 3])
    self.assertEqual(sorted(ids[2:].ravel().tolist()), [4, 5, 6, 7])
    np.testing.assert_array_equal(ids, [[0, 1], [2, 3], [4, 5], [6, 7]])

  def test_fill(self):
    m = mesh_lib.make_hybrid_mesh("fsdp=-1", "replica=2")
    self.assertEqual(dict(m.shape), {"replica": 2, "fsdp": 4})
    m = mesh_lib.make_hybrid_mesh("tensor=2", "data=-1")
    self.assertEqual(dict(m.shape), {"data": 4, "tensor": 2})

  def test_errors(self):
    with self.assertRaisesRegex(ValueError, r"ici_spec: unknown axis 'mdl'"):
      mesh_lib.make_hybrid_mesh("mdl=4", "data=2")
    with self.assertRaisesRegex(ValueError, r"dcn data=3 x ici .*8 devices.*3 equal DCN groups"):
      mesh_lib.make_hybrid_mesh("fsdp=-1", "data=3")
    with self.assertRaisesRegex(ValueError, r"over 2 granules of 4 devices: ici needs 3 devices per granule but 4"):
      mesh_lib.make_hybrid_mesh("fsdp=3", "data=2")
    with self.assertRaisesRegex(ValueError, "order their shared axes differently"):
      mesh_lib.make_hybrid_mesh("data=2,tensor=2", "tensor=1,data=2")

  def test_granules_by_process(self):
    # Two "hosts" listed interleaved: granules come from process_index, not list order.
    devs = [_FakeDevice(id=i, process_index=i % 2) for i in range(8)]
    arr, names = mesh_lib._hybrid_device_array("data=2,tensor=2", "data=2", devs)
    self.assertEqual(names, ["data", "tensor"])
    np.testing.assert_array_equal(_ids(arr), [[0, 2], [4, 6], [1, 3], [5, 7]])
    with self.assertRaisesRegex(ValueError, r"dcn needs 4 granules \(by process_index\) but 2"):
      mesh_lib._hybrid_device_array("tensor=2", "data=4", devs)

  def test_hand_built_matches_jax(self):
    # The hand-built layout (used when jax's topology mapping fails) must equal jax's.
    devs = [_FakeDevice(id=i, process_index=i % 2) for i in range(8)]
    expected, _ = mesh_lib._hybrid_device_array("fsdp=2,tensor=2", "data=2", devs)

    def fail(*args, **kwargs):
      raise RuntimeError("no topology")

    with mock.patch.object(mesh_lib.mesh_utils, "create_hybrid_device_mesh", fail):
      arr, _ = mesh_lib._hybrid_device_array("fsdp=2,tensor=2", "data=2", devs)
    np.testing.assert_array_equal(_ids(arr), _ids(expected))
    self.assertEqual(arr.shape, (2, 2, 2))


class LogicalRulesTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.mesh = mesh_lib.make_mesh("data=2,fsdp=2,tensor=2")

  @parameterized.named_parameters(
      ("embed_mlp", ("embed", "mlp"), P("fsdp", "tensor")),
      ("layers_replicated", ("layers", "embed", "heads", "head_dim"),
       P(None, "fsdp", "tensor", None)),
      ("batch_multi", ("batch", "length", "embed"), P(("data", "fsdp"), None, None)),
      ("none", (None, "vocab"), P(None, "tensor")),
      # One-axis-once: `mlp` wants tensor but `heads` already took it.
      ("axis_once", ("heads", "mlp"), P("tensor", None)),
      ("embed_then_batch", ("embed", "batch"), P("fsdp", "data")),
      ("merged_dim", P(("heads", "head_dim"), "embed"), P("tensor", "fsdp")),
  )
  def test_specs(self, logical, expected):
    self.assertEqual(mesh_lib.logical_to_partition_spec(logical, self.mesh), expected)

  def test_size_one_dropped(self):
    m = mesh_lib.make_mesh("replica=1,data=8,tensor=1")
    self.assertEqual(mesh_lib.logical_to_partition_spec(("batch", "mlp"), m), P("data", None))

  def test_missing_mesh_axes_skipped(self):
    m = mesh_lib.make_mesh("tensor=8")
    self.assertEqual(mesh_lib.logical_to_partition_spec(("batch", "embed", "mlp"), m),
                     P(None, None, "tensor"))

  def test_custom_rules_first_match(self):
    rules = (("embed", "tensor"), ("embed", "fsdp"))
    self.assertEqual(mesh_lib.logical_to_partition_spec(("embed",), self.mesh, rules),
                     P("tensor"))

  def test_unknown_logical_name(self):
    with self.assertRaisesRegex(ValueError, r"'embd'.*known logical axes are batch, length"):
      mesh_lib.logical_to_partition_spec(("embd",), self.mesh)

  def test_divisibility(self):
    with self.assertRaises(ValueError) as cm:
      mesh_lib.logical_to_partition_spec(("batch", "mlp"), self.mesh, shape=(6, 8))
    msg = str(cm.exception)
    self.assertNotIn("\n", msg)
    for f in ("'batch'", "size 6", "data=2 x fsdp=2", "4"):
      self.assertIn(f, msg)
    # Divisible shapes pass; the shape rank must match.
    mesh_lib.logical_to_partition_spec(("batch", "mlp"), self.mesh, shape=(8, 6 * 2))
    with self.assertRaisesRegex(ValueError, "2 dims but the shape"):
      mesh_lib.logical_to_partition_spec(("batch", "mlp"), self.mesh, shape=(8,))

  def test_fewer_kv_heads_than_tensor_are_replicated(self):
    """K/V heads the tensor axis does not divide stay whole on every tensor shard; query
    heads that it does not divide are still an error."""
    m = mesh_lib.make_mesh("data=2,tensor=4")
    axes = ("layers", "embed", "kv_heads", "head_dim")
    self.assertEqual(mesh_lib.logical_to_partition_spec(axes, m, shape=(2, 64, 2, 8)),
                     P(None, None, None, None))
    self.assertEqual(mesh_lib.logical_to_partition_spec(axes, m, shape=(2, 64, 8, 8)),
                     P(None, None, "tensor", None))
    with self.assertRaisesRegex(ValueError, "'heads'.*size 2, not divisible by mesh axes "
                                "tensor=4"):
      mesh_lib.logical_to_partition_spec(("embed", "heads"), m, shape=(64, 2))

  def test_tree_and_device_put(self):
    logical = {
        "embedding": ("vocab", "embed"),
        "layers": {"w_in": ("layers", "embed", "mlp"), "scale": P("layers", None)},
        "step": (),
    }
    params = {
        "embedding": jnp.zeros((16, 8)),
        "layers": {"w_in": jnp.zeros((3, 8, 4)), "scale": jnp.zeros((3, 8))},
        "step": jnp.zeros(()),
    }
    shardings = mesh_lib.logical_to_sharding(logical, self.mesh, shapes=params)
    chex.assert_trees_all_equal_structs(shardings, params)
    self.assertEqual(shardings["embedding"].spec, P("tensor", "fsdp"))
    self.assertEqual(shardings["step"].spec, P())
    placed = jax.device_put(params, shardings)
    shard_shapes = jax.tree.map(lambda x: {s.data.shape for s in x.addressable_shards}, placed)
    self.assertEqual(shard_shapes, {
        "embedding": {(8, 4)},
        "layers": {"w_in": {(3, 4, 2)}, "scale": {(3, 8)}},
        "step": {()},
    })
    self.assertLen(placed["embedding"].addressable_shards, 8)

  def test_tree_shapes_as_tuples_and_structs(self):
    logical = {"a": ("batch", "length"), "b": ("embed",)}
    shapes = {"a": (4, 16), "b": jax.ShapeDtypeStruct((6,), jnp.float32)}
    with self.assertRaisesRegex(ValueError, r"'embed'.*size 6.*fsdp=4"):
      mesh_lib.logical_to_sharding(logical, mesh_lib.make_mesh("fsdp=4,tensor=2"), shapes=shapes)
    out = mesh_lib.logical_to_sharding(logical, self.mesh, shapes=shapes)
    self.assertEqual(out["a"].spec, P(("data", "fsdp"), None))

  def test_batch_sharding(self):
    m = mesh_lib.make_mesh("data=2,context=2,tensor=2")
    bs = mesh_lib.batch_sharding(m)
    self.assertIsInstance(bs, NamedSharding)
    self.assertEqual(bs.spec, P("data", "context"))
    self.assertEqual(mesh_lib.batch_sharding(m, ndim=3).spec, P("data", "context", None))
    x = jax.device_put(jnp.zeros((4, 6)), bs)
    self.assertEqual({s.data.shape for s in x.addressable_shards}, {(2, 3)})


if __name__ == "__main__":
  absltest.main()
