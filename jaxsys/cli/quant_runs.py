"""The PTQ accuracy table: a run's checkpoint, quantized every way, scored on held-out data.

`load_run(workdir)` reads the latest checkpoint's parameters (`checkpoint.reader`, config
from its meta, as `train.loop` saves it); `evaluate_table(...)` quantizes them with each
(scheme, method) and with qwix, and scores every row with `train.loop.Validation`: the
val batches, eval step and batch count of the run's own evals.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

from jaxsys import mesh as mesh_lib
from jaxsys import stats
from jaxsys.checkpoint.reader import read_params
from jaxsys.config import RunConfig
from jaxsys.data.loader import make_loader
from jaxsys.models import transformer
from jaxsys.quant import ptq, qwix_baseline
from jaxsys.quant import rules as rules_lib
from jaxsys.train import config_check, loop
from jaxsys.train import step as step_lib

# (scheme, method, options) rows after the float baseline; "qwix" rows use qwix's PTQ.
DEFAULT_ROWS = (
    ("w8a8_fp8", "rtn", {}), ("w8a8_fp8", "smoothquant", {}), ("w8a8_fp8", "gptq", {}),
    ("w8a8_fp8", "qwix", {}),
    ("w8a8_int8", "rtn", {}), ("w8a8_int8", "smoothquant", {}), ("w8a8_int8", "gptq", {}),
    ("w8a8_int8", "qwix", {}),
    ("w4a16", "rtn", {}), ("w4a16", "gptq", {}), ("w4a16", "gptq", {"act_order": True}),
    ("w4a16", "qwix", {}),
)


def parse_rows(spec: str) -> tuple:
  """"w4a16:gptq,w4a16:gptq+act_order,w8a8_int8:qwix" -> rows like DEFAULT_ROWS."""
  rows = []
  for item in filter(None, spec.split(",")):
    scheme, _, method = item.partition(":")
    method, *flags = method.split("+")
    if scheme not in qwix_baseline.SCHEMES or method not in (*ptq.METHODS, "qwix") or \
        set(flags) - {"act_order"}:
      raise ValueError(f"--rows item {item!r}: want scheme:method[+act_order] with scheme in "
                       f"{sorted(qwix_baseline.SCHEMES)}, method in {[*ptq.METHODS, 'qwix']}")
    rows.append((scheme, method, {f: True for f in flags}))
  return tuple(rows)


@dataclasses.dataclass
class Run:
  """What a checkpoint holds: its config, model config, float parameters (numpy) and step."""
  config: RunConfig  # the training run's, as its checkpoint recorded it
  params: dict[str, Any]
  step: int


def load_run(workdir: str, step: int | None = None) -> Run:
  """Parameters of the latest (or `step`) checkpoint in `workdir`/checkpoints (replica 0's
  for a replica run)."""
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  if not os.path.isdir(directory):
    raise ValueError(f"--workdir={workdir}: no checkpoints directory {directory}; "
                     "pass the --workdir of a training run")
  saved = read_params(directory, step)
  if saved is None:
    raise ValueError(f"{directory}: no checkpoint; pass the --workdir of a training run")
  return Run(config_check.parse(saved.meta["config"]), saved.one(), saved.step)


def qwix_eval_step(graphdef, state, batch, *, token_bytes) -> dict[str, jax.Array]:
  """`train.step.eval_step`'s sums for a qwix model (its logits come from the NNX module)."""
  logits = nnx.merge(graphdef, state)(batch["inputs"], batch["positions"], batch["segment_ids"])
  return step_lib.eval_sums(logits, batch, token_bytes)


def _bf16_bytes(params) -> int:
  return sum(2 * math.prod(params["layers"][n].shape) for n in transformer.LAYER_MATMULS)


