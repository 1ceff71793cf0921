"""Pallas qmatmul kernels (GPU/Triton and TPU/Mosaic flavors, interpret mode on CPU).

Both flavors against `impl="xla"` and the reference for every scheme, f32 and bf16, ragged
M (1, 16, 33) and leading batch dims; the K split and the N/K padding paths; jit, vmap and
NamedSharding; and the lowering to Triton (the tt.dot operand types) and to Mosaic, which
is what can be checked without a GPU or TPU.
"""
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsys import mesh as mesh_lib
from jaxsys.kernels import quant_matmul as qm
from jaxsys.kernels.quant_matmul_pallas import (gpu_config, grouped_tile, pallas_qmatmul,
                                                tpu_config)

# Same directory (pytest puts it on sys.path): the shared inputs and tolerances.
from test_quant_matmul import _weight, _x, assert_close_to_ref, assert_one_line_errors

K, N = 256, 256  # K/2 = 128: one TPU lane block per half at group_size 128


# Compile-time bound: optimising the interpret-mode loops costs more than running them.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _check(test, x, qw, with_xla=False, **kw):
  """Pallas (interpret) vs the reference (and the xla path)."""
  fn = jax.jit(lambda x, qw: pallas_qmatmul(x, qw, **kw))
  out = fn.lower(x, qw).compile(_FAST_COMPILE)(x, qw)
  chex.assert_shape(out, x.shape[:-1] + (qw.shape[1],))
  assert_close_to_ref(test, out, qm.qmatmul(x, qw, impl="reference"), qw.scheme, x.dtype)
  if with_xla:
    assert_close_to_ref(test, out, qm.qmatmul(x, qw, impl="xla"), qw.scheme, x.dtype)
  return out


class PallasValuesTest(parameterized.TestCase):

  @parameterized.product(scheme=qm.SCHEMES, flavor=("gpu", "tpu"),
                         dtype=(jnp.float32, jnp.bfloat16))
  def test_ragged_and_batched(self, scheme, flavor, dtype):
    qw = qm.quantize_weight(_weight(K, N, outliers=True), scheme, group_size=128)
    # One call covers ragged M and leading dims: [3, 11, K] is M = 33 rows.
    _check(self, _x((3, 11, K), dtype), qw, with_xla=True, flavor=flavor)
    if dtype == jnp.float32:  # the decode shapes (the TPU flavor pads both to 32 rows)
      for m in (1, 16) if flavor == "gpu" else (1,):
        _check(self, _x((m, K), dtype, seed=m), qw, flavor=flavor)

  @parameterized.parameters(*qm.SCHEMES)
  def test_split_k_and_explicit_blocks(self, scheme):
    qw = qm.quantize_weight(_weight(512, 128), scheme, group_size=64)
    x = _x((100, 512), jnp.float32)
    # Four K splits of two steps each vs one program walking all K; 7 x 4 tiles in groups
    # of 3 M blocks (the last group shorter).
    for split_k in (1, 4):
      _check(self, x, qw, flavor="gpu", block_m=16, block_n=32, block_k=32, split_k=split_k,
             group_m=3)

  def test_split_k_default_for_decode(self):
    cfg = gpu_config("w4a16", 1, 4096, 4096, 128, interpret=False)
    self.assertEqual((cfg.block_m, cfg.m_pad), (16, 16))
    # 32 output tiles alone would leave most of an H100's 132 SMs idle.
    self.assertGreater(cfg.split_k, 1)
    big = gpu_config("w8a8_int8", 8192, 8192, 8192, 8192, interpret=False)
    self.assertEqual((big.block_m, big.block_n, big.block_k, big.split_k), (128, 256, 128, 1))

  @parameterized.parameters((7, 4, 3), (8, 5, 8), (13, 1, 4), (2, 9, 8))
  def test_grouped_tile_order(self, mb, nb, group_m):
    # A bijection from programs to tiles; a group sweeps N over group_m row blocks.
    tiles = [tuple(int(v) for v in grouped_tile(p, mb, nb, group_m)) for p in range(mb * nb)]
    self.assertCountEqual(tiles, [(i, j) for i in range(mb) for j in range(nb)])
    first = tiles[:min(group_m, mb) * nb]
    self.assertEqual({i for i, _ in first}, set(range(min(group_m, mb))))

  @parameterized.parameters(("w8a8_int8", "gpu"), ("w8a8_fp8", "tpu"), ("w4a16", "gpu"))
  def test_padded_n_and_k(self, scheme, flavor):
    # N = 40 has no 128-multiple (TPU) or power-of-two >= 16 block; w8a8 K = 200 neither.
    k = 256 if scheme == "w4a16" else 200
    qw = qm.quantize_weight(_weight(k, 40), scheme, group_size=64)
    _check(self, _x((5, k), jnp.float32), qw, flavor=flavor)

  @parameterized.parameters("w8a8_int8", "w8a8_fp8")
  def test_tpu_k_steps(self, scheme):
    # 2 x 2 x 4 grid: the VMEM accumulator is reset, summed over K blocks and rescaled.
    qw = qm.quantize_weight(_weight(512, 256), scheme)
    _check(self, _x((40, 512), jnp.bfloat16), qw, flavor="tpu", block_m=32, block_n=128,
           block_k=128)

  def test_tpu_interpret_mode(self):
    # TPU interpret mode (pipeline, scratch, grid order simulated) on a 2 x 2 x 2 grid.
    from jax.experimental.pallas import tpu as pltpu
    qw = qm.quantize_weight(_weight(512, 256), "w4a16", group_size=128)
    _check(self, _x((40, 512), jnp.bfloat16), qw, flavor="tpu", block_m=32, block_n=128,
           block_k=128, interpret=pltpu.InterpretParams())

  def test_dispatch(self):
    qw = qm.quantize_weight(_weight(K, 64), "w8a8_int8")
    x = _x((4, K), jnp.float32)
    np.testing.assert_array_equal(qm.qmatmul(x, qw, impl="pallas"), pallas_qmatmul(x, qw))
    self.assertEqual(qm.resolve_impl("auto", "gpu"), "pallas")
    self.assertEqual(qm.resolve_impl("auto", "tpu"), "pallas")
    self.assertEqual(qm.resolve_impl("auto", "cpu"), "xla")


