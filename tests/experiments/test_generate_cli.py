"""experiments/generate.py on a real run's checkpoint: samples float and quantized, bad input."""
import pathlib
import subprocess
import sys

import numpy as np

from jaxsys.data import ByteTokenizer
from jaxsys.models import generate
from jaxsys.quant import evaluate

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPTS = ("--prompt=def main(", "--prompt=import os", "--prompt=class ", "--prompt=#")


def _run(module, *flags):
  return subprocess.run([sys.executable, "-m", module, *flags], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)


def test_generate_from_a_trained_run(small_corpus, tmp_path):
  train = _run("experiments.train", "--config=configs/tiny_lm.py:size=test",
               f"--config.data.source={small_corpus}", "--config.data.num_threads=0",
               f"--workdir={tmp_path}", "--config.total_steps=3", "--config.eval_every=0",
               "--config.checkpoint_every=0")
  assert train.returncode == 0, train.stderr[-3000:]

  # Greedy with the KV cache on a data=4,tensor=2 mesh prints the library's continuation.
  cached = _run("experiments.generate", f"--workdir={tmp_path}", *PROMPTS, "--max_new_tokens=12",
                "--mesh=data=4,tensor=2")
  assert cached.returncode == 0, cached.stderr[-3000:]
  # The library's greedy continuation of the same checkpoint, prompt by prompt.
  run = evaluate.load_run(str(tmp_path))
  for i, prompt in enumerate(p.split("=", 1)[1] for p in PROMPTS):
    ids, n = generate.pad_prompts([list(prompt.encode())])
    out = generate.generate(run.config.model, run.params, ids, n, max_new_tokens=12)
    text = prompt + ByteTokenizer().decode(np.asarray(out.tokens[0]))
    assert f"--- sample {i}: 12 new tokens ---\n{text}\n" in cached.stdout
  assert "KV cache, batch 4: 48 tokens in" in cached.stdout
  # (--no_cache prints the same: generate.greedy_without_cache equals the cached decoder in
  # tests/models/test_generate.py; a process fewer here.)

  quantized = _run("experiments.generate", f"--workdir={tmp_path}", *PROMPTS,
                   "--max_new_tokens=12", "--quant=w4a16", "--group_size=32", "--temperature=0.8",
                   "--top_k=20")
  assert quantized.returncode == 0, quantized.stderr[-3000:]
  assert ", w4a16, KV cache, batch 4: 48 tokens" in quantized.stdout

  bad = _run("experiments.generate", f"--workdir={tmp_path}", *PROMPTS, "--max_len=8")
  assert bad.returncode == 1
  assert sum(line.startswith("error:") for line in bad.stderr.splitlines()) == 1
  assert bad.stderr.strip().splitlines()[-1] == (
      "error: generate: the prompt (9 tokens, the longest row's padded width) + "
      "max_new_tokens=64 = 73 does not fit max_len=8 (the KV cache's length); use max_len >= 73, "
      "or a shorter prompt or fewer new tokens")


def test_bad_flag_is_one_line_before_loading(tmp_path):
  proc = _run("experiments.generate", f"--workdir={tmp_path}", "--prompt=x", "--top_p=0")
  assert proc.returncode == 1
  # The last line, and the only error line (jax plugins may log before it).
  assert proc.stderr.strip().splitlines()[-1] == \
      "error: --top_p=0.0 must be a number in (0, 1] (1: off)"
  assert sum(line.startswith("error:") for line in proc.stderr.splitlines()) == 1
