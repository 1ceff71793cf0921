"""experiments/generate.py on a real run's checkpoint: samples float and quantized, bad input."""
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import forked_cli
from jaxsys.data import ByteTokenizer
from jaxsys.models import generate
from jaxsys.cli import quant_runs

pytestmark = pytest.mark.slow  # starts processes or trains end to end

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPTS = ("--prompt=def main(", "--prompt=import os", "--prompt=class ", "--prompt=#")


def _run(module, *flags):
  return subprocess.run([sys.executable, "-m", module, *flags], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)


def test_generate_from_a_trained_run(small_corpus, tmp_path, tmp_path_factory):
  train = _run("experiments.train", "--config=configs/tiny_lm.py:size=test",
               f"--config.data.source={small_corpus}", "--config.data.num_threads=0",
               f"--workdir={tmp_path}", "--config.total_steps=3", "--config.eval_every=0",
               "--config.checkpoint_every=0")
  assert train.returncode == 0, train.stderr[-3000:]

  # Three command lines of the binary, forked from one start-up of it (a child each,
  # tests/experiments/forked_cli.py: ~2 s of CPU less a command).
  (code, cached, err), (qcode, quantized, qerr), (bad_code, _, bad_err) = forked_cli.run(
      "experiments.generate", [
          # Greedy with the KV cache on a data=4,tensor=2 mesh.
          [f"--workdir={tmp_path}", *PROMPTS, "--max_new_tokens=12", "--mesh=data=4,tensor=2"],
          [f"--workdir={tmp_path}", *PROMPTS, "--max_new_tokens=12", "--quant=w4a16",
           "--group_size=32", "--temperature=0.8", "--top_k=20"],
          [f"--workdir={tmp_path}", *PROMPTS, "--max_len=8"],
      ], tmp_path_factory.mktemp("generate"))
  # The greedy run prints the library's continuation.
  assert code == 0, err[-3000:]
  # The library's greedy continuation of the same checkpoint, prompt by prompt.
  run = quant_runs.load_run(str(tmp_path))
  for i, prompt in enumerate(p.split("=", 1)[1] for p in PROMPTS):
    ids, n = generate.pad_prompts([list(prompt.encode())])
    out = generate.generate(run.config.model, run.params, ids, n, max_new_tokens=12)
    text = prompt + ByteTokenizer().decode(np.asarray(out.tokens[0]))
    assert f"--- sample {i}: 12 new tokens ---\n{text}\n" in cached
  assert "KV cache, batch 4: 48 tokens in" in cached
  # (--no_cache prints the same: generate.greedy_without_cache equals the cached decoder in
  # tests/models/test_generate.py; a process fewer here.)

  assert qcode == 0, qerr[-3000:]
  assert ", w4a16, KV cache, batch 4: 48 tokens" in quantized

  assert bad_code == 1
  assert sum(line.startswith("error:") for line in bad_err.splitlines()) == 1
  assert bad_err.strip().splitlines()[-1] == (
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


FIXTURE = ROOT / "tests" / "data" / "hf_fixture"


def test_generate_from_a_hugging_face_checkpoint(tmp_path_factory):
  """--hf samples an unmodified checkpoint: greedy, its prompts' continuations (given as
  flags or in a file) are the ones transformers' generate recorded in the fixture; --eos_id
  stops a row at that token."""
  expected = json.loads((FIXTURE / "expected.json").read_text())
  prompts = [f"--prompt={p['text']}" for p in expected["prompts"]]
  listed = tmp_path_factory.mktemp("prompts") / "prompts.txt"  # --prompts_file: one a line
  listed.write_text("\n\n".join(p["text"] for p in expected["prompts"]) + "\n")
  cases = [[f"--hf={FIXTURE / 'llama3'}", *prompts, "--max_new_tokens=8"],
           [f"--hf={FIXTURE / 'qwen3'}", f"--prompts_file={listed}", "--max_new_tokens=8"]]
  third = expected["models"]["llama3"][0]["ids"][2]
  cases += [[f"--hf={FIXTURE / 'llama3'}", prompts[0], "--max_new_tokens=8", f"--eos_id={third}"],
            [f"--hf={FIXTURE / 'llama3'}", f"--workdir={tmp_path_factory.mktemp('w')}",
             prompts[0]]]
  (code, llama3, err), (qcode, qwen3, qerr), (ecode, stopped, eerr), (bad_code, _, bad_err) = (
      forked_cli.run("experiments.generate", cases, tmp_path_factory.mktemp("generate_hf")))
  for kind, out, rc, stderr in (("llama3", llama3, code, err), ("qwen3", qwen3, qcode, qerr)):
    assert rc == 0, stderr[-3000:]
    for i, (prompt, gen) in enumerate(zip(expected["prompts"], expected["models"][kind])):
      assert f"--- sample {i}: 8 new tokens ---\n{prompt['text']}{gen['text']}\n" in out, kind
  assert ecode == 0, eerr[-3000:]
  first = expected["models"]["llama3"][0]
  n = first["ids"].index(third) + 1
  assert f"--- sample 0: {n} new tokens ---\n" in stopped
  assert bad_code == 1
  assert bad_err.strip().splitlines()[-1] == (
      "error: give exactly one of --workdir (a training run) and --hf (a Hugging Face "
      "checkpoint directory)")

