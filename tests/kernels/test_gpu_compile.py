"""The Pallas GPU (Triton) kernels compiled for an NVIDIA H100 from this CPU host.

The CUDA plugin compiles for XLA's description of the GPU (`jaxsys.chips`), no GPU
attached: XLA lowers each kernel through Triton to sm_90 machine code. Interpret mode
checks the kernels' values; this checks that the GPU compiler accepts them at the
model's shapes (a failure to compile fails the test).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import flash_value_and_grads, windowed_flash_hlo, needs_cuda_plugin
from jaxsys import chips
from jaxsys.kernels import qweight
from jaxsys.kernels.attention_pallas import pallas_attention
from jaxsys.kernels.quant_matmul_pallas import pallas_qmatmul

pytestmark = needs_cuda_plugin
TRITON = '"__gpu$xla.gpu.triton"'


def _on_one_gpu() -> NamedSharding:
  return NamedSharding(Mesh(np.array(chips.slice_devices("h100-1").devices), ("x",)), P())


def _spec(shape, dtype, sharding):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


@pytest.mark.parametrize("head_dim,seq_len,causal,packed", [
    (64, 1024, False, True), (128, 32768, True, True)])
def test_flash_attention_compiles(head_dim, seq_len, causal, packed):
  """Forward and both backward kernels, GQA (8 query heads over 2 kv heads), bf16."""
  on = _on_one_gpu()
  q = _spec((1, seq_len, 8, head_dim), jnp.bfloat16, on)
  kv = _spec((1, seq_len, 2, head_dim), jnp.bfloat16, on)
  ids = _spec((1, seq_len), jnp.int32, on)

  value_and_grads = flash_value_and_grads(pallas_attention, causal=causal, packed=packed)
  compiled = jax.jit(value_and_grads).lower(q, kv, kv, ids).compile()
  assert compiled.as_text().count(f"custom_call_target={TRITON}") == 3


@pytest.mark.slow  # about 2 s of compile
def test_flash_attention_with_a_window_compiles():
  """Mistral 7B v0.1's window of 4096 over 8192 tokens, packed: the kernels with the band's
  element mask and block ranges."""
  hlo = windowed_flash_hlo(pallas_attention, _on_one_gpu())
  assert hlo.count(f"custom_call_target={TRITON}") == 3


@pytest.mark.parametrize("scheme", qweight.SCHEMES)
def test_quantized_matmul_compiles(scheme):
  on = _on_one_gpu()
  qw = jax.eval_shape(lambda w: qweight.quantize_weight(w, scheme),
                      jax.ShapeDtypeStruct((1024, 2048), jnp.float32))
  qw = jax.tree.map(lambda a: _spec(a.shape, a.dtype, on), qw)
  x = _spec((256, 1024), jnp.bfloat16, on)
  compiled = jax.jit(lambda x, qw: pallas_qmatmul(x, qw, flavor="gpu", interpret=False)).lower(
      x, qw).compile()
  assert compiled.as_text().count(f"custom_call_target={TRITON}") == 1
