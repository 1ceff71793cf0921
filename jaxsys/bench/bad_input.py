r"""Bad input a user can give the train binary, one row each: the `--bad_input` mode of
experiments/fault_injection.py.

  python -m experiments.fault_injection --workdir=/tmp/jaxsys_bad --bad_input

Each row of `CASES` prepares a workdir (empty, or a copy of one run trained to step 2) and
the command line, runs `python -m experiments.train` in the repository and checks: exit
status 1; the last line of stderr is its `error:` line and the only one, with no
traceback; it contains the row's words (the path or field, what is wrong, what would be
valid); every file and link the workdir had is as it was. A row that needs a file no one
may read (chmod 000) runs the binary without root's capabilities (`setpriv`) when run as
root, for whom chmod 000 blocks nothing. A new case is one row. Importing this module
imports no jax: the binary runs in processes of its own.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import time
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository: runs experiments.train
CONFIG = "--config=configs/tiny_lm.py:size=test"


@dataclasses.dataclass(frozen=True)
class Case:
  """prepare(workdir, scratch, argv) -> argv: damages the workdir (or writes a file into
  `scratch`) and returns the command line; `says`: words the error line must contain
  ({workdir} and {scratch} filled in)."""
  prepare: Callable[[pathlib.Path, pathlib.Path, list[str]], list[str]]
  says: tuple[str, ...]
  trained: bool = False  # the workdir is a copy of a run trained to step 2
  unprivileged: bool = False  # run without root's power to read any file


def _same(argv):
  return argv


def _do(action) -> Callable:
  """A prepare that runs action(workdir, scratch) and keeps the command line."""
  def prepare(workdir, scratch, argv):
    action(workdir, scratch)
    return argv
  return prepare


def _lock_dir(age_s: float):
  def action(workdir, scratch):
    (workdir / "run.lock" / "inside").mkdir(parents=True)
    os.utime(workdir / "run.lock", (time.time() - age_s,) * 2)
  return _do(action)


def _unreadable_lock(workdir, scratch):
  lock = workdir / "run.lock"
  lock.write_text('{"pid": 4194304, "host": "here", "started": 0}')
  lock.chmod(0)


def _link(target: str):
  def action(workdir, scratch):
    (workdir / "checkpoints").mkdir(exist_ok=True)
    os.symlink(target, workdir / "checkpoints" / "10")
  return _do(action)


def _spoil(path, how: str) -> None:
  """`path` made unreadable ("chmod") or replaced by a directory ("dir")."""
  if how == "chmod":
    path.chmod(0)
  else:
    path.unlink()
    path.mkdir()


def _step_file(rel: str, how: str):
  """Makes `rel` of step 2 unreadable ("chmod") or a directory ("dir")."""
  def action(workdir, scratch):
    path = workdir / "checkpoints" / "2" / rel
    if rel == "largest d/ file":
      path = max((p for p in (workdir / "checkpoints" / "2").rglob("*")
                  if p.is_file() and p.parent.name == "d"), key=lambda p: p.stat().st_size)
    _spoil(path, how)
  return _do(action)


def _config_file(text: str, mode: int | None = None):
  def prepare(workdir, scratch, argv):
    path = scratch / "config.py"
    path.write_text(text)
    if mode is not None:
      path.chmod(mode)
    return [f"--config={path}" if a == CONFIG else a for a in argv]
  return prepare


def _override_first(workdir, scratch, argv):
  at = argv.index(CONFIG)
  return argv[:at] + ["--config.total_steps=4"] + argv[at:]


def _ledger(how: str):
  """Makes the checkpoints' ledger (jaxsys/checkpoint/ledger.py) unreadable or a directory."""
  def action(workdir, scratch):
    _spoil(workdir / "checkpoints" / "ledger.jsonl", how)
  return _do(action)


def _metrics_dir(workdir, scratch):
  (workdir / "metrics.jsonl").mkdir()


