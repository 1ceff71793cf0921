"""experiments/bench_generate.py: the same greedy tokens as transformers, timings, no-torch error."""
import importlib.util
import sys

import numpy as np
import pytest

from conftest import import_binary

pytestmark = pytest.mark.slow  # starts processes or trains end to end

bench_generate = import_binary("bench_generate")

needs_transformers = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "transformers")),
    reason="transformers and torch are not installed: pip install -e '.[hf]'")


@pytest.fixture(scope="module")
def test_model(tmp_path_factory):
  return bench_generate.build("test", str(tmp_path_factory.mktemp("bench_generate")))


def test_without_transformers_one_error_line(monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "torch", None)  # None in sys.modules: import raises
  monkeypatch.setitem(sys.modules, "transformers", None)
  with pytest.raises(SystemExit) as exit_:
    bench_generate.main(["bench_generate"])
  assert exit_.value.code == 1
  assert capsys.readouterr().err == (
      "error: bench_generate needs transformers and torch: pip install -e '.[hf]'\n")


@needs_transformers
def test_same_greedy_tokens_as_transformers(test_model):
  model, cfg, params = test_model
  prompts = bench_generate.prompts(3, 8, cfg.vocab_size)
  same = bench_generate.same_tokens(model, cfg, params, prompts, new=12)
  assert same["rows_equal"] == 3 and same["first_diff"] == [12] * 3, same
  assert same["max_logit_diff"] < 1e-4 * same["max_logit"], same
  # The tokens are not a tie decided alike by luck: the best two logits are far apart.
  assert same["min_gap_on_equal_steps"] > 100 * same["max_logit_diff"], same


@needs_transformers
def test_timings_of_each_framework(test_model):
  model, cfg, params = test_model
  prompts = bench_generate.prompts(2, 4, cfg.vocab_size)
  t = bench_generate.timings(model, cfg, params, prompts, new=3, rounds=2)
  for timing in t.values():
    assert timing.first_s > 0 and len(timing.runs_s) == len(timing.others) == 2
    assert all(0 <= share <= 1 for share in timing.others)
  median, lo, hi = bench_generate.rate(6, t["jaxsys"].runs_s)
  assert lo <= median <= hi and hi == pytest.approx(6 / min(t["jaxsys"].runs_s))


@needs_transformers
@pytest.mark.parametrize("arch, feature", [("qwen2", "qkv_bias"), ("qwen3", "qk_norm"),
                                           ("llama3", "rope_scaling")])
def test_newer_architectures_same_greedy_tokens(tmp_path, arch, feature):
  """The benchmark's Qwen2, Qwen3 and Llama 3.x models: imported with what sets them apart,
  and decoded to transformers' greedy tokens."""
  model, cfg, params = bench_generate.build("test", str(tmp_path), arch=arch)
  assert getattr(cfg, feature), cfg
  same = bench_generate.same_tokens(model, cfg, params, bench_generate.prompts(2, 8, cfg.vocab_size),
                                    new=8)
  assert same["rows_equal"] == 2, same
  assert same["max_logit_diff"] < 1e-4 * same["max_logit"], same
