"""Reading compiled HLO text: instructions that span lines, convolutions whose labels name
their spatial dimensions out of order."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxsys import comm_bytes
from jaxsys import hlo_flops

# A custom call whose backend_config JSON is printed over several lines, two of which
# begin with `}` (as tokamax's splash kernels print theirs): inserted at the top of a loop
# body, it must not end the body.
_MULTI_LINE_CALL = """  %kernel = f32[8]{0} custom-call(), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {
"body": "mosaic",
"flags": {"a": "}{"}
},
"implicit": true
}"""


def _loop_hlo() -> tuple[str, int, int]:
  """A compiled 5-trip loop of an all-gather and a dot (8 CPU devices): its text, one
  trip's dot FLOPs and one trip's all-gather bytes sent by one device."""
  mesh = Mesh(np.array(jax.devices()[:8]), ("x",))

  def body(_, h):
    w = jax.lax.all_gather(h[:, :16], "x", axis=0, tiled=True)  # [128, 16]
    return jnp.tanh(h + jnp.sum(w @ w.T))

  def loop(h):
    return jax.lax.fori_loop(0, 5, body, h)

  fn = jax.shard_map(loop, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
  text = jax.jit(fn).lower(jnp.ones((128, 32))).compile().as_text()
  return text, 2 * 128 * 128 * 16, 7 * 16 * 16 * 4


def _with_call_in_loop_body(text: str) -> str:
  """`text` with the multi-line call as the first instruction of every while body."""
  names = set(re.findall(r" while\(.*body=%?([\w.\-]+)", text))
  out = []
  for line in text.splitlines():
    out.append(line)
    if any(line.startswith((f"%{n} ", f"{n} ")) and line.endswith("{") for n in names):
      out.append(_MULTI_LINE_CALL)
  return "\n".join(out)


def test_an_instruction_over_several_lines_ends_no_computation():
  text, dot, gathered = _loop_hlo()
  assert hlo_flops.dot_flops(text) == 5 * dot
  assert comm_bytes.collective_bytes_from_hlo(text, 8, trips=True) == 5 * gathered
  patched = _with_call_in_loop_body(text)
  assert patched.count('"implicit": true') >= 1
  # Every instruction after the call still counts, every trip.
  assert hlo_flops.dot_flops(patched) == 5 * dot
  assert comm_bytes.collective_bytes_from_hlo(patched, 8, trips=True) == 5 * gathered
  bodies, _ = hlo_flops.computations(patched)
  (call,) = [l for lines in bodies.values() for l in lines if "tpu_custom_call" in l]
  assert call.endswith('"implicit": true }')


def test_a_computation_may_end_with_attributes():
  """libtpu 0.0.50 closes a SparseCore computation with `}, execution_thread="sparsecore"`
  (MaxText's embedding lookup): what follows it, the ENTRY included, is still read."""
  text, dot, gathered = _loop_hlo()
  sparse = "\n".join([
      "%fused_computation.clone (param_0: bf16[128,64], param_1: s32[64]) -> bf16[64,64] {",
      "  %param_0 = bf16[128,64]{1,0} parameter(0)",
      "  %param_1 = s32[64]{0} parameter(1)",
      "  ROOT %gather.1 = bf16[64,64]{1,0} gather(%param_0, %param_1), offset_dims={1}, "
      "collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,64}",
      '}, execution_thread="sparsecore"', ""])
  at = text.index("ENTRY")
  patched = text[:at] + sparse + "\n" + text[at:]
  bodies, entry = hlo_flops.computations(patched)
  assert entry is not None and "fused_computation.clone" in bodies
  assert hlo_flops.dot_flops(patched) == 5 * dot
  assert comm_bytes.collective_bytes_from_hlo(patched, 8, trips=True) == 5 * gathered


def _conv(labels: str, lhs: tuple, rhs: tuple, out: tuple) -> str:
  shape = lambda dims: f"f32[{','.join(map(str, dims))}]"
  return "\n".join([
      "ENTRY %main (p0: f32[1], p1: f32[1]) -> f32[1] {",
      f"  %lhs = {shape(lhs)}{{3,2,1,0}} parameter(0)",
      f"  %rhs = {shape(rhs)}{{3,2,1,0}} parameter(1)",
      f"  ROOT %conv = {shape(out)}{{3,2,1,0}} convolution(%lhs, %rhs), "
      f"window={{size=3x1 pad=1_1x0_0}}, dim_labels={labels}",
      "}"])


@pytest.mark.parametrize("labels, lhs, rhs, out", [
    ("b01f_01io->b01f", (2, 8, 4, 3), (3, 1, 3, 5), (2, 8, 4, 5)),
    # The same convolution, spatial dimension 1 written first (libtpu 0.0.50 writes q/k/v
    # weight gradients so): the window's 3 still belongs to dimension 0 (8 long).
    ("1fb0_1i0o->b0f1", (4, 3, 2, 8), (1, 3, 3, 5), (2, 8, 5, 4)),
])
def test_convolution_windows_pair_with_spatial_dimensions_by_number(labels, lhs, rhs, out):
  # Dimension 0: 8 outputs x 3 taps, less the 2 that fall on padding; dimension 1: 4 x 1.
  taps = (8 * 3 - 2) * 4
  assert hlo_flops.dot_flops(_conv(labels, lhs, rhs, out)) == 2 * (2 * 5) * 3 * taps


def _scan_over_layers(unroll) -> tuple[str, float]:
  """A 6-layer scan (each layer's weight sliced from a stack, each output written into a
  stacked result): its compiled text and XLA's own bytes accessed."""
  def fn(x, ws):
    def layer(h, w):
      y = jnp.tanh(h @ w)
      return y, y * 2
    return jax.lax.scan(layer, x, ws, unroll=unroll)

  compiled = jax.jit(fn).lower(jnp.ones((64, 128)), jnp.ones((6, 128, 128))).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return compiled.as_text(), float(cost["bytes accessed"])


def test_hbm_bytes_count_every_trip_of_a_loop():
  """Unrolled, there is no loop: the count is XLA's own. Looped, XLA counts one layer while
  this counts six; a slice of the weight stack reads one layer's weight and a write into
  the stacked result one layer's output, not the whole stack each trip (else 6x more)."""
  unrolled_text, unrolled_xla = _scan_over_layers(True)
  looped_text, looped_xla = _scan_over_layers(1)
  assert hlo_flops.hbm_bytes(unrolled_text) == pytest.approx(unrolled_xla, rel=0.02)
  assert looped_xla < 0.35 * unrolled_xla  # the loop body once
  assert hlo_flops.hbm_bytes(looped_text) == pytest.approx(unrolled_xla, rel=0.15)