# One row per kind of bad input (a new case is one row).
CASES = {
    "run.lock is a directory (fresh)": Case(_lock_dir(0), (
        "{workdir}/run.lock is a directory, not a lock file a run writes",
        "remove it if no run uses {workdir}")),
    "run.lock is a directory (an hour old)": Case(_lock_dir(3600), (
        "{workdir}/run.lock is a directory, not a lock file a run writes",)),
    "run.lock unreadable (chmod 000)": Case(_do(_unreadable_lock), (
        "{workdir}/run.lock cannot be opened (Permission denied)",), unprivileged=True),
    "checkpoints/10 a dangling symlink": Case(_link("/nonexistent"), (
        "{workdir}/checkpoints/10 is a symbolic link to '/nonexistent', which does not exist",
        "must be a checkpoint directory")),
    "checkpoints/10 a looping symlink": Case(_link("10"), (
        "{workdir}/checkpoints/10 is a symbolic link to '10', which loops",)),
    "checkpoints is a file": Case(_do(lambda w, s: (w / "checkpoints").write_text("x")), (
        "{workdir}/checkpoints is a file, not a directory; it must be a directory",)),
    "meta/metadata unreadable (chmod 000)": Case(_step_file("meta/metadata", "chmod"), (
        "checkpoint step 2 in {workdir}/checkpoints is corrupt: meta/metadata: unreadable "
        "(Permission denied)",), trained=True, unprivileged=True),
    "a state d/ file unreadable (chmod 000)": Case(_step_file("largest d/ file", "chmod"), (
        "checkpoint step 2 in {workdir}/checkpoints is corrupt: state/",
        "unreadable (Permission denied)"), trained=True, unprivileged=True),
    "meta/metadata a directory": Case(_step_file("meta/metadata", "dir"), (
        "is corrupt: meta/metadata: not a regular file",), trained=True),
    "checkpoints/ledger.jsonl unreadable": Case(_ledger("chmod"), (
        "{workdir}/checkpoints/ledger.jsonl is unreadable (Permission denied)",),
        trained=True, unprivileged=True),
    "checkpoints/ledger.jsonl a directory": Case(_ledger("dir"), (
        "{workdir}/checkpoints/ledger.jsonl is corrupt: not a regular file",), trained=True),
    "metrics.jsonl a directory": Case(_do(_metrics_dir), (
        "cannot use {workdir}/metrics.jsonl: Is a directory",)),
    "config file with a syntax error": Case(_config_file("def get_config(:\n  pass\n"), (
        "{scratch}/config.py line 1:", "it must be a Python file that defines get_config()")),
    "config file unreadable (chmod 000)": Case(_config_file("def get_config(): pass\n", 0), (
        "cannot read {scratch}/config.py: Permission denied",), unprivileged=True),
    "config file without get_config": Case(_config_file("x = 1\n"), (
        "{scratch}/config.py defines no get_config()",)),
    "--config.x=... before --config=...": Case(_override_first, (
        "--config.total_steps=4 comes before --config=configs/tiny_lm.py:size=test",
        "put --config=... first")),
    "--config.model.d_model=1000000000": Case(
        lambda w, s, argv: argv + ["--config.model.d_model=1000000000"], (
            "model.d_model=1000000000", "of this host's memory", "Adam moments",
            "--config.check_memory=false")),
    "--config.data.batch_size=1000000000000": Case(
        lambda w, s, argv: argv + ["--config.data.batch_size=1000000000000"], (
            "data.batch_size=1000000000000", "of this host's memory", "activations",
            "loader buffers", "--config.check_memory=false")),
}


def command(workdir, source: str, steps: int = 4) -> list[str]:
  return ["-m", "experiments.train", CONFIG, f"--config.data.source={source}",
          "--config.data.num_threads=0", f"--workdir={workdir}", f"--config.total_steps={steps}",
          "--config.checkpoint_every=2", "--config.eval_every=0"]


def _unprivileged() -> list[str]:
  return ["setpriv", "--inh-caps=-all", "--bounding-set=-all"] if os.geteuid() == 0 else []


def _snapshot(directory: pathlib.Path) -> dict[str, object]:
  """Every entry under `directory`: a file's bytes (None if unreadable), a link's target."""
  out = {}
  for root, dirs, files in os.walk(directory):
    for name in dirs + files:
      path = pathlib.Path(root) / name
      rel = str(path.relative_to(directory))
      if path.is_symlink():
        out[rel] = ("link", os.readlink(path))
      elif path.is_dir():
        out[rel] = ("dir", None)
      else:
        try:
          out[rel] = ("file", path.read_bytes())
        except OSError:
          out[rel] = ("file", None)
  return out


def _one(name: str, case: Case, root: pathlib.Path, base: pathlib.Path | None,
         source: str) -> dict:
  number = list(CASES).index(name)
  workdir, scratch = root / f"case{number}", root / f"scratch{number}"
  scratch.mkdir()
  if case.trained:
    shutil.copytree(base, workdir, symlinks=True)
  else:
    workdir.mkdir()
  argv = case.prepare(workdir, scratch, command(workdir, source))
  before = _snapshot(workdir)
  prefix = _unprivileged() if case.unprivileged else []
  proc = subprocess.run([*prefix, sys.executable, *argv], cwd=ROOT, capture_output=True,
                        text=True, timeout=600)
  lines = proc.stderr.strip().splitlines()
  last = lines[-1] if lines else ""
  after = _snapshot(workdir)
  says = [w.format(workdir=workdir, scratch=scratch) for w in case.says]
  problems = []
  if proc.returncode != 1:
    problems.append(f"exit status {proc.returncode}, not 1")
  if "Traceback" in proc.stderr:
    problems.append("a traceback")
  if [l for l in lines if l.startswith("error:")] != [last] or not last.startswith("error: "):
    problems.append("not one error: line, last")
  problems += [f"the line does not say {w!r}" for w in says if w not in last]
  changed = [k for k, v in before.items() if after.get(k) != v]
  if changed:
    problems.append(f"changed or removed: {changed[:5]}")
  return {"case": name, "exit": proc.returncode, "line": last, "problems": problems,
          "stderr_tail": "" if not problems else proc.stderr[-3000:]}


def run(workdir: str, source: str) -> dict:
  """Every row of CASES (see the module docstring), two at a time."""
  root = pathlib.Path(workdir)
  start = time.monotonic()
  base = root / "trained"
  proc = subprocess.run([sys.executable, *command(base, source, 2)], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
  if proc.returncode:
    return {"rows": [], "problems": [f"the 2-step run exited {proc.returncode}: "
                                     f"{proc.stderr[-2000:]}"]}
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    rows = list(pool.map(lambda item: _one(*item, root, base, source), CASES.items()))
  problems = [f"{r['case']}: {p}" for r in rows for p in r["problems"]]
  return {"rows": rows, "problems": problems, "seconds": time.monotonic() - start}


def summary(result: dict) -> str:
  rows = [f"{'bad input':<40} {'exit':>4}  error line"]
  for r in result["rows"]:
    rows.append(f"{r['case']:<40} {r['exit']:>4}  {r['line'][:150]}")
  rows += [f"FAIL: {p}" for p in result["problems"]] or [
      f"OK: each of {len(result['rows'])} cases ends in one error: line naming what is wrong, "
      "exit 1, no traceback, nothing of the workdir changed"]
  return "\n".join(rows)
