"""jaxsys/bench/attention.py (experiments/bench_attention.py's library): the tokamax peers, their
reference check and impl choice; the binary's one-line errors."""
import math
import sys

import jax
import jax.numpy as jnp
import pytest
from absl import flags
from absl.testing import flagsaver

from conftest import binary_flags, import_binary
from jaxsys.bench import attention as bench_attention

pytestmark = pytest.mark.slow  # starts processes or trains end to end

binary = import_binary("bench_attention")

needs_tokamax = pytest.mark.skipif(not bench_attention.tokamax_installed(),
                                   reason="tokamax not installed: pip install -e '.[tokamax]'")
TOKAMAX = list(bench_attention.TOKAMAX_IMPLS)


def _main_exit(argv):
  with binary_flags(binary), flagsaver.flagsaver():
    flags.FLAGS(["bench_attention", *argv])
    with pytest.raises(SystemExit) as e:
      binary.main([])
  return e.value.code


def test_without_tokamax_not_in_default_and_one_error_line(monkeypatch):
  monkeypatch.setitem(sys.modules, "tokamax", None)  # as if not installed: import fails
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  assert bench_attention.default_impls() == ["xla", "cudnn_or_xla_dpa"]
  # sys.exit(str): the interpreter prints it as the one stderr line and exits 1.
  assert _main_exit(["--impls=xla,tokamax_xla_chunked"]) == (
      "error: --impls: tokamax_xla_chunked needs tokamax: pip install -e '.[tokamax]'")
  with pytest.raises(ImportError, match=r"tokamax_xla needs tokamax"):
    bench_attention.make_impl("tokamax_xla")


def test_unknown_impl_one_error_line():
  assert _main_exit(["--impls=flash"]) == (
      "error: --impls: unknown impl 'flash'; choose from xla, pallas, cudnn_or_xla_dpa, "
      "jax_pallas, tokamax_xla_chunked, tokamax_xla")


@needs_tokamax
def test_with_tokamax_in_cpu_default(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  assert bench_attention.default_impls() == ["xla", "cudnn_or_xla_dpa", *TOKAMAX]


@needs_tokamax
def test_tokamax_matches_reference():
  # GQA (4 query heads on 2 kv heads), causal and packed, values and vjp: the same computation.
  impls = {n: bench_attention.make_impl(n) for n in ["xla", "cudnn_or_xla_dpa", *TOKAMAX]}
  assert bench_attention.check_impls(impls, heads=4, kv_heads=2, d=32, dtype=jnp.float32) == {}


def test_check_refuses_another_computation():
  def dpa(scale=None, is_causal=True):
    return lambda q, k, v, seg: jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=is_causal,
        mask=None if seg is None else (seg[:, :, None] == seg[:, None, :])[:, None])

  impls = {"right": (dpa(), ""), "scale": (dpa(scale=1 / 32), ""),
           "not_causal": (dpa(is_causal=False), "")}
  failures = bench_attention.check_impls(impls, heads=2, kv_heads=1, d=32, dtype=jnp.float32,
                                         t=256)
  assert sorted(failures) == ["not_causal", "scale"]
  assert failures["scale"].startswith("differs from reference_attention (causal, T=256): max |out")


@needs_tokamax
def test_tiny_run_with_tokamax():
  result = bench_attention.run([64], 1, 2, 1, 16, jnp.float32, ["xla", *TOKAMAX], packed=True,
                               passes=["fwd", "fwd_bwd"], repeats=1, max_seconds=60, seed=0)
  timed = {(r["impl"], r["mode"], r["pass"]) for r in result["rows"] if "time_s" in r}
  assert timed == {(i, m, p) for i in ["xla", *TOKAMAX] for m in ("causal", "packed")
                   for p in ("fwd", "fwd_bwd")}
  assert set(result["versions"]) == {"jax", "tokamax"}
  text = bench_attention.markdown(result)
  assert "| 64 | packed | fwd | tokamax_xla (dense mask) |" in text
  assert text.splitlines()[2].endswith("| time / best tokamax |")
  lines = bench_attention.tokamax_target(result, min_t=64)
  assert [l.split(":")[0] for l in lines] == ["T=64 causal fwd_bwd", "T=64 packed fwd_bwd"]
  assert math.isfinite(result["others_cpu_share"])
