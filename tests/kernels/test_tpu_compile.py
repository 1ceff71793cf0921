"""The Pallas TPU kernels compiled by Mosaic for real chips (v5e, v6e) from this CPU host.

Interpret mode checks the kernels' values; this checks that libtpu's Mosaic compiler
accepts them for each chip at the model's shapes (a failure to compile fails the test).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import flash_value_and_grads, windowed_flash_hlo, needs_libtpu
from jaxsys import chips
from jaxsys.kernels import qweight
from jaxsys.kernels.attention_pallas_tpu import pallas_tpu_attention
from jaxsys.kernels.quant_matmul_pallas import pallas_qmatmul

pytestmark = needs_libtpu
SLICES = ("v5e:2x2", "v6e:2x2")


def _on_one_chip(topology: str) -> NamedSharding:
  return NamedSharding(Mesh(np.array(chips.slice_devices(topology).devices[:1]), ("x",)), P())


def _spec(shape, dtype, sharding):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


@pytest.mark.parametrize("topology", SLICES)
@pytest.mark.parametrize("head_dim,seq_len,causal,packed", [
    (64, 2048, True, True), pytest.param(128, 8192, True, False, marks=pytest.mark.slow),
    pytest.param(128, 32768, True, True, marks=pytest.mark.slow), (64, 1024, False, True)])
def test_flash_attention_compiles(topology, head_dim, seq_len, causal, packed):
  """Forward and both backward kernels, GQA (8 query heads over 2 kv heads), bf16."""
  on = _on_one_chip(topology)
  q = _spec((1, seq_len, 8, head_dim), jnp.bfloat16, on)
  kv = _spec((1, seq_len, 2, head_dim), jnp.bfloat16, on)
  ids = _spec((1, seq_len), jnp.int32, on)

  value_and_grads = flash_value_and_grads(pallas_tpu_attention, causal=causal, packed=packed)
  compiled = jax.jit(value_and_grads).lower(q, kv, kv, ids).compile()
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 3


@pytest.mark.slow  # about 4 s of compile
@pytest.mark.parametrize("topology", SLICES[:1])
def test_flash_attention_with_a_window_compiles(topology):
  """Mistral 7B v0.1's window of 4096 over 8192 tokens, packed: the kernels with the band's
  element mask and block ranges."""
  hlo = windowed_flash_hlo(pallas_tpu_attention, _on_one_chip(topology))
  assert hlo.count('custom_call_target="tpu_custom_call"') == 3


@pytest.mark.parametrize("topology", SLICES)
@pytest.mark.parametrize("scheme", qweight.SCHEMES)
def test_quantized_matmul_compiles(topology, scheme):
  on = _on_one_chip(topology)
  qw = jax.eval_shape(lambda w: qweight.quantize_weight(w, scheme),
                      jax.ShapeDtypeStruct((1024, 2048), jnp.float32))
  qw = jax.tree.map(lambda a: _spec(a.shape, a.dtype, on), qw)
  x = _spec((256, 1024), jnp.bfloat16, on)
  compiled = jax.jit(lambda x, qw: pallas_qmatmul(x, qw, flavor="tpu", interpret=False)).lower(
      x, qw).compile()
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 1