def evaluate_table(run: Run, workdir: str, *, rows=DEFAULT_ROWS, calib_batches: int = 8,
                   group_size: int = 128, alpha: float = 0.5, eval_steps: int | None = None
                   ) -> list[dict[str, Any]]:
  """The float row, then one row per (scheme, method, options); see the module docstring.
  Each row is scored on the same `eval_steps` val batches (default: the run's), and its
  bits per byte is set against the float model's by a paired bootstrap over them."""
  config, cfg = run.config, run.config.model
  train = make_loader(config.data, "train", batch_size=config.data.batch_size, seed=config.seed,
                      workdir=workdir)  # calibration batches and the tokenizer
  # The parameters replicated, the batch split over every device: any training mesh.
  val = loop.Validation(config, mesh_lib.make_mesh("data=-1"), tokenizer=train.tokenizer,
                        workdir=workdir)
  calib = [next(train) for _ in range(calib_batches)]  # the TRAIN split, never val
  bf16 = _bf16_bytes(run.params)

  def row(scheme, method, options, batches, nbytes, seconds, error=None):
    losses = [b["loss_sum"] for b in batches or ()]
    bpb = sum(losses) / math.log(2) / sum(b["bytes"] for b in batches) if batches else None
    return {"scheme": scheme, "method": method, "options": options,
            "weight_bytes": nbytes, "x_bf16": None if nbytes is None else nbytes / bf16,
            "val_bpb": bpb, "recovery_pct": None, "quantize_s": seconds, "error": error,
            "batch_loss_sums": losses}

  float_batches = val.score_batches(run.params, eval_steps)
  batch_bytes = [b["bytes"] for b in float_batches]
  out = [dict(row("float", "-", {}, float_batches, ptq.weight_bytes(run.params), 0.0),
              batch_bytes=batch_bytes)]  # every row's bits per byte divides by these
  tokens_1T = jnp.asarray(calib[0]["inputs"][:1])
  for scheme, method, options in rows:
    rule_set = rules_lib.default_rules(scheme, group_size=group_size)
    t0 = time.perf_counter()
    try:
      if method == "qwix":
        model = qwix_baseline.quantize(cfg, run.params, scheme, tokens_1T, group_size=group_size)
        seconds = time.perf_counter() - t0
        graphdef, state = nnx.split(model)
        table = jnp.asarray(val.token_bytes, jnp.float32)
        eval_fn = jax.jit(lambda s, b: qwix_eval_step(graphdef, s, b, token_bytes=table))
        batches = val.batch_sums(eval_fn, state, eval_steps)
        nbytes = qwix_baseline.weight_bytes(model)
      else:
        q = ptq.quantize_params(cfg, run.params, rule_set, method, calib, alpha=alpha, **options)
        q = jax.block_until_ready(q)
        seconds = time.perf_counter() - t0
        batches, nbytes = val.score_batches(q, eval_steps), ptq.weight_bytes(q)
      out.append(row(scheme, method, options, batches, nbytes, seconds))
    except Exception as e:  # a baseline that cannot run shows its reason, not nothing
      logging.exception("%s %s failed", scheme, method)
      msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
      out.append(row(scheme, method, options, None, None, time.perf_counter() - t0,
                     f"{type(e).__name__}: {msg}"))
    logging.info("quant row: %s", out[-1])
  bits = lambda r: [x / math.log(2) for x in r["batch_loss_sums"]]
  qwix = {r["scheme"]: r for r in out if r["method"] == "qwix" and r["val_bpb"] is not None}
  for r in out:
    if r["val_bpb"] is not None:
      r["recovery_pct"] = 100.0 * out[0]["val_bpb"] / r["val_bpb"]
      r["vs_float_bpb"] = dataclasses.asdict(
          stats.paired_bootstrap_ratio(bits(r), bits(out[0]), batch_bytes))
      if r["method"] == "rtn" and r["scheme"] in qwix:  # qwix's PTQ rounds to nearest too
        r["vs_qwix_bpb"] = dataclasses.asdict(
            stats.paired_bootstrap_ratio(bits(r), bits(qwix[r["scheme"]]), batch_bytes))
  return out


def _label(r) -> str:
  opts = ", ".join(f"{k}={v}" for k, v in r["options"].items())
  return r["method"] + (f" ({opts})" if opts else "")


def markdown(rows: list[dict[str, Any]]) -> str:
  """The table in markdown: scheme, method, bytes, ratio to bf16, val bpb, its difference
  from the float model's with the paired bootstrap's 95% interval, recovery."""
  lines = ["| scheme | method | weight bytes (layer matmuls) | x bf16 | val bpb | "
           "- float bpb [95% interval] | recovery |", "|---|---|---:|---:|---:|---|---:|"]
  for r in rows:
    if r["error"]:
      lines.append(f"| {r['scheme']} | {_label(r)} | | | error: {r['error']} | | |")
      continue
    gap = "" if r is rows[0] else stats.Interval(**r["vs_float_bpb"]).format("+.5f")
    lines.append(f"| {r['scheme']} | {_label(r)} | {r['weight_bytes']:,} | {r['x_bf16']:.3f} | "
                 f"{r['val_bpb']:.5f} | {gap} | {r['recovery_pct']:.3f}% |")
  return "\n".join(lines)
