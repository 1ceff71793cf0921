"""Shared by the attention kernel tests: inputs, packed ids and the reference comparison."""
import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.data import packing
from jaxsys.kernels.attention import reference_attention

TOL = {np.dtype(np.float32): 1e-5, np.dtype(jnp.bfloat16): 2e-2}
# Compile time dominates these tests: skip the expensive backend passes (same HLO), and
# optimising interpret-mode loops costs more than running them.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def inputs(b, t, s, hq, hkv, d, dtype=np.float32, seed=0):
  """Random q, k, v (in dtype) and an f32 cotangent; numpy, so no per-shape compiles."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
  q, k, v = normal(b, t, hq, d), normal(b, s, hkv, d), normal(b, s, hkv, d)
  return q.astype(dtype), k.astype(dtype), v.astype(dtype), normal(b, t, hq, d)


def packed_ids(rng, b, n, lengths=(1, 1, 2, 5, 9, 17)):
  """[B, n] int32 increasing segment ids, each length drawn from `lengths` (1s included)."""
  return packing.random_packed_batch(b, n, doc_lengths=lengths, seed=rng)["segment_ids"]


def segment_kwargs(segs) -> dict:
  """(q_ids, kv_ids) or None -> the kernels' keyword arguments."""
  return {} if segs is None else dict(q_segment_ids=segs[0], kv_segment_ids=segs[1])


def value_and_grads(fn, q, k, v, cotangent):
  """fn(q, k, v) and the grads of <fn(q, k, v), cotangent> wrt q, k, v, in one compilation."""
  def run(q, k, v, cotangent):
    def loss(q, k, v):
      out = fn(q, k, v)
      return jnp.sum(out.astype(jnp.float32) * cotangent), out

    (_, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    return out, grads

  return jax.jit(run).lower(q, k, v, cotangent).compile(FAST_COMPILE)(q, k, v, cotangent)


def reference_value_and_grads(q, k, v, cotangent, segs=None, causal=True, **kw):
  """The truth to approach: reference_attention in f32 from the same (maybe bf16) inputs."""
  f32 = lambda x: np.asarray(x, np.float32)
  return value_and_grads(
      lambda q, k, v: reference_attention(q, k, v, segment_ids=segs, causal=causal, **kw),
      f32(q), f32(k), f32(v), cotangent)


def assert_matches_reference(fn, q, k, v, cotangent, segs=None, causal=True, tol=None, **kw):
  """fn(q, k, v) == reference_attention, values and grads, in q.dtype; returns (out, grads)."""
  out, grads = value_and_grads(fn, q, k, v, cotangent)
  ref_out, ref_grads = reference_value_and_grads(q, k, v, cotangent, segs, causal, **kw)
  chex.assert_shape(out, q.shape)
  tol = TOL[np.dtype(q.dtype)] if tol is None else tol
  for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
    chex.assert_type(got, q.dtype)
    chex.assert_tree_all_finite(got)
    want = np.asarray(want)
    # Scale-aware: grads of a long sum can be O(10), values are O(1).
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol * scale,
                               err_msg=name)
  return out, grads
