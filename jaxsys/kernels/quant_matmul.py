"""Quantized matmul: W8A8 (int8 or fp8 e4m3) and W4A16 (int4 weights, group scales).

`quantize_weight(w_KN, scheme)` -> `QWeight`; `qmatmul(x, qw, impl=...)` -> x @ w in
x.dtype. The schemes and the int4 packing are described in qweight.py (re-exported
here). impl: "pallas" (quant_matmul_pallas.py: Triton on GPU, Mosaic on TPU, interpret
mode on CPU; split over the mesh by sharded.py), "xla" (plain XLA dots on the codes),
"reference" (dequantize, then an f32 matmul, activations fake-quantized exactly as the
fast paths quantize them), "auto".

Example:
  qw = quantize_weight(w_KN, "w4a16", group_size=128)
  y = qmatmul(x_BTK, qw)           # [B, T, N] in x.dtype
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxsys.kernels import backends, sharded
from jaxsys.kernels.backends import IMPLS  # re-exported: the valid `impl` values
from jaxsys.kernels.quant_matmul_pallas import pallas_qmatmul
# The weight format, re-exported: callers use `quant_matmul.quantize_weight` and friends.
from jaxsys.kernels.qweight import (FP8, FP8_MAX, INT4_MAX, INT8_MAX, SCHEMES, QWeight,
                                    check_matmul, codes_of, dequantize, from_codes, pack_int4,
                                    quantize_activations, quantize_weight, unpack_int4,
                                    unpack_nibbles)


def resolve_impl(impl: str, backend: str | None = None) -> str:
  """"auto" -> Pallas on GPU and TPU, XLA on CPU; others pass through (checked)."""
  return backends.resolve_impl("qmatmul", impl, backend)


def reference_qmatmul(x: jax.Array, qw: QWeight) -> jax.Array:
  """f32 matmul of the (fake-quantized, for w8a8) activations with dequantize(qw)."""
  check_matmul(x, qw)
  if qw.scheme == "w4a16":
    xf = x.astype(jnp.float32)
  else:
    codes, scale = quantize_activations(x, qw.scheme)
    xf = codes.astype(jnp.float32) * scale
  out = jnp.matmul(xf, dequantize(qw), precision=lax.Precision.HIGHEST)
  return out.astype(x.dtype)


def _dot_last(a, b, out_type):
  """a [..., K] @ b [K, N] -> [..., N] accumulating in out_type."""
  return lax.dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())), preferred_element_type=out_type)


def xla_qmatmul(x: jax.Array, qw: QWeight) -> jax.Array:
  """XLA dots on the codes: int8 -> int32, fp8 -> f32; w4a16 unpacks to x.dtype first."""
  check_matmul(x, qw)
  if qw.scheme == "w4a16":
    # Dequantized in x.dtype: XLA fuses the unpack/scale into the dot's operand on GPU.
    return _dot_last(x, dequantize(qw, x.dtype), jnp.float32).astype(x.dtype)
  codes, x_scale = quantize_activations(x, qw.scheme)
  acc = _dot_last(codes, qw.data, jnp.int32 if qw.scheme == "w8a8_int8" else jnp.float32)
  return (acc.astype(jnp.float32) * x_scale * qw.scale[0]).astype(x.dtype)


def qmatmul(x: jax.Array, qw: QWeight, *, impl: str = "auto") -> jax.Array:
  """x [..., K] @ the quantized weight [K, N] -> [..., N] in x.dtype."""
  impl = resolve_impl(impl)
  check_matmul(x, qw)
  if impl == "reference":
    return reference_qmatmul(x, qw)
  if impl == "xla":
    return xla_qmatmul(x, qw)
  return sharded.sharded_qmatmul(pallas_qmatmul, x, qw)
