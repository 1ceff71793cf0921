"""Decoding speed with the KV cache: the 1B preset at batch 1 and 32, float (bf16 weights)
and quantized (round-to-nearest W8A8 / W4A16 layer matmuls)."""
from __future__ import annotations

import dataclasses
import gc

import jax
import jax.numpy as jnp

from jaxsys.device_report import timing, train
from jaxsys.device_report.budget import Budget
from jaxsys.device_report.section import Context, Section, error_line
from jaxsys.models import generate, transformer
from jaxsys.quant import ptq, rules


def model(ctx: Context) -> tuple[transformer.TransformerConfig, dict]:
  """The preset's model config and random parameters, stored in bf16."""
  c = train.preset_config(ctx.sizes.generate_preset, 1, "auto", ctx.sizes)
  cfg = dataclasses.replace(transformer.TransformerConfig.from_config(c.model),
                            param_dtype="bfloat16")
  return cfg, transformer.init_params(cfg, jax.random.key(0))


def run(ctx: Context, section: Section, budget: Budget) -> None:
  s = ctx.sizes
  section.columns = ("weights", "batch", "tokens/s", "ms a step", "weight GiB", "weight GB/s",
                     "% HBM peak", "x float")
  section.note(f"`models.generate` with the KV cache, preset {s.generate_preset}: a "
               f"{s.prompt_len}-token prompt a row, then {s.new_tokens} greedy tokens (no "
               "EOS); tokens/s counts the new tokens of all rows over the whole call, "
               "prefill included; 'weight GB/s' is the layer and output weights read "
               f"once a step; median of {max(2, s.repeats // 2)} calls after one")
  cfg, params = model(ctx)
  base: dict[int, float] = {}
  for scheme in s.generate_schemes:
    if budget.expired():
      section.stop_early(f"budget spent before the {scheme} weights")
      return
    try:
      weights = params if scheme == "float" else ptq.quantize_params(
          cfg, params, rules.default_rules(scheme))
    except Exception as e:  # pylint: disable=broad-except
      section.fail(f"{scheme}: quantizing failed: {error_line(e)}")
      continue
    paths = rules.quantizable_paths(params)
    weight_bytes = ptq.weight_bytes(weights, paths)
    for b in s.generate_batches:
      if budget.expired():
        section.stop_early(f"budget spent before {scheme} at batch {b}")
        return
      prompts = jax.random.randint(jax.random.key(b), (b, s.prompt_len), 0, cfg.vocab_size,
                                   jnp.int32)
      lengths = jnp.full((b,), s.prompt_len, jnp.int32)
      call = timing.blocking(lambda p, l: generate.generate(
          cfg, weights, p, l, max_new_tokens=s.new_tokens, eos_id=None), prompts, lengths)
      try:
        sec = timing.time_calls({"gen": call}, max(2, s.repeats // 2))["gen"].median
      except Exception as e:  # pylint: disable=broad-except
        section.add(weights=scheme, batch=b, status=f"n/a: {error_line(e)}")
        section.fail(f"{scheme} at batch {b}: {error_line(e)}")
        continue
      tokens_s = b * s.new_tokens / sec
      if scheme == "float":
        base[b] = tokens_s
      row = section.add(weights=scheme, batch=b, **{
          "tokens/s": tokens_s, "ms a step": 1e3 * sec / s.new_tokens,
          "weight GiB": weight_bytes / 2 ** 30,
          "weight GB/s": weight_bytes * s.new_tokens / sec / 1e9,
          "x float": tokens_s / base[b] if b in base else None}, status="ok")
      if ctx.sheet:
        row["% HBM peak"] = 100 * row["weight GB/s"] * 1e9 / ctx.sheet.hbm_bytes_per_s
    del weights
    gc.collect()
