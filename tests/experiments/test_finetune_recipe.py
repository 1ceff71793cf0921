"""The README's fine-tuning recipe end to end on the tiny Qwen3 of the committed fixture:
import it, fine-tune it on a JSONL corpus on data=2,fsdp=2,tensor=2, export it, sample it."""
import json
import pathlib
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest

from jaxsys.checkpoint import hf
from jaxsys.cli import quant_runs

pytestmark = pytest.mark.slow  # three processes, one of them training

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "data" / "hf_fixture" / "qwen3"


def _run(module, *flags):
  proc = subprocess.run([sys.executable, "-m", module, *flags], cwd=ROOT, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def test_import_fine_tune_export_sample(tmp_path):
  corpus = tmp_path / "sft"
  corpus.mkdir()
  lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) for i in range(3000)]
  (corpus / "part0.jsonl").write_text("\n".join(lines) + "\n")
  workdir, out = tmp_path / "ft", tmp_path / "ft_hf"
  _run("experiments.train", "--config=configs/tiny_lm.py:size=test",
       f"--config.init_from=hf:{SOURCE}", f"--config.data.source={corpus}/*.jsonl",
       "--config.mesh=data=2,fsdp=2,tensor=2", "--config.total_steps=4",
       "--config.optimizer.warmup_steps=1", "--config.eval_every=4", "--config.eval_steps=1",
       "--config.data.num_threads=0", f"--workdir={workdir}")
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) == 4 and losses[-1] < losses[0], losses  # it learns the corpus
  _run("experiments.hf_export", f"--workdir={workdir}", f"--out={out}")
  assert hf.read_config(str(out))["architectures"] == ["Qwen3ForCausalLM"]
  trained = quant_runs.load_run(str(workdir)).params
  _, exported = hf.load(str(out))
  chex.assert_trees_all_equal(jax.device_get(exported), jax.device_get(trained))
  _, before = hf.load(str(SOURCE))
  assert not np.allclose(exported["layers"]["wq"], before["layers"]["wq"])  # it was trained
  sample = _run("experiments.generate", f"--hf={out}", "--prompt=def f7(x):",
                "--max_new_tokens=8")
  assert "--- sample 0: " in sample and "Hugging Face), float, KV cache, batch 1" in sample
