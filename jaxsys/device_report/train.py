"""The runner's own train step on this device: tokens/s, MFU and memory for the GPT-2-sized
and Llama-3-1B presets of `configs/llama3.py`, with each attention implementation; and the
large bf16 matmul whose speed MFU is also quoted against."""
from __future__ import annotations

import gc
import time

import jax

from jaxsys import mesh as mesh_lib
from jaxsys import metrics
from jaxsys.configs import llama3
from jaxsys.data import packing
from jaxsys.device_report import timing
from jaxsys.device_report.budget import Budget
from jaxsys.device_report.section import Context, Section, error_line
from jaxsys.device_report.sizes import Sizes
from jaxsys.models import transformer
from jaxsys.train import config_check
from jaxsys.train.setup import make_setup

DOCS_PER_ROW = 4  # the random batch's packed documents a row


def matmul_run(ctx: Context, section: Section, budget: Budget) -> None:
  del budget  # one matmul: seconds
  n = ctx.sizes.matmul_n
  section.columns = ("matmul", "TFLOP/s", "% datasheet")
  ctx.matmul_flops = metrics.measure_matmul_flops("bfloat16", n=n, repeats=ctx.sizes.repeats)
  section.add(matmul=f"bf16 {n} x {n} x {n}", **{"TFLOP/s": ctx.matmul_flops / 1e12},
              **({"% datasheet": 100 * ctx.matmul_flops / ctx.sheet.bf16_flops}
                 if ctx.sheet else {}))
  section.note("the fastest of the timed calls: the strongest matmul this device showed, "
               "the train step's second MFU denominator")


def preset_config(preset: str, batch: int, attention_impl: str, sizes: Sizes):
  """configs/llama3.py's `preset` with the report's batch, attention and (smoke) shape."""
  c = llama3.get_config(f"size={preset}")
  c.model.update(dict(sizes.model, attention_impl=attention_impl))
  if sizes.seq_len:
    c.data.update(dict(seq_len=sizes.seq_len, max_len=4 * sizes.seq_len))
  c.data.batch_size = batch
  return c


def _compiled_peak_bytes(compiled) -> int | None:
  m = compiled.memory_analysis()
  if m is None:
    return None
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)


def measure_step(config, steps: int) -> dict:
  """Compiles the runner's train step for `config` as `jaxsys.train.loop` does and times
  `steps` steps on a random packed batch (after one untimed step)."""
  run = config_check.check_config(config)
  cfg, b, t = run.model, run.data.batch_size, run.data.seq_len
  setup = make_setup(run, mesh_lib.make_mesh(run.mesh))
  state = setup.init_state(config.seed)
  host = packing.random_packed_batch(b, t, docs_per_row=DOCS_PER_ROW,
                                     vocab_size=cfg.vocab_size, seed=config.seed)
  batch = jax.device_put(host, setup.batch_sh)
  t0 = time.perf_counter()
  compiled = setup.train_fn.lower(state, batch).compile()
  compile_s = time.perf_counter() - t0
  holder = {"state": state}

  def step():
    holder["state"], m = compiled(holder["state"], batch)
    return m

  timed = timing.time_calls({"step": timing.blocking(step)}, steps)["step"]
  loss = float(step()["loss"])
  tokens = b * t
  return {"params_m": transformer.param_count(cfg) / 1e6, "batch": b, "seq_len": t,
          "compile_s": compile_s, "step_ms": timed.median * 1e3, "spread": timed.spread,
          "tokens_per_s": tokens / timed.median,
          "model_flops_per_s": transformer.train_flops_per_token(cfg, t) * tokens / timed.median,
          "peak_bytes": _compiled_peak_bytes(compiled), "loss": loss, "remat": cfg.remat}


def run(ctx: Context, section: Section, budget: Budget) -> None:
  s = ctx.sizes
  section.columns = ("preset", "attention", "params M", "B x T", "step ms", "tokens/s",
                     "MFU %", "MFU % of matmul", "peak GiB", "compile s")
  section.note("the step `experiments.train` runs (same jit, shardings, donation, remat as "
               "the preset says) on a random batch of packed documents; model FLOPs count "
               "6 x params a token plus attention over the full T x T square (PaLM); "
               "'MFU %' is against the datasheet's dense bf16 peak, 'MFU % of matmul' "
               "against the measured bf16 matmul above; peak GiB is the compiled step's "
               f"arguments + outputs + temporaries; median of {s.train_steps} steps")
  for preset, batch in s.train_presets:
    for impl in s.attention_impls:
      if budget.expired():
        section.stop_early(f"budget spent before {preset} with attention {impl}")
        return
      config = preset_config(preset, batch, impl, s)
      try:
        r = measure_step(config, s.train_steps)
      except Exception as e:  # pylint: disable=broad-except
        section.add(preset=preset, attention=impl, status=f"n/a: {error_line(e)}")
        section.fail(f"{preset}, attention {impl}: {error_line(e)}")
        continue
      finally:
        gc.collect()  # the last case's state and buffers, before the next allocates
      flops = r.pop("model_flops_per_s")
      section.add(preset=preset, attention=impl, **{
          "params M": r["params_m"], "B x T": f"{r['batch']} x {r['seq_len']}",
          "step ms": r["step_ms"], "tokens/s": r["tokens_per_s"],
          "MFU %": 100 * flops / ctx.sheet.bf16_flops if ctx.sheet else None,
          "MFU % of matmul": 100 * flops / ctx.matmul_flops if ctx.matmul_flops else None,
          "peak GiB": r["peak_bytes"] / 2 ** 30 if r["peak_bytes"] else None,
          "compile s": r["compile_s"]}, model_flops_per_s=flops, **r, status="ok")
