r"""SIGTERM at each moment of start-up and of a resume: the `--preemption` mode of
experiments/fault_injection.py.

  python -m experiments.fault_injection --workdir=/tmp/jaxsys_sigterm --preemption

Runs the train binary (`python -m experiments.train`, configs/tiny_lm.py:size=test, a
checkpoint every 2 steps, a fixed schedule) and SIGTERMs it at each row of `POINTS`, in
order, all in one workdir: first the start-up of a fresh run, then (after a run to step
2) the start-up of a resume. A row names the moment by a pause point of
`jaxsys.preemption` (the binary waits there when JAXSYS_TEST_PAUSE_AT names it, and says
so) or by a line the binary logs (then it may be anywhere after that line: before the
first step or at a step). Checked for each: exit status 75; its one line on stdout
("preempted before the first step", or "preempted at step N" once a step ran); no
traceback; the committed checkpoint's files byte for byte as before, and it verifies; the
lock released. At the end the run goes on to step 4, and its losses must equal those of a
run to step 4 without any SIGTERM exactly.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

from jaxsys import preemption  # no jax
from jaxsys.checkpoint import ledger  # files only: no jax

ROOT = pathlib.Path(__file__).resolve().parents[2]
MID, END = 2, 4  # the resumes start from step MID; every run ends at END


@dataclasses.dataclass(frozen=True)
class Point:
  phase: str  # "fresh" (nothing saved yet) or "resume" (step MID saved)
  pause_at: str = ""  # a jaxsys.preemption.pause_point name, or
  after_line: str = ""  # the signal comes once stderr has a line containing this

  @property
  def name(self) -> str:
    return f"{self.phase}: " + (self.pause_at or f"after the line {self.after_line!r}")


# One row per moment, in the order a run reaches them.
POINTS = [
    Point("fresh", pause_at="imports"),  # before jax is imported (after the huge-page re-exec)
    Point("fresh", pause_at="flags"),  # parsing --config and its overrides
    Point("fresh", after_line="config:"),  # logged after the config check: jax is up
    Point("fresh", pause_at="set_up"),  # the lock held, before the mesh, model and compiles
    Point("fresh", pause_at="first_step"),  # compiled, initialized, before step 1
    Point("resume", pause_at="set_up"),
    Point("resume", pause_at="restore"),  # step MID verified and its meta read, before its arrays
    Point("resume", after_line="resumed from"),  # restored: before step MID + 1 or at it
    Point("resume", pause_at="first_step"),
]


def command(workdir, source: str, steps: int) -> list[str]:
  return [sys.executable, "-m", "experiments.train", "--config=configs/tiny_lm.py:size=test",
          f"--config.data.source={source}", "--config.data.num_threads=0",
          f"--workdir={workdir}", f"--config.total_steps={steps}",
          "--config.checkpoint_every=2", "--config.optimizer.schedule_steps=16",
          "--config.optimizer.warmup_steps=1", "--config.log_every=1", "--config.eval_every=0"]


def _run(workdir, source: str, steps: int) -> subprocess.CompletedProcess:
  return subprocess.run(command(workdir, source, steps), cwd=ROOT, capture_output=True,
                        text=True, timeout=600)


def _files(directory: pathlib.Path) -> dict[str, bytes]:
  return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
          if p.is_file()}


def _preempt(point: Point, workdir, source: str) -> dict:
  """One row: the binary started, SIGTERMed at `point`; what it did."""
  env = dict(os.environ)
  if point.pause_at:
    env[preemption.TEST_PAUSE] = point.pause_at
  proc = subprocess.Popen(command(workdir, source, END), cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  wanted = f"paused at {point.pause_at}" if point.pause_at else point.after_line
  seen, start = [], time.monotonic()
  for line in proc.stderr:
    seen.append(line)
    if wanted in line:
      break
  reached = time.monotonic() - start
  if proc.poll() is None:
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    stdout, stderr = proc.communicate(timeout=300)
    took = time.monotonic() - signalled
  else:  # it ended before the moment came
    stdout, stderr = proc.communicate()
    took = None
  stderr = "".join(seen) + stderr
  return {"point": point.name, "exit": proc.returncode, "line": stdout.strip(),
          "traceback": "Traceback" in stderr, "reached_s": reached, "exit_s": took,
          "stderr_tail": stderr[-2000:]}


def _losses(workdir) -> list[tuple[int, float]]:
  path = pathlib.Path(workdir) / "metrics.jsonl"
  return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())
          if "loss" in r]


def _check(row: dict, point: Point, workdir: pathlib.Path, before: dict[str, bytes]) -> list[str]:
  out = []
  if row["exit_s"] is None:
    out.append(f"exited {row['exit']} before the moment came")
  if row["exit"] != preemption.EXIT_CODE:
    out.append(f"exit status {row['exit']}, not {preemption.EXIT_CODE}")
  at_step = row["line"].startswith("preempted at step ")
  if row["line"] != preemption.LINE and not (point.after_line and at_step):
    out.append(f"stdout {row['line']!r}, not the one line")
  if row["traceback"]:
    out.append("a traceback on stderr")
  if (workdir / "run.lock").exists():
    out.append("run.lock remains")
  ckpt = workdir / "checkpoints"
  if point.phase == "resume" or at_step:
    now = _files(ckpt / str(MID)) if (ckpt / str(MID)).is_dir() else {}
    if point.phase == "resume" and now != before:
      out.append(f"checkpoint step {MID}'s files changed")
    try:  # each step against its checksums and the ledger beside the steps
      entries = ledger.read(str(ckpt))
    except ledger.CorruptLedger as e:
      out.append(str(e))
      entries = None
    for step in sorted(n for n in os.listdir(ckpt) if n != ledger.NAME):
      problem = (ledger.problem(str(ckpt), int(step), entries) if step.isdigit()
                 else f"{step} left")
      if problem:
        out.append(f"checkpoint {step}: {problem}")
  elif ckpt.exists() and os.listdir(ckpt):
    out.append(f"checkpoints written before the first step: {os.listdir(ckpt)}")
  return out


def run(workdir: str, source: str) -> dict:
  """Every row of POINTS (see the module docstring); returns the rows and the problems."""
  root = pathlib.Path(workdir)
  reference, run_dir = root / "reference", root / "run"
  start = time.monotonic()
  problems = []
  ref = _run(reference, source, END)
  if ref.returncode:
    return {"rows": [], "problems": [f"the reference run exited {ref.returncode}: "
                                     f"{ref.stderr[-2000:]}"]}
  rows, before = [], {}
  for point in POINTS:
    if point.phase == "resume" and not before:  # the fresh rows done: train to step MID
      mid = _run(run_dir, source, MID)
      if mid.returncode:
        problems.append(f"the run to step {MID} exited {mid.returncode}: {mid.stderr[-2000:]}")
        break
      before = _files(run_dir / "checkpoints" / str(MID))
    row = _preempt(point, run_dir, source)
    row["problems"] = _check(row, point, run_dir, before)
    problems += [f"{point.name}: {p}" for p in row["problems"]]
    rows.append(row)
    if point.phase == "fresh" and row["line"].startswith("preempted at step "):
      shutil.rmtree(run_dir)  # it got to a step and saved it: the next fresh row starts afresh
    # (A resume row that got to a step saved it: the later ones resume from there, step
    # MID kept as it was.)
  final = _run(run_dir, source, END)
  if final.returncode:
    problems.append(f"the last run exited {final.returncode}: {final.stderr[-2000:]}")
  elif _losses(run_dir) != _losses(reference):
    problems.append(f"losses {_losses(run_dir)} differ from the uninterrupted run's "
                    f"{_losses(reference)}")
  return {"rows": rows, "problems": problems, "losses": _losses(reference),
          "seconds": time.monotonic() - start}


def summary(result: dict) -> str:
  rows = [f"{'SIGTERM at':<44} {'exit':>4} {'after (s)':>9}  line"]
  for r in result["rows"]:
    took = "-" if r["exit_s"] is None else f"{r['exit_s']:.2f}"
    rows.append(f"{r['point']:<44} {r['exit']:>4} {took:>9}  {r['line'][:60]}")
  rows += [f"FAIL: {p}" for p in result["problems"]] or [
      f"OK: exit {preemption.EXIT_CODE} with one line at all {len(result['rows'])} moments, the "
      f"checkpoint untouched; resumed to step {END} with the uninterrupted run's losses exactly"]
  return "\n".join(rows)