class PallasTransformsTest(parameterized.TestCase):

  def test_vmap_over_stacked_weights(self):
    ws = jnp.stack([_weight(K, 64, seed=s) for s in range(2)])
    qws = jax.vmap(lambda w: qm.quantize_weight(w, "w4a16"))(ws)
    x = _x((3, K), jnp.float32)
    out = jax.jit(jax.vmap(lambda qw: qm.qmatmul(x, qw, impl="pallas")))(qws)
    want = jax.vmap(lambda qw: qm.qmatmul(x, qw, impl="reference"))(qws)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)

  def test_sharded_weight(self):
    # jaxsys meshes have Auto axes: XLA partitions around the kernel. (Under Explicit
    # axes pallas_call itself asks for shard_map.)
    mesh = mesh_lib.make_mesh("tensor=8")
    qw = qm.quantize_weight(_weight(K, 128), "w8a8_int8")
    sharded = jax.device_put(qw, NamedSharding(mesh, P(None, "tensor")))
    x = _x((16, K), jnp.float32)
    out = jax.jit(lambda x, qw: qm.qmatmul(x, qw, impl="pallas"))(x, sharded)
    ref = qm.qmatmul(x, qw, impl="reference")
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    # Per-device kernels on the local N slice (what a GPU mesh wants: a custom call is not
    # partitioned by XLA): one QWeight spec covers codes and per-channel scales.
    # check_vma=False: pallas_call's out_shape carries no varying-axes annotation.
    local = jax.jit(jax.shard_map(lambda x, qw: qm.qmatmul(x, qw, impl="pallas"), mesh=mesh,
                                  in_specs=(P(), P(None, "tensor")), out_specs=P(None, "tensor"),
                                  check_vma=False))
    np.testing.assert_allclose(local(x, sharded), ref, rtol=1e-5, atol=1e-5)


def _triton_ir(fn, *args):
  """The Triton IR text of each Pallas kernel in fn lowered for CUDA (no GPU needed)."""
  try:
    from jax._src.lib import triton  # private: the only way to print the Triton module
    from jax._src.lib.mlir import ir
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  except (ImportError, RuntimeError) as e:  # jaxlib > 0.10.2 compiles Triton while lowering
    raise absltest.SkipTest(f"Triton lowering needs a GPU here: {e}")
  calls = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for o in block.operations:
          if o.operation.name == "stablehlo.custom_call":
            calls.append(o)
          walk(o.operation)

  walk(lowered.compiler_ir("stablehlo").operation)
  texts = []
  for call in calls:
    blob = call.attributes["mhlo.backend_config"]["ir"].value_bytes
    with ir.Context() as ctx:
      triton.dialect.register_dialect(ctx)
      texts.append(str(ir.Module.parse(blob)))
  return texts


