r"""jaxsys's Hugging Face import and export against transformers' own LlamaForCausalLM.

  python -m experiments.hf_check --out=/tmp/hf_check

For each model (random weights of unit-scale activations, norm scales in [0.5, 1.5]):
save_pretrained (sharded), import (jaxsys/checkpoint/hf.py) and compare the logits
with transformers' forward in float32, and in bfloat16 (params and compute); export the
imported model and compare the logits transformers computes from it; re-import the export
and compare the parameters. Needs torch and transformers (the `hf` extra: pip install -e '.[hf]').
"""
import dataclasses
import os
import re

import jax
import numpy as np
from absl import app, flags

from jaxsys.checkpoint import hf
from jaxsys.cli import hf_runs
from jaxsys.models import transformer

_OUT = flags.DEFINE_string("out", "/tmp/hf_check", "Directory for the checkpoints written.")

# name: hidden, layers, heads, kv heads, head dim, intermediate, vocab, tied
MODELS = {
    "tiny (test size)": (64, 2, 4, 2, None, 96, 256, False),
    "tiny tied, head_dim 8": (64, 2, 4, 2, 8, 96, 320, True),
    "small": (512, 8, 8, 2, None, 1408, 8192, False),
}


def check(name: str, spec, out: str, tokens: np.ndarray) -> dict:
  """One model's row: max |diff| of the logits (and relative to max |logit|)."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  d, layers, heads, kv, head_dim, ff, vocab, tied = spec
  config = transformers.LlamaConfig(
      vocab_size=vocab, hidden_size=d, intermediate_size=ff, num_hidden_layers=layers,
      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim or d // heads,
      rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied)
  model = hf_runs.randomize_torch_llama(transformers.LlamaForCausalLM(config), seed=0).eval()
  src = os.path.join(out, re.sub(r"\W+", "_", name).strip("_"), "src")
  model.save_pretrained(src, max_shard_size="2MB")
  with torch.no_grad():
    want = model(torch.tensor(tokens % vocab)).logits.numpy()
  scale = np.abs(want).max()
  cfg, params = hf.load(src)
  got = np.asarray(transformer.apply(cfg, params, tokens % vocab))
  bf16 = dataclasses.replace(cfg, dtype="bfloat16", param_dtype="bfloat16")
  _, params_bf16 = hf.load(src, bf16)
  got_bf16 = np.asarray(transformer.apply(bf16, params_bf16, tokens % vocab))
  dst = os.path.join(os.path.dirname(src), "export")
  hf.save(dst, cfg, params, max_shard_bytes=2 * 2**20)
  exported = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
  with torch.no_grad():
    back = exported(torch.tensor(tokens % vocab)).logits.numpy()
  _, again = hf.load(dst)
  same = all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b))
                                                            .all()), params, again)))
  err = lambda a, b: float(np.abs(a - b).max())
  return {"model": name, "params": transformer.param_count(cfg), "max |logit|": float(scale),
          "import f32": err(got, want), "import bf16": err(got_bf16, want),
          "export f32": err(back, got), "re-import exact": same}


def main(argv):
  del argv
  import transformers  # pylint: disable=import-outside-toplevel
  tokens = np.random.RandomState(0).randint(0, 1 << 30, (2, 64))
  rows = [check(name, spec, _OUT.value, tokens) for name, spec in MODELS.items()]
  print(f"transformers {transformers.__version__}, jax {jax.__version__}; logits of 2 x 64 "
        "tokens, max |diff| (relative to max |logit|)\n")
  print("| model | params | import f32 | import bf16 | export f32 | re-import |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    rel = lambda k: f"{r[k]:.1e} ({r[k] / r['max |logit|']:.1e})"
    print(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {rel('import f32')} | "
          f"{rel('import bf16')} | {rel('export f32')} | "
          f"{'exact' if r['re-import exact'] else 'DIFFERS'} |")


if __name__ == "__main__":
  app.run(main)
