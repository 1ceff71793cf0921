"""RoPE frequency scaling (`model.rope_scaling`) against transformers' own
`modeling_rope_utils` functions (skipped without torch and transformers): linear, llama3 and
yarn frequencies within 1e-6 relative, yarn's attention factor to 1e-12; the spec's parsing
and refusals; yarn's cos/sin factor reaching the rotation."""
import importlib.util

import numpy as np
import pytest

from jaxsys.models import transformer

needs_transformers = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "transformers")),
    reason="transformers and torch are not installed: pip install -e '.[hf]'")

CASES = [  # (rope type, theta, head dim, rope parameters)
    ("linear", 1e4, 64, dict(factor=4.0)),
    ("llama3", 5e5, 64, dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192)),
    ("yarn", 1e6, 128, dict(factor=4.0, original_max_position_embeddings=32768)),  # Qwen2.5
    ("yarn", 1e4, 16, dict(factor=4.0, original_max_position_embeddings=64, truncate=False)),
    ("yarn", 1e4, 64, dict(factor=40.0, original_max_position_embeddings=4096, mscale=0.707,
                           mscale_all_dim=1.0)),
    ("yarn", 5e5, 64, dict(factor=8.0, original_max_position_embeddings=8192,
                           attention_factor=0.9, beta_fast=16.0, beta_slow=2.0)),
]


def _spec(kind, p):
  return f"{kind}:" + ",".join(f"{k}={float(v)}" for k, v in p.items())


@needs_transformers
@pytest.mark.parametrize("kind, theta, d, p", CASES)
def test_frequencies_equal_transformers(kind, theta, d, p):
  import transformers  # pylint: disable=import-outside-toplevel
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # pylint: disable=import-outside-toplevel
  config = transformers.LlamaConfig(
      hidden_size=4 * d, num_attention_heads=4, head_dim=d, max_position_embeddings=1 << 17,
      rope_parameters=dict(rope_type=kind, rope_theta=theta, **p))
  want, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
  want = want.numpy()
  got = transformer.rope_frequencies(d, theta, _spec(kind, p))
  assert got.dtype == np.float32 and got.shape == want.shape
  assert float(np.max(np.abs(got - want) / want)) < 1e-6
  assert transformer.rope_attention_factor(_spec(kind, p)) == pytest.approx(factor, rel=1e-12)


def test_yarn_blends_and_scales():
  """Fast dims keep their frequency, slow ones are divided by factor, and cos/sin are
  scaled by 0.1 ln(factor) + 1: the rotation lengthens vectors by that factor."""
  spec = "yarn:factor=4,original_max_position_embeddings=64"
  plain = transformer.rope_frequencies(16, 1e4)
  got = transformer.rope_frequencies(16, 1e4, spec)
  # The dims turning 1 and 32 times over 64 positions are 2.0 and -1.0 (truncated: 3, 0).
  np.testing.assert_array_equal(got[:1], plain[:1])
  np.testing.assert_allclose(got[3:], plain[3:] / 4, rtol=1e-6)
  np.testing.assert_allclose(got[1:3], plain[1:3] * (1 - np.array([1, 2]) / 3 * 0.75),
                             rtol=1e-6)
  x = np.ones((1, 3, 1, 16), np.float32)
  norm = np.linalg.norm(transformer.rope(x, np.arange(3)[None], 1e4, spec), axis=-1)
  np.testing.assert_allclose(norm, 4 * (0.1 * np.log(4) + 1), rtol=1e-6)


@pytest.mark.parametrize("spec, message", [
    ("dynamic:factor=2", "rope type 'dynamic' is not supported (transformers recomputes dynamic "
     "NTK frequencies from the longest sequence the model instance has run so far"),
    ("yarn:factor=4", "yarn must set the keys factor, original_max_position_embeddings and may "
     "set attention_factor, beta_fast"),
    ("yarn:factor=4,original_max_position_embeddings=64,truncate=2",
     "yarn's truncate must be 0 or 1"),
    ("yarn:factor=4,original_max_position_embeddings=64,low_freq_factor=1", "yarn must set"),
])
def test_refusals(spec, message):
  with pytest.raises(ValueError) as e:
    transformer.parse_rope_scaling(spec)
  assert message in str(e.value) and str(e.value).startswith(f"model.rope_scaling={spec!r}: ")
  assert "\n" not in str(e.value)
