"""Runs and Hugging Face checkpoints: a run's checkpoint exported as one, one loaded as the
run PTQ quantizes (the library side of experiments/hf_export.py and quant_eval.py).

Example::

  export_run("/tmp/jaxsys_tiny", "/tmp/tiny_hf", quantize="w4a16")
  run = ptq_run(tiny_lm.get_config(), "hf:/ckpt/SmolLM-135M")  # -> quant_runs.evaluate_table
"""
from __future__ import annotations

import os

import jax

from jaxsys.checkpoint import hf
from jaxsys.checkpoint.reader import checkpoints_dir, read_params
from jaxsys.data import tokenizer as tokenizer_lib
from jaxsys.models import transformer
from jaxsys.cli import quant_runs
from jaxsys.quant import ptq
from jaxsys.quant import rules as rules_lib
from jaxsys.train import config_check


def export_run(workdir: str, out: str, *, step: int | None = None, quantize: str = "none",
               group_size: int = 128, dtype: str | None = None,
               max_shard_bytes: int | None = None) -> list[str]:
  """Writes the latest (or `step`) checkpoint of `workdir` (replica 0's for a replica run) as
  a Hugging Face Llama checkpoint in `out` with the run's tokenizer (byte, its cached BPE or
  its hf one); `quantize` (a scheme) RTN-quantizes the layer matmuls first and writes them
  dequantized. Returns the files written."""
  saved = read_params(checkpoints_dir(workdir), step)
  if saved is None:
    raise ValueError(f"--workdir={workdir}: no checkpoint; pass the --workdir of a training run")
  run = config_check.parse(saved.meta["config"])
  data = run.data
  tok = tokenizer_lib.make_tokenizer(
      data.tokenizer, **({} if data.tokenizer != "bpe" else dict(
          vocab_size=data.vocab_size, cache_path=os.path.join(workdir, "tokenizer.json"))))
  params = saved.one()
  if quantize != "none":
    params = ptq.quantize_params(run.model, params,
                                 rules_lib.default_rules(quantize, group_size=group_size))
  return hf.save(out, run.model, params, tok, dtype=dtype, max_shard_bytes=max_shard_bytes,
                 max_position_embeddings=context_length(run))


def context_length(run) -> int:
  """The exported max_position_embeddings (serving engines size their context from it): the
  source checkpoint's for a run started from one (init_from='hf:<dir>', where it still is),
  else the run's data.seq_len, at least the rope scaling's original context."""
  source = hf.parse_spec(run.init_from)
  if source and os.path.isfile(os.path.join(source, "config.json")):
    value = hf.read_config(source).get("max_position_embeddings")
    if value:
      return int(value)
  _, scaling = transformer.parse_rope_scaling(run.model.rope_scaling)
  return max(run.data.seq_len, int(scaling.get("original_max_position_embeddings", 0)))


def ptq_run(config, spec: str) -> quant_runs.Run:
  """The `quant_runs.Run` of a Hugging Face checkpoint: `config` (a training config) with
  init_from=`spec` ('hf:<dir>', so the model and tokenizer are the checkpoint's), step 0."""
  if hf.parse_spec(spec) is None:
    raise ValueError(f"--init_from={spec!r} is invalid; it must be 'hf:<dir>' (a Hugging Face "
                     "Llama checkpoint directory)")
  config = config.copy_and_resolve_references()
  config.init_from = spec
  run = config_check.check_config(config)
  _, params = hf.load(hf.parse_spec(spec), run.model)
  return quant_runs.Run(run, jax.device_get(params), 0)


def randomize_torch_llama(model, seed: int):
  """A transformers Llama with random weights of unit-scale activations and norm scales
  drawn from [0.5, 1.5], so a swapped or mis-laid tensor shows in the logits (HF's 0.02 init
  and unit norms would hide it). Needs torch (the `hf` extra)."""
  import torch  # pylint: disable=import-outside-toplevel
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(0.5 + torch.rand(p.shape, generator=gen))
      else:
        p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
  return model
