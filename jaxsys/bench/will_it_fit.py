"""Will it fit: real model sizes compiled for TPU slices and GPUs, a row a process.

Each row is one `jaxsys.cli.compile` run in its own process (a compiler that aborts ends
that process, not the table; a row over its time limit is reported as such) with `--json`,
so a table holds exactly what the compile command reports: per-chip memory of the train
step against HBM, compiled FLOPs over 6N + causal attention, the step's roofline lower
bound and its recompute bound (model / compiled FLOPs). `search_rows` enumerates the fsdp x tensor x stage meshes a model can take on a slice.
The binary is `experiments/will_it_fit.py`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time

from jaxsys import chips
from jaxsys.configs import llama3

@dataclasses.dataclass(frozen=True)
class Row:
  label: str
  size: str
  topology: str
  overrides: tuple[str, ...]

  def args(self) -> list[str]:
    return [f"--config=llama3:size={self.size}", f"--topology={self.topology}",
            *(f"--config.{o}" for o in self.overrides)]


PIPELINE = ("pipeline.schedule=1f1b", "pipeline.vocab_parallel=true", "pipeline.microbatches=8")
ROWS = (
    Row("8B, FSDP", "8b", "v5p-128", ("mesh=fsdp=64", "model.remat=full")),
    Row("8B, FSDP, remat off, 2 accumulation steps", "8b", "v5p-128",
        ("mesh=fsdp=64", "model.remat=none", "optimizer.grad_accum_steps=2")),
    Row("8B, 1F1B pipeline + VP, gathered once", "8b", "v5p-128",
        ("mesh=stage=4,fsdp=16", "model.remat=full", *PIPELINE, "pipeline.gather_once=true")),
    Row("8B, ring attention at 128k tokens", "8b", "v5p-128",
        ("mesh=fsdp=4,context=16", "model.remat=full", "data.seq_len=131072",
         "data.batch_size=8", "data.max_len=131072")),
    Row("8B, DiLoCo replicas", "8b", "v5p-128",
        ("mesh=replica=2,fsdp=32", "model.remat=full", "outer.name=diloco")),
    Row("8B, FSDP", "8b", "v6e-256", ("mesh=fsdp=256", "model.remat=full",
                                      "data.batch_size=256")),
    Row("70B, FSDP", "70b", "v5p-256", ("mesh=fsdp=128", "model.remat=full")),
    Row("70B, FSDP", "70b", "v6e-256", ("mesh=fsdp=256", "model.remat=full",
                                        "data.batch_size=256")),
    Row("70B, FSDP x tensor", "70b", "v6e-256", ("mesh=fsdp=128,tensor=2", "model.remat=full",
                                                 "data.batch_size=256")),
    Row("1B, FSDP", "1b", "v5e-16", ("mesh=fsdp=16", "model.remat=full")),
    Row("1B, FSDP", "1b", "v5e-64", ("mesh=fsdp=64", "model.remat=full")),
)


def compile_row(row: Row, timeout: int) -> dict:
  """The compile command's JSON for `row`, or {"failed": why} in one line."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "report.json")
    start = time.perf_counter()
    try:
      done = subprocess.run([sys.executable, "-m", "jaxsys.cli.compile", *row.args(),
                             f"--json={out}"], capture_output=True, text=True, timeout=timeout,
                            check=False)
    except subprocess.TimeoutExpired:
      return {"failed": f"not compiled within {timeout} s"}
    if done.returncode == 0 and os.path.exists(out):
      with open(out, encoding="utf-8") as f:
        return json.load(f)
    return {"failed": _why(done.stderr + done.stdout, done.returncode),
            "seconds": time.perf_counter() - start}


def _why(log: str, code: int) -> str:
  """One line for a compile that failed: its `error:` line, the compiler's failed check, or
  the exit code."""
  lines = [l.strip() for l in log.splitlines() if l.strip()]
  ours = [l for l in lines if l.startswith("error:")]  # the config check's refusal
  for found in (ours, *([l for l in lines if marker in l] for marker in (
      "Check failed", "RESOURCE_EXHAUSTED", "Fatal Python error"))):
    if found:
      return found[0][:300]
  return f"exit code {code}: {lines[-1][:200] if lines else 'no output'}"


def _gib(n: float) -> str:
  return f"{n / 2 ** 30:.2f}"


def cells(row: Row, report: dict) -> list[str]:
  """The table's cells of one compiled row."""
  layout = ", ".join(row.overrides).replace("mesh=", "")
  if "failed" in report:
    return [row.label, row.topology, f"`{layout}`", f"failed: {report['failed']}", "-", "-", "-",
            "-"]
  train = next(iter(report["programs"].values()))
  if "peak_bytes" in train:
    fits = "fits" if train["fits"] else "DOES NOT FIT"
    memory = f"{_gib(train['peak_bytes'])} of {_gib(train['hbm_bytes'])} GiB ({fits})"
  else:
    memory = (f"needs {_gib(train['needed_bytes'])} GiB of temporaries, "
              f"{_gib(train['needed_bytes'] - train['hbm_bytes'])} over")
  ok = train.get("fits") and "recompute_bound" in report
  at_least = ">= " if train.get("unknown_loops") else ""  # loops counted once
  return [row.label, row.topology, f"`{layout}`", memory,
          f"{at_least}{report['flops_over_model']:.3f}" if ok else "-",
          f"{report['step_seconds']:.3g} s" if ok else "-",
          f"{report['recompute_bound']:.1%}" if ok and not at_least else "-",
          f"{report.get('compile_seconds', 0):.0f} s"]


HEADER = ["model", "slice", "layout", "train step memory per chip", "compiled FLOPs / model",
          "step >= (roofline)", "recompute bound", "compile"]


def markdown(rows: list[Row], reports: list[dict]) -> str:
  lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
  lines += ["| " + " | ".join(cells(r, rep)) + " |" for r, rep in zip(rows, reports)]
  return "\n".join(lines)


def search_rows(size: str, topology: str, extra: tuple[str, ...]) -> list[Row]:
  """fsdp x tensor x stage meshes of the slice's devices (tensor up to the KV heads, stages
  dividing the layers), each a row."""
  _, layers, _, kv, *_ = llama3.SIZES[size]
  _, shape = chips.parse(topology)
  devices = math.prod(int(n) for n in shape.split("x"))  # one jax device per chip
  rows = []
  for tensor in (1, 2, 4, 8):
    for stage in (1, 2, 4, 8):
      if devices % (tensor * stage) or kv % tensor or layers % stage:
        continue
      fsdp = devices // (tensor * stage)
      mesh = ",".join(f"{a}={n}" for a, n in (("stage", stage), ("fsdp", fsdp),
                                             ("tensor", tensor)) if n > 1)
      pipe = PIPELINE if stage > 1 else ()
      if stage > 1 and fsdp > 1:  # gathered once a step: per-tick gathers abort libtpu
        pipe += ("pipeline.gather_once=true",)
      rows.append(Row(f"{size.upper()}, {mesh}", size, topology, (f"mesh={mesh}", *extra,
                                                                   *pipe)))
  return rows



def ranked(rows: list[Row], reports: list[dict]) -> tuple[list[Row], list[dict]]:
  """Rows that fit, the fastest lower bound first, then the rest."""
  def key(pair):
    train = next(iter(pair[1].get("programs", {}).values()), {})
    return (not train.get("fits", False), pair[1].get("step_seconds", math.inf))
  pairs = sorted(zip(rows, reports), key=key)
  return [r for r, _ in pairs], [rep for _, rep in pairs]
