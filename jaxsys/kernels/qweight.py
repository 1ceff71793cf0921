"""The quantized weight format: `QWeight`, its schemes, int4 packing, and the checks and
activation quantization every qmatmul implementation shares.

Schemes:
  "w8a8_int8"  int8 weights, symmetric per output channel (scale [1, N]); activations
               quantized per token to int8 on the fly; int8 x int8 -> int32 dot.
  "w8a8_fp8"   float8_e4m3fn weights per output channel; activations per token to e4m3;
               fp8 x fp8 -> f32 dot.
  "w4a16"      int4 weights in [-8, 7], symmetric per group of `group_size` rows of K
               (scale [K // group_size, N]), two codes a byte; activations stay in
               x.dtype and the weight is dequantized inside the kernel.

int4 packing ("halves" layout): byte row r of the packed [K // 2, N] array holds code
row r in its low nibble and code row r + K // 2 in its high nibble. A kernel's K step
then reads two contiguous blocks of x (columns [r0, r0 + b) and [K/2 + r0, ...)) and
one block of bytes, with no in-kernel interleave.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

SCHEMES = ("w8a8_int8", "w8a8_fp8", "w4a16")
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0   # largest finite float8_e4m3fn
INT8_MAX = 127.0  # symmetric: -128 is never used
INT4_MAX = 7.0    # codes in [-8, 7]; the scale maps absmax to 7
_CODE_DTYPES = {"w8a8_int8": jnp.int8, "w8a8_fp8": FP8, "w4a16": jnp.int8}
_DATA_DTYPES = {"w8a8_int8": jnp.int8, "w8a8_fp8": FP8, "w4a16": jnp.uint8}


def _check_scheme(scheme, who: str) -> str:
  if scheme not in SCHEMES:
    raise ValueError(f"{who}: scheme={scheme!r} is not known; choose one of {SCHEMES}")
  return scheme


@dataclasses.dataclass(frozen=True)
class QWeight:
  """A quantized [K, N] weight: codes `data`, float32 `scale`, static scheme and group size.

  data: int8 [..., K, N] (w8a8_int8), float8_e4m3fn [..., K, N] (w8a8_fp8) or uint8
  [..., K // 2, N] (w4a16, two codes a byte). scale: f32 [..., K // group_size, N]; the
  per-channel schemes have group_size == K (one group: scale [..., 1, N]). Leading dims
  (stacked layers) are allowed on both; the static fields never depend on them.
  """
  data: jax.Array
  scale: jax.Array
  scheme: str = dataclasses.field(metadata=dict(static=True))
  group_size: int = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, int]:
    """(K, N) of the float weight this stands for (without leading dims)."""
    rows = self.data.shape[-2] * (2 if self.scheme == "w4a16" else 1)
    return rows, self.data.shape[-1]

  @property
  def nbytes(self) -> int:
    """True storage of codes plus scales, leading dims included."""
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in (self.data, self.scale))


jax.tree_util.register_dataclass(
    QWeight, data_fields=["data", "scale"], meta_fields=["scheme", "group_size"])


# ----------------------------------------------------------------------------- int4 packing


def _check_even_rows(codes, who: str) -> None:
  if codes.ndim < 2 or codes.shape[-2] % 2:
    raise ValueError(
        f"{who}: codes must be [..., K, N] with an even K (two int4 codes a byte); "
        f"got shape {tuple(codes.shape)}")


def pack_int4(codes_KN: jax.Array) -> jax.Array:
  """int8 codes in [-8, 7], [..., K, N] -> uint8 [..., K // 2, N] (row r | row r + K/2 << 4)."""
  _check_even_rows(codes_KN, "pack_int4")
  if not jnp.issubdtype(codes_KN.dtype, jnp.integer):
    raise ValueError(f"pack_int4: codes must be integers in [-8, 7]; got dtype {codes_KN.dtype}")
  half = codes_KN.shape[-2] // 2
  c = codes_KN.astype(jnp.uint8)  # two's complement: the low nibble is the int4 code
  return (c[..., :half, :] & 0xF) | (c[..., half:, :] << 4)


def unpack_nibbles(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
  """uint8 or int8 bytes [..., R, N] -> (low, high) int32 codes in [-8, 7], each [..., R, N].

  Works in int32 (sign-extended bytes, arithmetic shifts): the same code runs inside the
  Pallas kernels, where int32 vector ops lower on every backend.
  """
  s = packed if packed.dtype == jnp.int8 else lax.bitcast_convert_type(packed, jnp.int8)
  s = s.astype(jnp.int32)
  return (lax.shift_right_arithmetic(lax.shift_left(s, 28), 28),
          lax.shift_right_arithmetic(s, 4))


def unpack_int4(packed: jax.Array) -> jax.Array:
  """uint8 [..., K // 2, N] -> int8 codes [..., K, N]; inverse of `pack_int4`."""
  if packed.ndim < 2 or packed.dtype != jnp.uint8:
    raise ValueError(
        f"unpack_int4: packed must be uint8 [..., K // 2, N]; got {packed.dtype}{tuple(packed.shape)}")
  lo, hi = unpack_nibbles(packed)
  return jnp.concatenate([lo, hi], axis=-2).astype(jnp.int8)


# ----------------------------------------------------------------------------- weights


def _check_group(k: int, scheme: str, group_size, who: str) -> int:
  """The stored group size: K for per-channel schemes, `group_size` (dividing K) for w4a16."""
  if scheme != "w4a16":
    return k
  if (not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0
      or group_size % 2 or k % group_size):
    raise ValueError(
        f"{who}: group_size={group_size!r} must be an even positive divisor of K={k} "
        "(w4a16 scales one group of K rows)")
  return group_size


def _check_weight(w, who: str) -> None:
  if w.ndim < 2:
    raise ValueError(f"{who}: the weight must be [..., K, N]; got shape {tuple(w.shape)}")


def quantize_weight(w: jax.Array, scheme: str, *, group_size: int = 128) -> QWeight:
  """Round-to-nearest symmetric quantization of w [..., K, N] (in x out) for `scheme`.

  group_size applies to w4a16 only (an even divisor of K, so K is even too); the w8a8
  schemes scale per output channel and record group_size = K.
  """
  _check_scheme(scheme, "quantize_weight")
  _check_weight(w, "quantize_weight")
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"quantize_weight: w must be floating point; got dtype {w.dtype}")
  k, n = w.shape[-2:]
  g = _check_group(k, scheme, group_size, "quantize_weight")
  w_GgN = w.astype(jnp.float32).reshape(*w.shape[:-2], k // g, g, n)
  absmax = jnp.max(jnp.abs(w_GgN), axis=-2)  # [..., K // g, N]
  qmax = {"w8a8_int8": INT8_MAX, "w8a8_fp8": FP8_MAX, "w4a16": INT4_MAX}[scheme]
  scale = jnp.where(absmax > 0, absmax / qmax, 1.0)  # all-zero column: codes 0, any scale
  scaled = w_GgN / scale[..., None, :]
  if scheme == "w8a8_fp8":
    codes = jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(FP8)
  else:
    lo = -8.0 if scheme == "w4a16" else -INT8_MAX
    codes = jnp.clip(jnp.round(scaled), lo, qmax).astype(jnp.int8)
  return from_codes(codes.reshape(w.shape), scale, scheme, group_size=g)


def from_codes(codes: jax.Array, scale: jax.Array, scheme: str, *,
               group_size: int = 128) -> QWeight:
  """A QWeight from chosen codes [..., K, N] and f32 scales ([..., 1, N] or [..., K // g, N]).

  codes: int8 in [-127, 127] (w8a8_int8), float8_e4m3fn (w8a8_fp8) or int8 in [-8, 7]
  (w4a16, packed here). Used by PTQ methods (GPTQ) that pick their own codes.
  """
  _check_scheme(scheme, "from_codes")
  _check_weight(codes, "from_codes")
  k, n = codes.shape[-2:]
  g = _check_group(k, scheme, group_size, "from_codes")
  want = jnp.dtype(_CODE_DTYPES[scheme])
  if codes.dtype != want:
    raise ValueError(f"from_codes: {scheme} codes must be {want}; got dtype {codes.dtype}")
  scale_shape = (*codes.shape[:-2], k // g, n)
  if tuple(scale.shape) != scale_shape:
    raise ValueError(
        f"from_codes: scale must have shape {scale_shape} for codes {tuple(codes.shape)} "
        f"({scheme}, group_size={g}); got {tuple(scale.shape)}")
  data = pack_int4(codes) if scheme == "w4a16" else codes
  return QWeight(data=data, scale=jnp.asarray(scale, jnp.float32), scheme=scheme, group_size=g)


def codes_of(qw: QWeight) -> jax.Array:
  """The unpacked codes [..., K, N] (int8 or float8_e4m3fn)."""
  return unpack_int4(qw.data) if qw.scheme == "w4a16" else qw.data


def dequantize(qw: QWeight, dtype=jnp.float32) -> jax.Array:
  """codes * scale -> [..., K, N] in dtype (f32 by default)."""
  _check_scheme(qw.scheme, "dequantize")
  k, n = qw.shape
  codes = codes_of(qw).astype(jnp.float32)
  codes = codes.reshape(*codes.shape[:-2], k // qw.group_size, qw.group_size, n)
  return (codes * qw.scale[..., :, None, :]).reshape(*codes.shape[:-3], k, n).astype(dtype)


# ----------------------------------------------------------------------------- activations


def quantize_activations(x: jax.Array, scheme: str) -> tuple[jax.Array, jax.Array]:
  """Per-token symmetric quantization of x [..., K]: (codes [..., K], f32 scale [..., 1]).

  int8 codes in [-127, 127] with scale absmax / 127 (w8a8_int8), or float8_e4m3fn codes
  with scale absmax / 448 (w8a8_fp8). A zero row gets scale 1 and zero codes.
  """
  xf = x.astype(jnp.float32)
  absmax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
  if scheme == "w8a8_int8":
    scale = jnp.where(absmax > 0, absmax / INT8_MAX, 1.0)
    return jnp.clip(jnp.round(xf / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8), scale
  if scheme == "w8a8_fp8":
    scale = jnp.where(absmax > 0, absmax / FP8_MAX, 1.0)
    return jnp.clip(xf / scale, -FP8_MAX, FP8_MAX).astype(FP8), scale
  raise ValueError(f"quantize_activations: scheme={scheme!r} has no activation quantization; "
                   "choose w8a8_int8 or w8a8_fp8")


def check_matmul(x, qw) -> None:
  if not isinstance(qw, QWeight):
    raise ValueError(f"qmatmul: qw must be a QWeight (see quantize_weight); got {type(qw).__name__}")
  _check_scheme(qw.scheme, "qmatmul")
  if qw.data.ndim != 2:
    raise ValueError(
        f"qmatmul: qw must hold one [K, N] weight; got data shape {tuple(qw.data.shape)} "
        "(slice stacked layers first, e.g. under lax.scan, or vmap qmatmul)")
  want = jnp.dtype(_DATA_DTYPES[qw.scheme])
  if qw.data.dtype != want:
    raise ValueError(f"qmatmul: a {qw.scheme} QWeight stores {want} data; got {qw.data.dtype} "
                     "(build it with quantize_weight or from_codes)")
  k, n = qw.shape
  if x.ndim < 1 or x.shape[-1] != k:
    raise ValueError(
        f"qmatmul: x must be [..., K={k}] to match qw of shape (K, N)={(k, n)}; "
        f"got x shape {tuple(x.shape)}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"qmatmul: x must be floating point; got dtype {x.dtype}")