class LoweringTest(parameterized.TestCase):

  @parameterized.parameters(
      ("w8a8_int8", 16, r"tensor<16x128xi8> \* tensor<128x64xi8> -> tensor<16x64xi32>"),
      ("w8a8_int8", 8192, r"tensor<128x128xi8> \* tensor<128x256xi8> -> tensor<128x256xi32>"),
      ("w8a8_fp8", 16,
       r"tensor<16x128xf8E4M3FN> \* tensor<128x64xf8E4M3FN> -> tensor<16x64xf32>"),
      ("w4a16", 1, r"tensor<16x64xbf16> \* tensor<64x64xbf16> -> tensor<16x64xf32>"),
      ("w4a16", 1024, r"tensor<128x64xbf16> \* tensor<64x128xbf16> -> tensor<128x128xf32>"),
  )
  def test_lowers_to_triton(self, scheme, m, dot_pattern):
    # The whole Pallas -> Triton IR lowering runs; Triton's own compiler (TTIR -> PTX)
    # runs only with a GPU. The dot operand types are the point: int8 MMA with int32
    # accumulation, fp8 MMA, and bf16 for w4a16 with the int8 bytes unpacked in-kernel.
    qw = jax.eval_shape(lambda w: qm.quantize_weight(w, scheme),
                        jax.ShapeDtypeStruct((4096, 4096), jnp.float32))
    x = jax.ShapeDtypeStruct((m, 4096), jnp.bfloat16)
    texts = _triton_ir(lambda x, qw: pallas_qmatmul(x, qw, flavor="gpu", interpret=False), x, qw)
    self.assertLen(texts, 1)
    dots = re.findall(r"tt\.dot .*", texts[0])
    self.assertLen(dots, 2 if scheme == "w4a16" else 1)
    self.assertRegex(dots[0], dot_pattern)
    if scheme == "w4a16":  # bytes in, never a bf16 weight from HBM: bf16 loads are x only
      self.assertRegex(texts[0], r"tt\.load .*tensor<64x\d+x!tt\.ptr<i8>>")
      bf16_loads = re.findall(r"tt\.load .*tensor<(\d+x\d+)x!tt\.ptr<bf16>>", texts[0])
      self.assertEqual(bf16_loads, [f"{max(16, min(m, 128))}x64"] * 2)

  @parameterized.product(scheme=qm.SCHEMES, m=(1, 1024))
  def test_lowers_to_mosaic(self, scheme, m):
    # Export for TPU runs the Pallas -> Mosaic lowering (block shapes, VMEM scratch, every
    # op's rule); Mosaic's own compiler passes run only on a TPU.
    qw = jax.eval_shape(lambda w: qm.quantize_weight(w, scheme),
                        jax.ShapeDtypeStruct((4096, 2048), jnp.float32))
    x = jax.ShapeDtypeStruct((m, 4096), jnp.bfloat16)
    exported = jax.export.export(
        jax.jit(lambda x, qw: pallas_qmatmul(x, qw, flavor="tpu", interpret=False)),
        platforms=["tpu"])(x, qw)
    self.assertEqual(exported.mlir_module().count("stablehlo.custom_call @tpu_custom_call"), 1)
    self.assertEqual(exported.out_avals[0].shape, (m, 2048))

  def test_tpu_blocks(self):
    cfg = tpu_config("w8a8_int8", 1, 4096, 4096, 4096, interpret=False)
    self.assertEqual((cfg.block_m, cfg.block_n, cfg.block_k, cfg.m_pad), (32, 256, 512, 32))
    cfg = tpu_config("w4a16", 8192, 4096, 4096, 128, interpret=False)
    self.assertEqual((cfg.block_m, cfg.block_k, cfg.k_steps), (256, 128, 16))


class PallasErrorTest(parameterized.TestCase):

  def test_one_line_errors(self):
    qw = qm.quantize_weight(_weight(K, 64), "w8a8_int8")
    x = _x((4, K), jnp.float32)
    q4 = qm.quantize_weight(_weight(96, 64), "w4a16", group_size=24)
    cases = [
        (lambda: pallas_qmatmul(x, qw, flavor="metal"), r"flavor='metal'.*\('gpu', 'tpu'\)"),
        (lambda: pallas_qmatmul(x, qw, interpret="yes"), r"interpret='yes'"),
        (lambda: pallas_qmatmul(x, qw, block_n=24), r"block_n must be a power of two.*got block_n=24"),
        (lambda: pallas_qmatmul(x, qw, flavor="tpu", block_k=64), r"block_k must be a positive multiple of 128.*got block_k=64"),
        (lambda: pallas_qmatmul(x, qw, split_k=3), r"split_k=3 must divide"),
        (lambda: pallas_qmatmul(x, qw, group_m=0), r"group_m must be a positive int.*0"),
        (lambda: pallas_qmatmul(x, qw, flavor="tpu", split_k=2), r"split_k=2 is GPU-only"),
        # gcd(group 24, K/2 = 48) = 24 has no power-of-two factor >= 16.
        (lambda: pallas_qmatmul(_x((2, 96), jnp.float32), q4),
         r"group_size=24 and K/2=48; got block_k=8"),
        (lambda: pallas_qmatmul(_x((2, 95), jnp.float32), qw), r"K=256.*\(2, 95\)"),
    ]
    assert_one_line_errors(self, cases)


if __name__ == "__main__":
  absltest.main()
